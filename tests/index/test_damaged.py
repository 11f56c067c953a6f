"""An index folder damaged, edited, copied over or rebuilt under a query: each refused in one
``error:`` line naming the file, nothing read outside the folder, no object array loaded."""

from __future__ import annotations

import json
import os
import pickle
import shutil

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from project import Marker
from runs import index, manifest, query, refused, run

import gradscope.index.layout as layout
from gradscope.config import load_config
from gradscope.index.manifest import SEAL, seal
from gradscope.index.reader import Shards
from gradscope.index.scorer import IndexScorer, index_output
from gradscope.run import score_dataset


def rewrite(ix, change) -> None:
    """The manifest edited by ``change``, sealed again as a build would: only the checks of
    what it says stand between it and the rows."""
    m = manifest(ix)
    change(m)
    text = json.dumps(m).encode()
    (ix / "manifest.json").write_bytes(text)
    ids = pq.read_table(ix / "ids.parquet")
    pq.write_table(ids.replace_schema_metadata({SEAL: seal(text)}), ix / "ids.parquet")


def test_a_manifest_from_another_seed_is_refused(project, monkeypatch, capsys):
    ix = index(project, "--dim", 4)
    donor = index(project, "--dim", 4, "--seed", 7, name="donor")
    shutil.copy(donor / "manifest.json", ix / "manifest.json")
    err = refused(monkeypatch, capsys, project, ix)
    assert "manifest.json is not the one this index was built with" in err
    assert str(ix / "manifest.json") in err


def test_a_shard_from_another_build_is_refused(project, monkeypatch, capsys):
    """The same shape and header, another seed's rows: the manifest's sha256 of its ends tells."""
    ix = index(project, "--dim", 4)
    donor = index(project, "--dim", 4, "--seed", 7, name="donor")
    shutil.copy(donor / "shard-000000.npy", ix / "shard-000000.npy")
    err = refused(monkeypatch, capsys, project, ix)
    assert "shard-000000.npy is not the shard this index was built with" in err


def test_an_edited_projection_is_refused(project, monkeypatch, capsys):
    """Other block sides, the same width: the rows read as another projection's."""
    ix = index(project, "--dim", 4)
    m = manifest(ix)
    block = next(b for b in m["projection"]["blocks"] if b["k_out"] != b["k_in"])
    block["k_out"], block["k_in"] = block["k_in"], block["k_out"]  # the same width
    (ix / "manifest.json").write_text(json.dumps(m))
    assert "manifest.json is not the one" in refused(monkeypatch, capsys, project, ix)


def moved_out(ix, key: str) -> None:
    """The shard or ids file moved beside the index, the manifest naming it there."""
    if key == "ids":
        rewrite(ix, lambda m: m.update(ids="../ids.parquet"))
        os.rename(ix / "ids.parquet", ix.parent / "ids.parquet")
    else:
        os.rename(ix / "shard-000000.npy", ix.parent / "x.npy")
        name = "../x.npy" if key == "relative" else str(ix.parent / "x.npy")
        rewrite(ix, lambda m: m["shards"][0].update(file=name))


@pytest.mark.parametrize("key", ["relative", "absolute", "ids"])
def test_names_outside_the_folder_are_never_read(project, monkeypatch, capsys, key):
    ix = index(project, "--dim", 4)
    moved_out(ix, key)
    err = refused(monkeypatch, capsys, project, ix)
    assert "not a file name inside the index folder" in err


def test_a_link_out_of_the_folder_is_not_followed(project, monkeypatch, capsys):
    ix = index(project, "--dim", 4)
    os.rename(ix / "shard-000000.npy", project / "x.npy")
    os.symlink(project / "x.npy", ix / "shard-000000.npy")
    err = refused(monkeypatch, capsys, project, ix)
    assert "shard-000000.npy is a symbolic link" in err


