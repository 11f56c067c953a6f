"""The index folder: read by numpy, torch and Arrow alone, cut into shards, written only over an
index, resumed and written by two torchrun ranks as by one process; a query refuses a model or
data other than the indexed ones."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
import torch
from project import edit_checkpoint, edit_data, fails, make_project
from runs import index, projected_loop, query, refused
from typer.testing import CliRunner

import gradscope.index.layout as layout
from gradscope.cli import app
from gradscope.config import load_config
from gradscope.errors import Interrupted
from gradscope.index.scorer import IndexScorer
from gradscope.run import score_dataset


def rows_by_hand(ix) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The index's rows read three ways with numpy, torch and pyarrow alone, per the layout."""
    manifest = json.loads((ix / "manifest.json").read_text())
    width, dtype = manifest["width"], np.dtype(manifest["dtype"])
    by_numpy, by_torch, by_arrow = [], [], []
    for shard in manifest["shards"]:
        path, n = ix / shard["file"], shard["rows"]
        by_numpy.append(np.load(path, mmap_mode="r"))
        skip = manifest["header_bytes"] // dtype.itemsize
        t = torch.from_file(str(path), size=skip + n * width, dtype=getattr(torch, dtype.name))
        by_torch.append(t[skip:].view(n, width).numpy())
        buffer = pa.memory_map(str(path)).read_buffer()[manifest["header_bytes"] :]
        array = pa.Array.from_buffers(pa.from_numpy_dtype(dtype), n * width, [None, buffer])
        by_arrow.append(array.to_numpy(zero_copy_only=True).reshape(n, width))
    return tuple(np.concatenate(r) for r in (by_numpy, by_torch, by_arrow))


def test_readers_without_gradscope_give_the_projected_gradients(project):
    ix = index(project, "--dim", 4, "--storage", "float32")
    by_numpy, by_torch, by_arrow = rows_by_hand(ix)
    assert np.array_equal(by_numpy, by_torch) and np.array_equal(by_numpy, by_arrow)
    ids = pd.read_parquet(ix / "ids.parquet")
    assert list(ids.columns) == ["example_id", "loss", "norm", "finite"]
    phi, _ = projected_loop(project, ix)
    got = by_numpy * ids["norm"].to_numpy()[:, None]  # phi_i = norm_i * row_i
    assert np.abs(got - phi.numpy()).max() <= 1e-6 * np.abs(phi.numpy()).max()
    with open(ix / "shard-000000.npy", "rb") as f:
        assert np.lib.format.read_magic(f) == (1, 0)
        assert np.lib.format.read_array_header_1_0(f) == ((10, phi.shape[1]), False, "<f4")
        assert f.tell() == 128


def test_shards_cut_at_their_size_query_alike(project, monkeypatch):
    one = index(project, "--dim", 4, name="one")
    width = json.loads((one / "manifest.json").read_text())["width"]
    monkeypatch.setattr(layout, "SHARD_BYTES", 3 * width * 2)  # three float16 rows a shard
    cut = index(project, "--dim", 4, name="cut")
    shards = json.loads((cut / "manifest.json").read_text())["shards"]
    assert [(s["rows"], s["first"]) for s in shards] == [(3, 0), (3, 3), (3, 6), (1, 9)]
    assert np.array_equal(rows_by_hand(one)[0], rows_by_hand(cut)[0])
    pd.testing.assert_frame_equal(
        query(project, one, name="one.parquet"), query(project, cut, name="cut.parquet")
    )


def test_writes_over_an_index_only(project, monkeypatch, capsys):
    ix = index(project, "--dim", 4)
    index(project, "--dim", 8)  # replaced whole
    assert json.loads((ix / "manifest.json").read_text())["projection"]["dim"] == 8
    (ix / "notes.txt").write_text("mine")
    err = fails(monkeypatch, capsys, "index", project / "config.yaml", "--out", ix)
    assert "not a gradscope index folder" in err and (ix / "notes.txt").read_text() == "mine"
    other = project / "other"
    other.mkdir()
    (other / "photo.png").write_bytes(b"\x89PNG")
    fails(monkeypatch, capsys, "index", project / "config.yaml", "--out", other)
    assert [p.name for p in other.iterdir()] == ["photo.png"]
    err = fails(monkeypatch, capsys, "index", project / "config.yaml", "--out", project)
    assert "inside the run's" in err or "not a gradscope index" in err


def test_query_refuses_another_model_or_changed_data(project, monkeypatch, capsys):
    ix = index(project, "--dim", 4)
    edit_data(project, lambda d: d["x"].mul_(2))
    query(project, ix)  # the data is not read without --exact
    err = refused(monkeypatch, capsys, project, ix, "--exact")
    assert "data.path has changed" in err
    edit_checkpoint(project, lambda s: s["fc2.bias"].add_(1))
    err = refused(monkeypatch, capsys, project, ix)
    assert "model.checkpoint is not what the index was built from" in err


def test_an_index_without_its_config_queries_with_one(project):
    make_project(project, n=10, dtype="float64", output__metadata="minimal")
    ix = index(project, "--dim", 4)
    assert "config" not in json.loads((ix / "manifest.json").read_text())["gradscope"]
    assert str(project) not in (ix / "manifest.json").read_text()
    assert len(query(project, ix)) == 10


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [("--dim", 0, "--dim must be at least 1"), ("--storage", "int8", "--storage must be")],
)
def test_bad_index_options(project, monkeypatch, capsys, option, value, message):
    err = fails(monkeypatch, capsys, "index", project / "config.yaml", option, value)
    assert message in err


class Interrupting(IndexScorer):
    def __init__(self, stop: int):
        super().__init__(dim=4)
        self.stop, self.done = stop, 0

    def columns(self, job, batch):
        if self.done == self.stop:
            raise KeyboardInterrupt
        self.done += 1
        return super().columns(job, batch)


