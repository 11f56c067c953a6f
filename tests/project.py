"""A small project on disk (model file, checkpoint, data, config) for end-to-end tests."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import torch
import yaml
from typer.testing import CliRunner, Result

from gradscope.cli import app, main
from gradscope.engine import Engine
from gradscope.engine.replay.programs import Replayed
from gradscope.io.parquet import partial_path
from gradscope.scorers import NormsScorer

MODEL_PY = '''
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self, hidden: int = 8, classes: int = 3):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(5, hidden), nn.Linear(hidden, classes)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


class TupleNet(Net):
    def forward(self, x):
        return super().forward(x), x


class Columns(Net):
    """Five scalar columns (a CSV table) as five inputs."""

    def forward(self, *columns):
        return super().forward(torch.stack(columns, 1))


def make_dataset():
    g = torch.Generator().manual_seed(1)
    return {"features": torch.randn(9, 5, generator=g), "label": torch.randint(0, 3, (9,), generator=g)}
'''


def make_project(root: Path, n: int = 23, **config: Any) -> Path:
    """Write model.py, net.pt, data.pt and config.yaml under ``root``; returns the config path."""
    (root / "model.py").write_text(MODEL_PY)
    g = torch.Generator().manual_seed(0)
    state = {
        "fc1.weight": torch.randn(8, 5, generator=g),
        "fc1.bias": torch.randn(8, generator=g),
        "fc2.weight": torch.randn(3, 8, generator=g),
        "fc2.bias": torch.randn(3, generator=g),
    }
    torch.save(state, root / "net.pt")
    x = torch.randn(n, 5, generator=g)
    y = torch.randint(0, 3, (n,), generator=g)
    torch.save({"x": x, "y": y, "name": torch.arange(100, 100 + n)}, root / "data.pt")
    cfg = {
        "model": {"factory": "model.py:Net", "checkpoint": "net.pt"},
        "data": {"path": "data.pt", "inputs": "x", "targets": "y", "batch_size": 4},
        "device": "cpu",
        "output": {"path": "scores.parquet"},
    }
    for key, value in config.items():
        section, _, name = key.partition("__")
        if name:
            cfg.setdefault(section, {})[name] = value
        else:
            cfg[section] = value
    path = root / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def make_ref_project(root: Path, n: int, refs: int) -> Path:
    """make_project's model and ``n`` rows in float64, and ``ref.pt``: ``refs`` rows drawn
    apart from them; the folder."""
    make_project(root, n=n, dtype="float64")
    g = torch.Generator().manual_seed(5)
    torch.save({"x": torch.randn(refs, 5, generator=g),
                "y": torch.randint(0, 3, (refs,), generator=g)}, root / "ref.pt")  # fmt: skip
    return root


def load_net(root: Path) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """The project's model with its checkpoint, and its data, for the oracle."""
    from gradscope.io.model import import_object

    net = import_object(f"{root / 'model.py'}:Net", "test")()
    net.load_state_dict(torch.load(root / "net.pt"))
    data = torch.load(root / "data.pt")
    return net, data["x"], data["y"]


def edit_config(root: Path, change: Callable[[dict], None]) -> None:
    config = root / "config.yaml"
    raw = yaml.safe_load(config.read_text())
    change(raw)
    config.write_text(yaml.safe_dump(raw))


def edit_checkpoint(root: Path, change: Callable[[dict], None]) -> None:
    state = torch.load(root / "net.pt")
    change(state)
    torch.save(state, root / "net.pt")


ROWS_PY = """
import pathlib

import torch


def make():
    return torch.load(pathlib.Path(__file__).with_name("data.pt"))
"""


def made_by_code(root: Path) -> str:
    """``rows.py:make``, data made by code from ``data.pt``: a file no config names."""
    (root / "rows.py").write_text(ROWS_PY)
    return "rows.py:make"


def edit_data(root: Path, change: Callable[[dict], None]) -> None:
    data = torch.load(root / "data.pt")
    change(data)
    torch.save(data, root / "data.pt")


SLOW_MODEL = """
import os
import time

from model import Net


class SlowNet(Net):
    def forward(self, x):
        time.sleep(float(os.environ.get("SLOW", 0)))
        return super().forward(x)
"""


def slow_project(root: Path, n: int = 40) -> Path:
    """make_project with SlowNet as the model: each forward sleeps $SLOW seconds."""
    (root / "slow.py").write_text(SLOW_MODEL)
    return make_project(root, n=n, model__factory="slow.py:SlowNet")


def launch(config, *args, slow=0.05, env=None):
    """``python -m gradscope norms`` in a subprocess, each forward ``slow`` seconds long."""
    env = {**os.environ, "SLOW": str(slow), "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.Popen(
        [sys.executable, "-m", "gradscope", "norms", str(config), "--batch-size", "2", *args],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def wait_for_parts(out, n: int, proc) -> None:
    deadline = time.monotonic() + 60
    while len(list(partial_path(out).glob("part-*.parquet"))) < n:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.02)


class CountingNorms(NormsScorer):
    """The norms scorer, keeping the first row of each batch it scores; interrupted (as by Ctrl-C)
    when it reaches its ``stop``-th batch."""

    def __init__(self, stop: int | None = None):
        super().__init__()
        self.stop, self.scored = stop, []

    def columns(self, job, batch):
        if len(self.scored) == self.stop:
            raise KeyboardInterrupt
        self.scored.append(int(batch.index[0]))
        return super().columns(job, batch)


