"""`gradscope norms` and `gradscope influence --ref` on models whose engine paths the engine's
own tests check through one Engine: JetMoE's nn.Linear calls inside routed regions, Llama 4's
experts that run every token (lanes), XLNet's sequence-first einsum reads, Switch
Transformers' rows moved off dimension 0 (``replay/moved.py``), BiT's written-out VJPs
(``backs.py``, ``torch.func`` refused), LongT5's position bias read element by element, and
Ergo's rows repeated per route and experts looped over by ``unique`` (the row flow). The
config's factory hands the CLI the test's own model, in train mode with one child in eval:
the Parquet's numbers are the float64 per-example loop's over three batches (the last of one
example), no parameter is on the fallback, and the model's parameters, buffers, modes and
hooks are as before the call."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import torch
from oracle import assert_rel_close, model_state, reference_influence, reference_norms
from path_models import BiT, Ergo, LocalBias
from project import invoke_cli, saved_model
from torch import Tensor, nn

from gradscope.io.parquet import read_metadata
from tests.engine.replay.test_lane_experts import Model as Lanes
from tests.engine.replay.test_moved_rows import Model as Switch
from tests.engine.replay.test_routed_linears import Model as Routed
from tests.engine.replay.test_sequence_first_einsum import SequenceFirst

N, REFS, BATCH, T = 7, 2, 3, 5  # batches of 3, 3 and 1
HELD: list[nn.Module] = []  # the model the config's factory hands the CLI


def held() -> nn.Module:
    """The config's factory: the test's own model, whose state the test compares after."""
    return HELD[0]


def _rows(make: type[nn.Module], n: int, seed: int) -> tuple[Tensor, Tensor]:
    """(inputs, targets) of ``n`` examples: token ids predicting themselves for the sequence
    model, else (n, T, 8) features and a class each."""
    g = torch.Generator().manual_seed(seed)
    if make is SequenceFirst:
        ids = torch.randint(0, 12, (n, T), generator=g)
        return ids, ids
    x = torch.randn(n, T, 8, generator=g, dtype=torch.float64)
    return x, torch.randint(0, 3, (n,), generator=g)


def _project(root: Path, make: type[nn.Module]) -> tuple[nn.Module, dict, dict]:
    """The model (float64, train mode but for its first child) saved and handed to the CLI by
    ``held``, data.pt and ref.pt written; the model and the config's model and data sections."""
    torch.manual_seed(0)
    model = make().double().train()
    next(model.children()).eval()
    for name, (n, seed) in {"data": (N, 1), "ref": (REFS, 2)}.items():
        x, y = _rows(make, n, seed)
        torch.save({"x": x, "y": y}, root / f"{name}.pt")
    HELD[:] = [model]
    section = saved_model(root, model, f"{__name__}:held")
    return model, section, {"path": "data.pt", "inputs": "x", "targets": "y", "batch_size": BATCH}


def _run(root: Path, make: type[nn.Module], monkeypatch, *command: str) -> nn.Module:
    """The CLI's ``command`` on ``make``'s project, the model asserted kept: the model. BiT's
    weights are carried back by ``backs.py`` alone, ``torch.func`` refused."""
    model, section, data = _project(root, make)
    if make is BiT:
        for name in ("vjp", "vmap"):
            monkeypatch.setattr(torch.func, name, lambda *a, **k: pytest.fail("torch.func"))
    before = model_state(model)
    result = invoke_cli(root, section, data, "cross_entropy", *command)
    assert result.exit_code == 0, result.output
    before.assert_kept(model)
    return model


def _served(out: Path) -> None:
    """Every parameter served by a rule: none on the fallback, none left out."""
    plan = read_metadata(out)["plan"]
    unserved = [p["name"] for p in plan if p["rule"].startswith(("fallback", "excluded"))]
    assert plan and not unserved, unserved


MODELS = pytest.mark.parametrize(
    "make",
    [Routed, Lanes, SequenceFirst, Switch, BiT, LocalBias, Ergo],
    ids=[
        "jetmoe",
        "llama4-lanes",
        "xlnet",
        "switch-moved",
        "bit-backs",
        "longt5-elements",
        "ergo-rowflow",
    ],
)


@MODELS
def test_norms_are_the_loops(tmp_path: Path, make: type[nn.Module], monkeypatch) -> None:
    model = _run(tmp_path, make, monkeypatch, "norms")
    frame = pd.read_parquet(tmp_path / "scores.parquet")
    x, y = torch.load(tmp_path / "data.pt").values()
    loss, norm = reference_norms(model, (x,), y, "cross_entropy")
    assert frame["example_id"].tolist() == list(range(N))
    assert_rel_close(torch.tensor(frame["loss"].to_numpy()), loss, 1e-9)
    assert_rel_close(torch.tensor(frame["grad_norm"].to_numpy()), norm, 1e-9)
    _served(tmp_path / "scores.parquet")


@MODELS
def test_influence_is_the_loops(tmp_path: Path, make: type[nn.Module], monkeypatch) -> None:
    out = tmp_path / "influence.parquet"
    command = ("influence", "--ref", str(tmp_path / "ref.pt"), "--curvature", "none")
    model = _run(tmp_path, make, monkeypatch, *command, "--out", str(out))
    frame = pd.read_parquet(out)
    x, y = torch.load(tmp_path / "data.pt").values()
    ref = torch.load(tmp_path / "ref.pt")
    expected, norm, _ = reference_influence(
        model, (x,), y, ((ref["x"],), ref["y"]), "cross_entropy"
    )  # (N, 1), (N,)
    assert_rel_close(torch.tensor(frame["influence"].to_numpy()), expected[:, 0], 1e-9)
    assert_rel_close(torch.tensor(frame["grad_norm"].to_numpy()), norm, 1e-9)
    _served(out)