def test_resumed_index_is_the_uninterrupted_one(project):
    whole = index(project, "--dim", 4, name="whole")
    cfg = load_config(project / "config.yaml")
    cfg = type(cfg)(**{**cfg.__dict__, "output": type(cfg.output)(path=str(project / "resumed"))})
    with pytest.raises(Interrupted):
        score_dataset(cfg, Interrupting(stop=2))
    assert not (project / "resumed").exists()
    index(project, "--dim", 4, "--resume", name="resumed")
    for a, b in zip(rows_by_hand(whole), rows_by_hand(project / "resumed"), strict=True):
        assert np.array_equal(a, b)
    pd.testing.assert_frame_equal(
        pd.read_parquet(whole / "ids.parquet"), pd.read_parquet(project / "resumed" / "ids.parquet")
    )


def torchrun(*args: object) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
         "-m", "gradscope", *map(str, args)],
        env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def test_two_torchrun_processes_write_the_index_one_writes(project):
    make_project(project, n=23, dtype="float64", data__ids="name")
    one = index(project, "--dim", 4, name="one")
    run = torchrun("index", project / "config.yaml", "--dim", 4, "--out", project / "two")
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count("wrote ") == 1
    two = project / "two"
    pd.testing.assert_frame_equal(
        pd.read_parquet(one / "ids.parquet"), pd.read_parquet(two / "ids.parquet")
    )
    a, b = query(project, one, name="one.parquet"), query(project, two, name="two.parquet")
    assert a["example_id"].tolist() == list(range(23)) and a["id"].tolist()[:2] == [100, 101]
    pd.testing.assert_frame_equal(a, b, rtol=1e-5)


@pytest.mark.parametrize("again", [[], ["--resume"]], ids=["fresh", "resume"])
def test_a_run_killed_while_assembling_starts_over_or_resumes(project, monkeypatch, again):
    """Killed after the index was staged in the partial folder, before it was moved into place:
    a fresh run starts over, --resume assembles the parts again; either is the whole index."""
    whole = index(project, "--dim", 4, name="whole")
    publish = layout._publish

    def killed(staging, path):
        raise KeyboardInterrupt

    monkeypatch.setattr(layout, "_publish", killed)
    result = CliRunner().invoke(app, ["index", str(project / "config.yaml"), "--dim", "4",
                                      "--out", str(project / "ix")])  # fmt: skip
    assert result.exit_code != 0 and "--resume" in result.output
    assert (project / ".ix.partial" / "index" / "manifest.json").exists()
    monkeypatch.setattr(layout, "_publish", publish)
    ix = index(project, "--dim", 4, *again)
    assert not (project / ".ix.partial").exists()
    for a, b in zip(rows_by_hand(whole), rows_by_hand(ix), strict=True):
        assert np.array_equal(a, b)


def test_a_damaged_index_is_replaced_by_its_rebuild(project):
    """The damaged index's error says: build it again; --out takes the damaged folder."""
    ix = index(project, "--dim", 4)
    (ix / "shard-000000.npy").unlink()
    manifest = json.loads((ix / "manifest.json").read_text())
    (ix / "manifest.json").write_text(json.dumps({**manifest, "version": 1, "shards": 0}))
    index(project, "--dim", 4)
    assert len(query(project, ix)) == 10


def test_a_run_killed_between_the_renames_leaves_the_former_index_aside(
    project, monkeypatch, capsys
):
    """Killed after the former index was moved aside, before the new one took its name: the
    former waits at .ix.old, and the next run puts the index in place and removes it; a folder
    of someone else's at that name is refused and left."""
    ix = index(project, "--dim", 4)
    rename = os.rename

    def killed(src, dst):
        rename(src, dst)
        if dst == layout.former(ix):
            raise KeyboardInterrupt

    monkeypatch.setattr(layout.os, "rename", killed)
    result = CliRunner().invoke(app, ["index", str(project / "config.yaml"), "--dim", "8",
                                      "--out", str(ix)])  # fmt: skip
    assert result.exit_code != 0 and not ix.exists()
    former = json.loads((project / ".ix.old" / "manifest.json").read_text())
    assert former["projection"]["dim"] == 4
    monkeypatch.setattr(layout.os, "rename", rename)
    index(project, "--dim", 8)
    assert not (project / ".ix.old").exists()
    assert json.loads((ix / "manifest.json").read_text())["projection"]["dim"] == 8
    (project / ".ix.old").mkdir()
    (project / ".ix.old" / "photo.png").write_bytes(b"\x89PNG")
    err = fails(monkeypatch, capsys, "index", project / "config.yaml", "--out", ix)
    assert "not a gradscope index folder" in err and (project / ".ix.old" / "photo.png").exists()


@pytest.mark.parametrize("kind", ["folder", "link"])
def test_an_index_name_that_is_not_a_file_keeps_the_folder(project, monkeypatch, capsys, kind):
    """A folder (or link) of a user's under a shard's name beside a manifest of the index's
    format: the folder was taken for an index and replaced, the user's files with it."""
    ix = project / "ix"
    ix.mkdir()
    (ix / "manifest.json").write_text(json.dumps({"format": "gradscope-index"}))
    (project / "mine").mkdir()
    (project / "mine" / "precious.txt").write_text("keep")
    shard = ix / "shard-000001.npy"
    if kind == "folder":
        shard.mkdir()
        (shard / "precious.txt").write_text("keep")
    else:
        shard.symlink_to(project / "mine")
    err = fails(monkeypatch, capsys, "index", project / "config.yaml", "--out", ix)
    assert "not a gradscope index folder" in err
    assert (shard / "precious.txt").read_text() == "keep"