def one_error(result) -> str:
    """A CliRunner result that ended as a user error: exit status 2 and one ``error:`` line on
    stderr, no traceback; returns the line."""
    assert result.exit_code == 2, result.output
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: ") and "Traceback" not in result.output
    return line


def fails(monkeypatch, capsys, *args: object) -> str:
    """``gradscope ARGS`` through ``main`` (as the console script runs it), ended as a user
    error: exit status 2 and one ``error:`` line on stderr, no traceback; returns it."""
    monkeypatch.setattr(sys, "argv", ["gradscope", *map(str, args)])
    with pytest.raises(SystemExit) as exit_:
        main()
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err and err.count("\n") == 1
    return err


class Marker:
    """A pickle that touches a file when loaded: loading must not run it."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return pathlib.Path.touch, (self.path,)


LFS = "version https://git-lfs.github.com/spec/v1\noid sha256:0\nsize 9\n"  # a Git LFS pointer


def adapted(base: torch.nn.Module, lora: object, folder: Path) -> torch.nn.Module:
    """``base`` with LoRA adapters as if trained (B nonzero: peft starts it at 0), saved there."""
    import peft  # called only by the tests that skip without it

    model = peft.get_peft_model(base, lora)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    model.save_pretrained(folder)
    return model


def run_cli(
    root: Path, model: dict, data: dict, loss: str | dict, *command: str, dtype="float64"
) -> pd.DataFrame:
    """``gradscope <command> config.yaml <options>`` (``norms`` unless given) through typer's
    runner, on a config written into ``root`` from these sections (a loss given by its name or
    as its section), 3 examples a batch unless ``data`` says; the scores file it wrote."""
    result = invoke_cli(root, model, data, loss, *command, dtype=dtype)
    assert result.exit_code == 0, result.output
    return pd.read_parquet(root / "scores.parquet")


def cli_norms(
    root: Path, model: torch.nn.Module, factory: str, batches: list[tuple[tuple, torch.Tensor]]
) -> list[torch.Tensor]:
    """``gradscope norms`` over ``batches`` (each one input, all of one size) as one run: the
    model's state dict saved, ``factory`` (``module:name``, importable from the tests) building
    it; each batch's grad_norm column."""
    size = len(batches[0][1])
    torch.save(
        {"x": torch.cat([b[0][0] for b in batches]), "y": torch.cat([b[1] for b in batches])},
        root / "data.pt",
    )
    scores = run_cli(
        root,
        saved_model(root, model, factory),
        {"path": "data.pt", "inputs": ["x"], "targets": "y", "batch_size": size},
        "cross_entropy",
    )
    norms = torch.tensor(scores["grad_norm"].to_numpy())
    return list(norms.split(size))


def saved_model(root: Path, model: torch.nn.Module, factory: str) -> dict:
    """The config's model section for ``model``: its state dict saved to model.pt, built by
    ``factory`` (``module:name``, importable from the tests) through a models.py naming it."""
    torch.save(model.state_dict(), root / "model.pt")
    module, name = factory.split(":")
    (root / "models.py").write_text(f"from {module} import {name} as make\n")
    return {"factory": "models.py:make", "checkpoint": "model.pt"}


def invoke_cli(
    root: Path, model: dict, data: dict, loss: str | dict, *command: str, dtype="float64"
) -> Result:
    """``run_cli``'s run, whatever it ends in: the runner's result."""
    config = root / "config.yaml"
    raw = {
        "model": model,
        "data": {"batch_size": 3, **data},
        "loss": loss if isinstance(loss, dict) else {"name": loss},
        "device": "cpu",
        "dtype": dtype,
        "output": {"path": "scores.parquet"},
    }
    config.write_text(yaml.safe_dump(raw, sort_keys=False))
    return CliRunner().invoke(app, [*(command or ["norms"])[:1], str(config), *command[1:]])


def count_passes(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """The passes analysed and replayed from now on, counted as they run (the numbers are
    exact either way: only the counts tell a replay from an analysis)."""
    passes = {"analysed": 0, "replayed": 0}
    analysed, replayed = Engine._analysed, Replayed.__call__

    def counted_analysis(self, *args):
        passes["analysed"] += 1
        return analysed(self, *args)

    def counted_replay(self, *args):
        out = replayed(self, *args)
        passes["replayed"] += out is not None
        return out

    monkeypatch.setattr(Engine, "_analysed", counted_analysis)
    monkeypatch.setattr(Replayed, "__call__", counted_replay)
    return passes


# a test Trainer's settings but its own: on the CPU, nothing saved, logged or reported, the
# batch's every column kept (the watch reads the ids column)
QUIET = {"remove_unused_columns": False, "report_to": [], "save_strategy": "no",
         "logging_strategy": "no", "disable_tqdm": True, "use_cpu": True}  # fmt: skip


def trainer_args(out: str, **settings: Any) -> Any:
    """A Hugging Face ``TrainingArguments`` writing to ``out``: ``QUIET`` and ``settings``."""
    import transformers

    return transformers.TrainingArguments(out, **{**QUIET, **settings})
