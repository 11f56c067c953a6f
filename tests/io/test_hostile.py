"""Hostile inputs, round two: folders are inputs too, planted links are never followed, and no
command prints a traceback or a misleading line."""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from project import (
    LFS,
    Marker,
    edit_config,
    edit_data,
    launch,
    make_project,
    one_error,
    slow_project,
    wait_for_parts,
)
from test_run_safety import files, interrupted, split_shards
from test_run_safety import project as held_project
from typer.testing import CliRunner

from gradscope.cli import app
from gradscope.io.lock import lock_path
from gradscope.io.parquet import partial_path, read_metadata

runner = CliRunner()


def folder(root: Path, name: str, *names: str) -> None:
    (root / name).mkdir()
    for file in names:
        (root / name / file).write_text("{}")


def pretrained(root: Path) -> None:
    folder(root, "lm", "config.json", "model.safetensors")
    edit_config(root, lambda c: c["model"].update(pretrained="lm"))


def saved_dataset(root: Path) -> None:
    folder(root, "ds", "state.json", "data-00000-of-00001.arrow")
    edit_config(root, lambda c: c["data"].update(path="ds"))


def tokenizer(root: Path) -> None:
    folder(root, "tok", "tokenizer.json")
    edit_config(root, lambda c: c.update(report={"tokenizer": "tok"}))


def scored(root: Path) -> None:
    """A scores file whose metadata names the run's inputs; the config then goes."""
    assert runner.invoke(app, ["norms", str(root / "config.yaml")]).exit_code == 0
    (root / "config.yaml").unlink()


def preconditioned(metadata: str):
    """A scores file of norms --precondition with factors, its metadata ``metadata``."""

    def setup(root: Path) -> None:
        edit_config(root, lambda c: c["output"].update(metadata=metadata))
        config, factors = str(root / "config.yaml"), str(root / "f.safetensors")
        args = ["factors", config, "--out", factors, "--fisher", "empirical"]
        assert runner.invoke(app, args).exit_code == 0
        assert runner.invoke(app, ["norms", config, "--precondition", factors]).exit_code == 0

    return setup


def device(root: Path) -> None:
    try:  # a copy of /dev/null, as root can make it
        os.mknod(root / "null", stat.S_IFCHR | 0o666, os.makedev(1, 3))
    except PermissionError:
        pytest.skip("mknod is not allowed here")


# (id, how to set the project up, the command line, the start of the error line)
REFUSED = [
    (
        "file-in-pretrained-folder",
        pretrained,
        ["norms", "{c}", "--out", "{r}/lm/model.safetensors"],
        "the output path is inside the run's model.pretrained folder (",
    ),
    (
        "new-file-in-pretrained-folder",
        pretrained,
        ["norms", "{c}", "--out", "{r}/lm/scores.parquet"],
        "the output path is inside the run's model.pretrained folder (",
    ),
    (
        "state-json-of-a-saved-dataset",
        saved_dataset,
        ["norms", "{c}", "--out", "{r}/ds/state.json"],
        "the output path is inside the run's data.path folder (",
    ),
    (
        "report-tokenizer",
        tokenizer,
        ["norms", "{c}", "--out", "{r}/tok/tokenizer.json"],
        "the output path is inside the run's report.tokenizer folder (",
    ),
    (
        "report-onto-the-data-its-metadata-names",
        scored,
        ["report", "{r}/scores.parquet", "--out", "{r}/data.pt"],
        "the output path is the run's data.path (",
    ),
    (
        "report-onto-the-checkpoint-its-metadata-names",
        scored,
        ["report", "{r}/scores.parquet", "--out", "{r}/net.pt"],
        "the output path is the run's model.checkpoint (",
    ),
    (
        "report-onto-the-factors-its-metadata-names",
        preconditioned("full"),
        ["report", "{r}/scores.parquet", "--out", "{r}/f.safetensors"],
        "the output path is the run's --precondition (",
    ),
    (
        "report-onto-the-factors-minimal-metadata-records",
        preconditioned("minimal"),
        ["report", "{r}/scores.parquet", "--out", "{r}/f.safetensors"],
        "the output path holds the file the scores file records as an input (precondition.sha256: ",
    ),
    (
        "report-onto-the-checkpoint-minimal-metadata-records",
        preconditioned("minimal"),
        ["report", "{r}/scores.parquet", "--out", "{r}/net.pt"],
        "the output path holds the file the scores file records as an input (checkpoint_sha256: ",
    ),
    (
        "new-file-a-data-glob-matches",
        split_shards,
        ["norms", "{c}", "--out", "{r}/shards/c.pt"],
        "the output path matches the run's data.path pattern (",
    ),
    (
        "new-file-a-ref-glob-matches",
        lambda r: folder(r, "refs", "a.pt"),
        ["influence", "{c}", "--ref", "{r}/refs/*.pt", "--out", "{r}/refs/z.pt"],
        "the output path matches the run's --ref pattern (",
    ),
    (
        "device-file",
        device,
        ["norms", "{c}", "--out", "{r}/null"],
        "the output path is not a regular file",
    ),
    (
        "fifo",
        lambda r: os.mkfifo(r / "pipe"),
        ["norms", "{c}", "--out", "{r}/pipe"],
        "the output path is not a regular file",
    ),
    (
        "trailing-slash",
        None,
        ["norms", "{c}", "--out", "{r}/results/"],
        "the output path '",
    ),
    (
        "trailing-slash-in-config",
        lambda r: edit_config(r, lambda c: c["output"].update(path="results/")),
        ["norms", "{c}"],
        "the output path 'results/' ends with '/'",
    ),
    (
        "report-trailing-slash",
        scored,
        ["report", "{r}/scores.parquet", "--out", "{r}/results/"],
        "the output path '",
    ),
    (
        "folder-that-does-not-exist",
        None,
        ["norms", "{c}", "--out", "{r}/nope/scores.parquet"],
        "the output's folder ",
    ),
]