def objects(ix, path) -> None:
    """An object array's .npy file (a pickle, touching ``path`` when loaded) of the shard's own
    size: only its header tells."""
    shard = ix / "shard-000000.npy"
    array = np.full((10, manifest(ix)["width"]), None, dtype=object)
    array[0, 0] = Marker(path)
    body = pickle.dumps(array, protocol=3)
    size = shard.stat().st_size - layout.HEADER
    assert len(body) <= size
    shard.write_bytes(layout.npy_header(*array.shape, array.dtype) + body.ljust(size, b"\0"))
    np.load(shard, allow_pickle=True)  # what the file is: loaded, it runs the marker
    assert path.exists()
    path.unlink()


def resaved(ix, change) -> None:
    shard = ix / "shard-000000.npy"
    np.save(shard, change(np.load(shard)))


HEADERS = {
    "objects": (objects, "holds Python objects"),
    "fortran": (lambda ix, _: resaved(ix, np.asfortranarray), "Fortran-order"),
    "float64": (lambda ix, _: resaved(ix, lambda a: a.astype(np.float64)), "float64 array"),
    "shape": (lambda ix, _: resaved(ix, lambda a: a[:, :-1].copy()), "the manifest says (10, "),
}


@pytest.mark.parametrize("case", HEADERS)
def test_a_shard_whose_header_disagrees_is_refused_unread(project, monkeypatch, capsys, case):
    ix = index(project)  # 75 numbers a row: room for the pickle
    damage, message = HEADERS[case]
    damage(ix, project / "loaded")
    err = refused(monkeypatch, capsys, project, ix)
    assert message in err and str(ix / "shard-000000.npy") in err
    assert not (project / "loaded").exists()


def truncated(path, drop: int) -> None:
    path.write_bytes(path.read_bytes()[:-drop])


DAMAGE = {
    "shard-deleted": (
        lambda ix: (ix / "shard-000000.npy").unlink(),
        "shard-000000.npy",
        "shard-000000.npy is missing",
    ),
    "ids-deleted": (
        lambda ix: (ix / "ids.parquet").unlink(),
        "ids.parquet",
        "ids.parquet is missing",
    ),
    "ids-shortened": (
        lambda ix: truncated(ix / "ids.parquet", 100),
        "ids.parquet",
        "not a readable Parquet file",
    ),
    "ids-not-parquet": (
        lambda ix: (ix / "ids.parquet").write_text("example_id\n0\n"),
        "ids.parquet",
        "not a readable Parquet file",
    ),
    "ids-rows": (
        lambda ix: pq.write_table(pq.read_table(ix / "ids.parquet").slice(1), ix / "ids.parquet"),
        "ids.parquet",
        "holds 9 rows",
    ),
    "rows": (
        lambda ix: rewrite(ix, lambda m: m.update(rows=11)),
        "manifest.json",
        "the manifest's shards hold 10 rows, its rows say 11",
    ),
    "first": (
        lambda ix: rewrite(ix, lambda m: m["shards"][1].update(first=4)),
        "manifest.json",
        "starts at row 4",
    ),
    "blocks": (
        lambda ix: rewrite(ix, lambda m: m["projection"]["blocks"][0].pop("k_in")),
        "manifest.json",
        "the manifest's projection or model record",
    ),
    "no-shards": (
        lambda ix: rewrite(ix, lambda m: m.pop("shards")),
        "manifest.json",
        "the manifest's shards is missing",
    ),
    "shard-short": (
        lambda ix: truncated(ix / "shard-000001.npy", 10),
        "shard-000001.npy",
        "bytes, its rows and header take",
    ),
    "shard-a-folder": (  # IsADirectoryError before
        lambda ix: [(ix / "shard-000001.npy").unlink(), (ix / "shard-000001.npy").mkdir()],
        "shard-000001.npy",
        "shard-000001.npy is not a plain file",
    ),
    "manifest-a-fifo": (  # the query waited for a writer, for good
        lambda ix: [(ix / "manifest.json").unlink(), os.mkfifo(ix / "manifest.json")],
        "manifest.json",
        "manifest.json is not a plain file",
    ),
    "manifest-nested": (  # RecursionError before
        lambda ix: (ix / "manifest.json").write_text("[" * 100_000 + "]" * 100_000),
        "manifest.json",
        "not a gradscope index folder (no readable manifest.json)",
    ),
    "no-dim": (  # KeyError before
        lambda ix: rewrite(ix, lambda m: m["projection"].pop("dim")),
        "manifest.json",
        "the manifest's projection or model record",
    ),
    "seed-a-bool": (
        lambda ix: rewrite(ix, lambda m: m["projection"].update(seed=True)),
        "manifest.json",
        "the manifest's projection or model record",
    ),
    "norm-text": (  # a pyarrow error before
        lambda ix: retyped(ix, "norm", lambda c: c.cast("string")),
        "ids.parquet",
        "ids.parquet's column norm holds string",
    ),
    "norm-negative": (  # scored with the sign flipped before
        lambda ix: retyped(ix, "norm", lambda c: pc.negate(c)),
        "ids.parquet",
        "holds a negative or NaN norm for a finite row",
    ),
}


