"""Hostile inputs, round two: folders are inputs too, planted links are never followed, and no
command prints a traceback or a misleading line."""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

import pytest
import torch
from project import edit_config, edit_data, make_project
from typer.testing import CliRunner

from gradscope.cli import app
from gradscope.io.lock import lock_path
from gradscope.io.parquet import partial_path

runner = CliRunner()


def files(root: Path) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def one_error(result) -> str:
    assert result.exit_code == 2, result.output
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: ") and "Traceback" not in result.output
    return line


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


@pytest.mark.parametrize("link", ["symlink", "hard-link"])
def test_a_link_planted_at_the_lock_is_neither_followed_nor_truncated(tmp_path, link):
    config = make_project(tmp_path)
    target = victim(tmp_path)
    lock = lock_path(tmp_path / "scores.parquet")
    lock.symlink_to(target) if link == "symlink" else os.link(target, lock)
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


class Marker:
    """A pickle that touches a file when loaded: loading must not run it."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return Path.touch, (self.path,)


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
    (root / "net.pt").write_text("version https://git-lfs.github.com/spec/v1\noid sha256:0\n")


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
    ("yaml-alias-bomb", bomb, [], "the config expands to more than 100000 values", "config.yaml"),
    ("device-cpu-abc", None, ["--device", "cpu:abc"], "'device' must be one of", "'cpu:abc'"),
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