@pytest.mark.parametrize(
    ("setup", "args", "message"), [pytest.param(*case[1:], id=case[0]) for case in REFUSED]
)
def test_output_inside_an_input_or_not_a_regular_file_is_refused(tmp_path, setup, args, message):
    config = make_project(tmp_path)
    if setup:
        setup(tmp_path)
    before = files(tmp_path)
    result = runner.invoke(app, [a.format(c=config, r=tmp_path) for a in args])
    line = one_error(result)
    assert line.startswith(f"error: {message}"), line
    assert files(tmp_path) == before  # nothing written, nothing replaced
    assert not (tmp_path / "results").exists() and not (tmp_path / "nope").exists()
    assert not list(tmp_path.glob(".*.lock")) and not list(tmp_path.glob(".*.partial"))
    if setup is device:
        assert stat.S_ISCHR((tmp_path / "null").stat().st_mode)


def victim(root: Path) -> Path:
    path = root / "victim.txt"
    path.write_text("precious\n")
    return path


@pytest.mark.parametrize("link", ["symlink", "hard-link", "folder"])
def test_a_link_planted_at_the_lock_is_neither_followed_nor_truncated(tmp_path, link):
    config = make_project(tmp_path)
    target = victim(tmp_path)
    lock = lock_path(tmp_path / "scores.parquet")
    plant = {"symlink": lock.symlink_to, "hard-link": lambda t: os.link(t, lock)}
    plant.get(link, lambda t: lock.mkdir())(target)
    line = one_error(runner.invoke(app, ["norms", str(config)]))
    assert line.startswith("error: the lock file is "), line
    assert str(lock) in line
    assert target.read_text() == "precious\n" and not (tmp_path / "scores.parquet").exists()


def test_a_symlink_planted_at_a_temporary_name_is_not_followed(tmp_path, monkeypatch):
    config = make_project(tmp_path)
    target = victim(tmp_path)
    monkeypatch.setattr(secrets, "token_hex", lambda n: "0" * 2 * n)  # the name is foreseen
    (tmp_path / f".scores.parquet.{os.getpid()}-00000000.tmp").symlink_to(target)
    line = one_error(runner.invoke(app, ["norms", str(config)]))
    assert line.startswith("error: cannot write the scores: File exists"), line
    assert target.read_text() == "precious\n"


def test_an_output_named_by_a_link_replaces_the_link_not_its_target(tmp_path, monkeypatch):
    """`--out` was resolved through a link: a page or scores file elsewhere was replaced, and a
    dangling link made a file where it pointed."""
    config = make_project(tmp_path)
    far = tmp_path / "far"
    far.mkdir()
    assert (
        runner.invoke(app, ["norms", str(config), "--out", str(far / "kept.parquet")]).exit_code
        == 0
    )
    kept = (far / "kept.parquet").read_bytes()
    monkeypatch.chdir(tmp_path)
    Path("out.parquet").symlink_to(far / "kept.parquet")
    Path("new.parquet").symlink_to(far / "new.parquet")  # dangling
    for name in ("out.parquet", "new.parquet"):
        result = runner.invoke(app, ["norms", str(config), "--out", name])
        assert result.exit_code == 0, result.output
        assert Path(name).is_file() and not Path(name).is_symlink()
    assert (far / "kept.parquet").read_bytes() == kept and not (far / "new.parquet").exists()