def retyped(ix, column: str, change) -> None:
    """``ids.parquet`` with ``column`` changed, its seal kept."""
    ids = pq.read_table(ix / "ids.parquet")
    at = ids.schema.get_field_index(column)
    sealed = {SEAL: pq.ParquetFile(ix / "ids.parquet").metadata.metadata[SEAL]}
    changed = ids.set_column(at, column, change(ids[column]))
    pq.write_table(changed.replace_schema_metadata(sealed), ix / "ids.parquet")


@pytest.mark.parametrize("case", DAMAGE)
def test_a_damaged_index_is_named_in_one_line(project, monkeypatch, capsys, case):
    monkeypatch.setattr(layout, "SHARD_BYTES", 6 * 12 * 2)  # 6 rows of 12 float16s a shard
    ix = index(project, "--dim", 4)
    assert len(manifest(ix)["shards"]) == 2
    damage, name, message = DAMAGE[case]
    damage(ix)
    err = refused(monkeypatch, capsys, project, ix)
    assert message in err and f"({ix / name})" in err


def test_query_dot_from_inside_the_index(project, monkeypatch):
    ix = index(project, "--dim", 4)
    monkeypatch.chdir(ix)
    run("query", ".", "--ref", project / "ref.pt", "--config", project / "config.yaml")
    expected = query(project, ix)
    assert np.array_equal(pq.read_table(project / "ix.query.parquet")["score"], expected["score"])


def test_a_rebuild_under_a_query_is_never_mixed_into_it(project, monkeypatch, capsys):
    """The index is rebuilt with another seed after the query read its first shard: the query
    stops, writing nothing, where it would have read the new build's shards after the old."""
    monkeypatch.setattr(layout, "SHARD_BYTES", 3 * 12 * 2)
    ix = index(project, "--dim", 4)
    chunks, rebuilt = Shards.chunks, []

    def rebuilding(self, rows):
        for n, chunk in enumerate(chunks(self, rows)):
            yield chunk
            if n == 0:
                cfg = index_output(load_config(project / "config.yaml"), str(ix))
                rebuilt.append(score_dataset(cfg, IndexScorer(dim=4, seed=7)))

    monkeypatch.setattr(Shards, "chunks", rebuilding)
    err = refused(monkeypatch, capsys, project, ix)
    assert rebuilt == [ix] and manifest(ix)["projection"]["seed"] == 7
    assert "the index was rebuilt or removed while this query read it" in err
    assert not (project / "q.parquet").exists()


def test_rows_damaged_between_a_shards_ends_are_named(project, monkeypatch, capsys):
    """The manifest's sha256 holds a shard's first and last 4 KiB: damage between them (a disk's,
    a copy's) scored zeros, the top k changed, exit 0. Each shard's CRC-32 is checked as the
    query streams it now, before anything is written."""
    monkeypatch.setattr("gradscope.index.manifest.ENDS", 8)  # ends of 8 bytes: a middle to damage
    ix = index(project, "--dim", 4)
    shard = ix / "shard-000000.npy"
    data = bytearray(shard.read_bytes())
    data[128 + 40 : 128 + 60] = bytes(20)  # rows 1 and 2 of 12 float16s, past the ends
    shard.write_bytes(bytes(data))
    err = refused(monkeypatch, capsys, project, ix)
    assert "shard-000000.npy is damaged: its rows are not the ones written" in err
    assert not (project / "q.parquet").exists()