def test_report_temporary_and_partial_folder_links_are_not_followed(tmp_path):
    config = make_project(tmp_path)
    target = victim(tmp_path)
    (tmp_path / ".scores.html.tmp").symlink_to(target)  # the report's old, fixed name
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("kept")
    partial_path(tmp_path / "scores.parquet").symlink_to(elsewhere)
    line = one_error(runner.invoke(app, ["norms", str(config), "--resume"]))
    assert line.startswith("error: the partial folder is a symbolic link"), line
    result = runner.invoke(app, ["norms", str(config), "--report"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "scores.html").read_text().startswith("<!")
    assert target.read_text() == "precious\n" and (elsewhere / "keep.txt").read_text() == "kept"
    assert not partial_path(tmp_path / "scores.parquet").exists()


MORE_CODE = """

class Detached(Net):
    pass


def detached(outputs, targets):
    import torch.nn.functional as F
    return F.cross_entropy(outputs.detach(), targets, reduction="none")


class Dollar(nn.Module):
    '''A module whose name is TeX to matplotlib.'''

    def __init__(self):
        super().__init__()
        self.add_module("a$^$b", nn.Linear(5, 3))

    def forward(self, x):
        return getattr(self, "a$^$b")(x)
"""

# a billion laughs in model.kwargs, which takes any mapping: copying it never ends
BOMB = "    a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"    {b}: &{b} [*{a}, *{a}, *{a}, *{a}, *{a}, *{a}, *{a}, *{a}, *{a}, *{a}]\n"
    for a, b in zip("abcdefg", "bcdefgh", strict=True)
)


def bomb(root: Path) -> None:
    text = (root / "config.yaml").read_text()
    (root / "config.yaml").write_text(text.replace("model:\n", "model:\n  kwargs:\n" + BOMB))


def labels(value: int):
    return lambda r: edit_data(r, lambda d: d["y"].__setitem__(5, value))


def binary_targets(root: Path) -> None:
    edit_data(root, lambda d: d.update(y=torch.randint(0, 2, d["y"].shape).float() * 2 - 1))
    edit_config(root, lambda c: c["model"].update(kwargs={"classes": 1}, checkpoint=None))
    edit_config(root, lambda c: c.update(loss={"name": "bce_with_logits"}))


def widths(root: Path) -> None:
    """Two shards whose inputs differ in width; batch 2 takes rows from both."""
    data = torch.load(root / "data.pt")
    (root / "shards").mkdir()
    torch.save({k: v[:10] for k, v in data.items()}, root / "shards" / "a.pt")
    wide = {k: v[10:] for k, v in data.items()} | {"x": torch.randn(13, 6)}
    torch.save(wide, root / "shards" / "b.pt")
    edit_config(root, lambda c: c["data"].update(path="shards/*.pt"))


def state_json(text: str):
    def spoil(root: Path) -> None:
        folder(root, "ds", "data-00000-of-00001.arrow")
        (root / "ds" / "state.json").write_text(text)
        edit_config(root, lambda c: c["data"].update(path="ds"))

    return spoil


def lfs_checkpoint(root: Path) -> None:
    (root / "net.pt").write_text(LFS)


def pickled_data(root: Path) -> None:
    torch.save({"x": Marker(root / "ran")}, root / "data.pt")


# (id, how to spoil the project, arguments, start of the error line, text it must name)
CASES = [
    ("label-too-large", labels(3), [], "target 3 is not a class id of the model's 3 outputs", "data.targets"),
    ("label-negative", labels(-1), [], "target -1 is not a class id of the model's 3 outputs", "data.targets"),
    ("bce-plus-minus-one", binary_targets, [], "bce_with_logits takes targets in [0, 1] (the probability of class 1); found -1", "data.targets"),
    (
        "duplicate-yaml-key",
        lambda r: (r / "config.yaml").write_text((r / "config.yaml").read_text() + "device: cuda\n"),
        [],
        "malformed YAML: key 'device' is given twice",
        "config.yaml, line",
    ),
    (
        "non-string-yaml-key",
        lambda r: edit_config(r, lambda c: c["model"].update(kwargs={1: 2})),
        [],
        "malformed YAML: key 1 is not a string; quote it",
        "config.yaml, line",
    ),
    (
        "yaml-nested-deep",
        lambda r: (r / "config.yaml").write_text("a: " + "[" * 50000 + "]" * 50000 + "\n"),
        [],
        "the config nests too deeply to read",
        "config.yaml",
    ),
    ("yaml-alias-bomb", bomb, [], "the config expands to more than 100000 values", "config.yaml"),
    ("device-cpu-abc", None, ["--device", "cpu:abc"], "--device must be one of", "'cpu:abc'"),
    ("device-gpu", None, ["--device", "gpu"], "--device must be one of", "'gpu' (--device)"),
    ("shards-of-different-widths", widths, [], "row 10 and the rows before it do not fit one batch", "data.path"),
    ("corrupt-state-json", state_json("{"), [], "state.json does not list the dataset's files", "state.json"),
    (
        "state-json-outside-the-folder",
        state_json('{"_data_files": [{"filename": "../data.pt"}]}'),
        [],
        "state.json names '../data.pt', not a file inside the dataset folder",
        "state.json",
    ),
    (
        "detached-loss",
        lambda r: edit_config(r, lambda c: c.update(loss={"name": "model.py:detached"})),
        [],
        "the loss is detached from the model's outputs",
        "(loss)",
    ),
    ("lfs-pointer-checkpoint", lfs_checkpoint, [], "a Git LFS pointer, not the file itself", "net.pt"),
    ("lfs-pointer-trusted", lfs_checkpoint, ["--trust-checkpoint"], "a Git LFS pointer", "net.pt"),
    ("lfs-pointer-data", lambda r: (r / "data.pt").write_text(LFS), [], "a Git LFS pointer", "data.pt"),
    ("pickle-in-data", pickled_data, [], "the data file holds objects other than tensors", "data.pt"),
    ("rank-out-of-range", None, ["env:WORLD_SIZE=2", "env:RANK=5"], "RANK 5 is not a rank of WORLD_SIZE 2", "environment"),
    (
        "world-size-without-master",
        None,
        ["env:WORLD_SIZE=2", "env:RANK=1"],
        "WORLD_SIZE is 2 but MASTER_ADDR and MASTER_PORT are not set",
        "environment",
    ),
    ("metadata-setting", lambda r: edit_config(r, lambda c: c["output"].update(metadata="none")), [], "'output.metadata' must be full or minimal", "config.yaml"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("spoil", "args", "message", "names"), [pytest.param(*case[1:], id=case[0]) for case in CASES]
)
def test_exit_2_with_one_line(tmp_path, monkeypatch, spoil, args, message, names):
    for name in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for arg in [a for a in args if a.startswith("env:")]:
        monkeypatch.setenv(*arg[4:].split("="))
    config = make_project(tmp_path)
    with (tmp_path / "model.py").open("a") as f:
        f.write(MORE_CODE)
    if spoil:
        spoil(tmp_path)
    args = [a for a in args if not a.startswith("env:")]
    result = runner.invoke(app, ["norms", str(config), *args])
    line = one_error(result)
    assert line.startswith(f"error: {message}") and names in line, line
    assert not list(tmp_path.glob("*.parquet")) and not (tmp_path / "ran").exists()


def whole_run(config: Path, root: Path) -> pd.DataFrame:
    out = root / "whole.parquet"
    assert runner.invoke(app, ["norms", str(config), "--out", str(out)]).exit_code == 0
    return pd.read_parquet(out)


def test_ctrl_c_while_assembling_says_every_batch_is_saved(tmp_path, monkeypatch):
    config = make_project(tmp_path)  # 23 rows: 6 batches of 4

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(pq, "read_table", interrupt)  # read only when assembling
    result = runner.invoke(app, ["norms", str(config)])
    assert result.exit_code == 130, result.output
    partial = partial_path(tmp_path / "scores.parquet")
    assert result.stderr.strip().splitlines() == [
        f"error: interrupted with 23 examples saved; run the same command with --resume to "
        f"continue ({partial})"
    ]
    assert not (tmp_path / "scores.parquet").exists() and not list(tmp_path.glob(".*.tmp"))
    assert not lock_path(tmp_path / "scores.parquet").exists()
    monkeypatch.undo()
    assert runner.invoke(app, ["norms", str(config), "--resume"]).exit_code == 0
    pd.testing.assert_frame_equal(
        pd.read_parquet(tmp_path / "scores.parquet"), whole_run(config, tmp_path), check_exact=True
    )


def test_ctrl_c_while_writing_the_report_says_the_scores_are_saved(tmp_path, monkeypatch):
    config = make_project(tmp_path)

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("gradscope.report.write_report", interrupt)
    result = runner.invoke(app, ["norms", str(config), "--report"])
    assert result.exit_code == 130, result.output
    out = tmp_path / "scores.parquet"
    assert result.stderr.strip().splitlines() == [
        f"error: interrupted after every example was saved ({out})"
    ]
    assert len(pd.read_parquet(out)) == 23


def test_sigterm_is_handled_as_ctrl_c(tmp_path):
    config = slow_project(tmp_path)
    out = tmp_path / "scores.parquet"
    proc = launch(config)
    wait_for_parts(out, 3, proc)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    (line,) = stderr.strip().splitlines()
    assert line.startswith("error: interrupted with ") and "--resume" in line, line
    assert not lock_path(out).exists() and not list(tmp_path.rglob("*.tmp"))
    resumed = runner.invoke(app, ["norms", str(config), "--batch-size", "2", "--resume"])
    assert resumed.exit_code == 0, resumed.output
    whole = tmp_path / "whole.parquet"
    args = ["norms", str(config), "--batch-size", "2", "--out", str(whole)]
    assert runner.invoke(app, args).exit_code == 0
    pd.testing.assert_frame_equal(pd.read_parquet(out), pd.read_parquet(whole), check_exact=True)


@pytest.mark.parametrize("copied", ["another run's", "another batch's"])
def test_a_part_copied_in_is_scored_again(tmp_path, monkeypatch, copied):
    """A part not stamped by this run, or this run's part of another batch copied to this
    batch's name (whose rows, example ids and all, were kept in its place)."""
    config = held_project(tmp_path, model__factory="held.py:StopNet")
    interrupted(config, monkeypatch)  # batches 0 and 1 saved
    ours = partial_path(tmp_path / "scores.parquet")
    if copied == "another run's":
        foreign = pd.read_parquet(ours / "part-000000000.parquet").assign(grad_norm=999.0)
        foreign.to_parquet(ours / "part-000000002.parquet")  # not stamped ours
    else:
        shutil.copy(ours / "part-000000000.parquet", ours / "part-000000002.parquet")
    assert runner.invoke(app, ["norms", str(config), "--resume"]).exit_code == 0
    frame = pd.read_parquet(tmp_path / "scores.parquet")
    assert 999.0 not in frame["grad_norm"].tolist()
    pd.testing.assert_frame_equal(frame, whole_run(config, tmp_path), check_exact=True)


@pytest.mark.parametrize(
    ("manifest", "message"),
    [
        ("[]", "the partial run's manifest.json is damaged; run without --resume"),
        ("", "nothing to resume: no interrupted run of this output"),
    ],
)
def test_resume_after_a_new_version_or_with_a_damaged_manifest(
    tmp_path, monkeypatch, manifest, message
):
    config = held_project(tmp_path, model__factory="held.py:StopNet")
    interrupted(config, monkeypatch)
    with monkeypatch.context() as patched:
        patched.setattr("gradscope.resume.__version__", "0.0.0+other")
        line = one_error(runner.invoke(app, ["norms", str(config), "--resume"]))
        assert "cannot resume: the interrupted run had a different version" in line, line
    (partial_path(tmp_path / "scores.parquet") / "manifest.json").write_text(manifest)
    line = one_error(runner.invoke(app, ["norms", str(config), "--resume"]))
    assert line.startswith(f"error: {message}"), line


def test_report_refuses_data_changed_since_it_was_scored(tmp_path):
    config = make_project(tmp_path)
    assert runner.invoke(app, ["norms", str(config)]).exit_code == 0
    scores = str(tmp_path / "scores.parquet")
    assert runner.invoke(app, ["report", scores, "--config", str(config)]).exit_code == 0
    edit_data(tmp_path, lambda d: d["x"].mul_(2))
    line = one_error(runner.invoke(app, ["report", scores, "--config", str(config)]))
    assert line.startswith("error: the data changed since it was scored"), line
    assert str(tmp_path / "data.pt") in line


def test_csv_shards_whose_target_types_differ_assemble(tmp_path):
    config = make_project(
        tmp_path,
        model__factory="model.py:Columns",
        model__kwargs={"classes": 1},
        model__checkpoint=None,
        data__path="shard-*.csv",
        data__inputs=[f"f{k}" for k in range(5)],
        loss={"name": "mse"},
    )
    g = torch.Generator().manual_seed(0)
    for n, target in enumerate(["{:.2f}", "{:.0f}"]):  # 0.37, ... then whole numbers: int64
        rows = torch.randn(9, 6, generator=g).tolist()
        lines = [",".join(f"{v:.3f}" for v in r[:5]) + "," + target.format(r[5]) for r in rows]
        (tmp_path / f"shard-{n}.csv").write_text("f0,f1,f2,f3,f4,y\n" + "\n".join(lines) + "\n")
    result = runner.invoke(app, ["norms", str(config)])
    assert result.exit_code == 0, result.output
    frame = pd.read_parquet(tmp_path / "scores.parquet")
    assert len(frame) == 18 and frame["target"].dtype == "float64"
    assert frame["target"].iloc[9:].tolist() == [round(v) for v in frame["target"].iloc[9:]]


@pytest.mark.parametrize("batch_size", [3, 4], ids=["a-shard-a-batch", "a-batch-spans-both"])
def test_csv_shards_whose_id_types_differ_give_text_ids(tmp_path, batch_size):
    config = make_project(
        tmp_path,
        model__factory="model.py:Columns",
        model__checkpoint=None,
        data__path="shard-*.csv",
        data__inputs=[f"f{k}" for k in range(5)],
        data__ids="id",
        data__batch_size=batch_size,
    )
    g = torch.Generator().manual_seed(0)
    for n, name in enumerate(["{}", "row{}"]):  # whole numbers in one shard: int64
        lines = [
            ",".join([name.format(k), *(f"{v:.3f}" for v in torch.randn(5, generator=g)), "1"])
            for k in range(9)
        ]
        (tmp_path / f"shard-{n}.csv").write_text("id,f0,f1,f2,f3,f4,y\n" + "\n".join(lines))
    result = runner.invoke(app, ["norms", str(config)])
    assert result.exit_code == 0, result.output
    ids = pd.read_parquet(tmp_path / "scores.parquet")["id"].tolist()
    assert ids == [str(k) for k in range(9)] + [f"row{k}" for k in range(9)]


def test_check_leaves_out_a_nan_example_and_says_so(tmp_path):
    config = make_project(tmp_path)
    edit_data(tmp_path, lambda d: d["x"].__setitem__((2, 1), float("nan")))
    result = runner.invoke(app, ["check", str(config)])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "1 example(s) with a NaN or infinite loss left out" in text
    assert "norms, 7 examples" in text and not re.search(r"\bnan\b", text.split("norms:")[0])


def test_report_of_a_dollar_module_and_of_no_rows(tmp_path):
    config = make_project(tmp_path, model__factory="model.py:Dollar", model__checkpoint=None)
    with (tmp_path / "model.py").open("a") as f:
        f.write(MORE_CODE)
    result = runner.invoke(app, ["norms", str(config), "--per-layer", "--report"])
    assert result.exit_code == 0, result.output
    assert "a$^$b" in (tmp_path / "scores.html").read_text()
    table = pq.read_table(tmp_path / "scores.parquet")
    pq.write_table(table.slice(0, 0), tmp_path / "empty.parquet")
    line = one_error(runner.invoke(app, ["report", str(tmp_path / "empty.parquet")]))
    assert line.startswith("error: the scores file has no rows"), line


def test_pretrained_folder_with_a_cut_or_pickled_weights_file(tmp_path):
    transformers = pytest.importorskip("transformers")
    gpt2 = transformers.GPT2Config(vocab_size=50, n_positions=16, n_embd=8, n_layer=1, n_head=2)
    transformers.GPT2LMHeadModel(gpt2).save_pretrained(tmp_path / "lm")
    config = make_project(
        tmp_path,
        model={"factory": "transformers:GPT2LMHeadModel", "pretrained": "lm"},
    )
    weights = tmp_path / "lm" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    line = one_error(runner.invoke(app, ["norms", str(config)]))
    assert line.startswith("error: cannot load GPT2LMHeadModel from the folder"), line
    weights.unlink()
    torch.save(
        {"transformer.wte.weight": Marker(tmp_path / "ran")}, weights.with_name("pytorch_model.bin")
    )
    line = one_error(runner.invoke(app, ["norms", str(config)]))
    assert "a weights file in the folder holds objects other than tensors" in line, line
    assert not (tmp_path / "ran").exists()
    weights.with_name("pytorch_model.bin").unlink()
    weights.write_text(LFS)
    line = one_error(runner.invoke(app, ["norms", str(config)]))
    assert line.startswith("error: a Git LFS pointer, not the file itself") and weights.name in line


INSIDE_A_RANK = """
import subprocess, sys
sys.exit(subprocess.run([sys.executable, "-m", "gradscope", "norms", sys.argv[1]]).returncode)
"""


def test_started_inside_a_torchrun_worker_it_runs_alone(tmp_path):
    """The worker's WORLD_SIZE, RANK and MASTER_* are inherited: no rendezvous to wait for."""
    config = make_project(tmp_path)
    with socket.socket() as s:  # a port where no one listens
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    worker = {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1",
              "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-c", INSIDE_A_RANK, str(config)],
        env={**os.environ, **worker}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert len(pd.read_parquet(tmp_path / "scores.parquet")) == 23


def test_minimal_metadata_holds_no_config_and_no_path(tmp_path):
    config = make_project(tmp_path, output__metadata="minimal")
    torch.save({"x": torch.randn(3, 5), "y": torch.randint(0, 3, (3,))}, tmp_path / "ref.pt")
    for args in (["norms"], ["influence", "--ref", str(tmp_path / "ref.pt")]):
        out = tmp_path / f"{args[0]}.parquet"
        result = runner.invoke(app, [args[0], str(config), *args[1:], "--out", str(out)])
        assert result.exit_code == 0, result.output
        meta = read_metadata(out)
        assert "config" not in meta and str(tmp_path) not in json.dumps(meta)
        assert meta["version"] and meta["plan"] and meta["data_sha256"]
    assert read_metadata(out)["influence"]["ref_sha256"]
    edit_config(tmp_path, lambda c: c["output"].update(metadata="full"))
    assert runner.invoke(app, ["norms", str(config)]).exit_code == 0
    assert str(tmp_path) in json.dumps(read_metadata(tmp_path / "scores.parquet"))


def _config(edit):
    return lambda m: {**m, "config": edit(m["config"])}


def _data(edit):
    return _config(lambda c: {**c, "data": edit(c["data"])})


# (id, the metadata another tool left: a function of the metadata gradscope wrote)
EDITED = [
    ("not-json", lambda m: "{not json"),
    ("a-list", lambda m: [1, 2]),
    ("config-a-string", _config(lambda c: "x")),
    ("data-a-list", _config(lambda c: {**c, "data": [1]})),
    ("classes-a-dict", _data(lambda d: {**d, "classes": {"a": 1}})),
    ("classes-numbers", _data(lambda d: {**d, "classes": [1, 2, 3]})),
    ("data-path-numbers", _data(lambda d: {**d, "path": [5]})),
    ("a-nul-in-a-path", _data(lambda d: {**d, "path": "data\0.pt"})),
    ("source-a-number", _config(lambda c: {**c, "source": 5})),
    ("checkpoints-without-path", _config(lambda c: {**c, "model": {"checkpoints": [{}, 3]}})),
    ("checkpoint-path-a-number", _config(lambda c: {**c, "model": {"checkpoints": [{"path": 1}]}})),
    ("precondition-a-string", lambda m: {**m, "influence": {"precondition": "x", "ref": 3}}),
    ("precondition-path-a-number", lambda m: {**m, "influence": {"precondition": {"path": 3}}}),
    ("data-sha256-a-number", lambda m: {**m, "data_sha256": 5}),
    ("command-a-mapping", lambda m: {**m, "command": {"a": 1}}),
]  # fmt: skip


def test_summary_and_report_read_metadata_another_tool_edited(tmp_path):
    config = make_project(tmp_path, data__classes=["a", "b", "c"])
    assert runner.invoke(app, ["norms", str(config)]).exit_code == 0
    table = pq.read_table(tmp_path / "scores.parquet")
    written = json.loads(table.schema.metadata[b"gradscope"])
    edited = tmp_path / "edited.parquet"
    for name, edit in EDITED:
        meta = edit(written)
        text = meta if isinstance(meta, str) else json.dumps(meta)
        pq.write_table(table.replace_schema_metadata({b"gradscope": text.encode()}), edited)
        for args in (["summary"], ["report"], ["report", "--config", str(config)]):
            result = runner.invoke(app, [args[0], str(edited), *args[1:]])
            # with --config, the rows must be told the data's: no data_sha256 left, refused
            kept = isinstance(meta, dict) and isinstance(meta.get("data_sha256"), str)
            if "--config" in args and not kept:
                assert result.exit_code == 2, (name, args, result.output)
                assert "records no data_sha256" in one_error(result), (name, result.output)
            else:
                assert result.exit_code == 0, (name, args, result.output)


def test_summary_and_report_of_columns_another_tool_rewrote(tmp_path):
    """finite as 0 and 1 (an int column) ranks as the bools did; as text it is one line; a file
    without example_id is reported, and with --config refused in one line (no examples to show)."""
    config = make_project(tmp_path)
    edit_data(tmp_path, lambda d: d["x"].__setitem__((3, 1), float("nan")))
    assert runner.invoke(app, ["norms", str(config)]).exit_code == 0
    table = pq.read_table(tmp_path / "scores.parquet")
    at = table.schema.get_field_index("finite")
    edited = tmp_path / "edited.parquet"

    def summary() -> str:
        result = runner.invoke(app, ["summary", str(edited)])
        assert result.exit_code == 0, result.output
        return result.output

    pq.write_table(table, edited)
    original = summary()
    assert "1 non-finite" in original
    pq.write_table(table.set_column(at, "finite", table["finite"].cast(pa.int64())), edited)
    assert summary() == original
    pq.write_table(table.set_column(at, "finite", table["finite"].cast(pa.string())), edited)
    line = one_error(runner.invoke(app, ["summary", str(edited)]))
    assert line == f"error: column 'finite' holds string, not true or false ({edited})"
    pq.write_table(table.drop(["example_id"]), edited)
    assert runner.invoke(app, ["report", str(edited)]).exit_code == 0
    line = one_error(runner.invoke(app, ["report", str(edited), "--config", str(config)]))
    assert "has no example_id column" in line


def test_minimal_metadata_with_precondition_and_report(tmp_path):
    config = make_project(tmp_path, output__metadata="minimal")
    torch.save({"x": torch.randn(3, 5), "y": torch.randint(0, 3, (3,))}, tmp_path / "ref.pt")
    factors = tmp_path / "f.safetensors"
    args = ["factors", str(config), "--out", str(factors), "--fisher", "empirical"]
    assert runner.invoke(app, args).exit_code == 0
    for command in (["norms"], ["influence", "--ref", str(tmp_path / "ref.pt")]):
        out = tmp_path / f"{command[0]}.parquet"
        args = [command[0], str(config), *command[1:], "--precondition", str(factors)]
        result = runner.invoke(app, [*args, "--out", str(out), "--report"])
        assert result.exit_code == 0, result.output
        assert out.with_suffix(".html").is_file()
        result = runner.invoke(app, ["report", str(out), "--config", str(config)])
        assert result.exit_code == 0, result.output


def test_a_column_named_like_a_glob_is_that_column(tmp_path):
    config = make_project(tmp_path)
    plain = whole_run(config, tmp_path)
    edit_data(tmp_path, lambda d: d.update({"x[1]": d.pop("x"), "x1": torch.randn(23, 6)}))
    edit_config(tmp_path, lambda c: c["data"].update(inputs="x[1]"))
    result = runner.invoke(app, ["norms", str(config)])
    assert result.exit_code == 0, result.output
    frame = pd.read_parquet(tmp_path / "scores.parquet")
    pd.testing.assert_series_equal(frame["grad_norm"], plain["grad_norm"], check_exact=True)


def test_a_model_without_checkpoint_is_the_same_in_every_run(tmp_path):
    """Random initial weights are seeded: a resume, or a second rank, scores the same model."""
    config = make_project(tmp_path, model__checkpoint=None)
    first = whole_run(config, tmp_path)
    torch.manual_seed(123)  # whatever the caller's random state
    pd.testing.assert_frame_equal(whole_run(config, tmp_path), first, check_exact=True)


def test_factors_follow_no_link_planted_at_the_old_temporary_name(tmp_path):
    config = make_project(tmp_path)
    target = victim(tmp_path)
    out = tmp_path / "f.safetensors"
    (tmp_path / ".f.safetensors.partial").symlink_to(target)  # the old, fixed name
    result = runner.invoke(
        app, ["factors", str(config), "--out", str(out), "--fisher", "empirical"]
    )
    assert result.exit_code == 0, result.output
    assert target.read_text() == "precious\n" and out.is_file() and not out.is_symlink()


def test_a_locale_that_cannot_show_the_histogram(tmp_path):
    """LANG=C without Python's UTF-8 mode: stdout is ASCII; the bars print as '?'."""
    config = make_project(tmp_path)
    env = {**os.environ, "LC_ALL": "C", "PYTHONCOERCECLOCALE": "0", "PYTHONUTF8": "0"}
    for args in (["norms", str(config), "--report"], ["summary", str(tmp_path / "scores.parquet")]):
        done = subprocess.run(
            [sys.executable, "-m", "gradscope", *args],
            env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        histogram = next(line for line in done.stdout.splitlines() if line.startswith("loss "))
        assert "?" in histogram, done.stdout
    assert (tmp_path / "scores.html").read_text().startswith("<!")
