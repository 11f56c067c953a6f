"""What stands for the data in fingerprints, truth files and metadata: its files' sha256, or
where code makes the rows (``file.py:fn``), theirs, however the run batches them."""

from __future__ import annotations

import dataclasses

import pandas as pd
import pytest
from project import edit_config, edit_data, made_by_code, make_project

from gradscope.config import load_config
from gradscope.errors import DataError
from gradscope.io.data import data_identity, data_sha256
from gradscope.report import write_report
from gradscope.run import score_dataset


def code_made(tmp_path):
    config = make_project(tmp_path, n=23, data__ids="name")
    edit_config(tmp_path, lambda c: c["data"].update(path=made_by_code(tmp_path)))
    return load_config(config)


def test_the_rows_code_makes_stand_for_it_whatever_the_batches(tmp_path):
    cfg = code_made(tmp_path)
    first = data_identity(cfg.data)
    assert first.startswith("rows:") and data_sha256(cfg.data.path) is None
    for other in ({"batch_size": 5}, {"ids": None}):  # how a run reads them, not which
        assert data_identity(dataclasses.replace(cfg.data, **other)) == first
    assert data_identity(dataclasses.replace(cfg.data, limit=20)) != first
    assert data_identity(dataclasses.replace(cfg.data, limit=20), cfg.data.path) == first  # REF
    edit_data(tmp_path, lambda d: d["x"][22].add_(1))
    assert data_identity(cfg.data) != first


ENDLESS = """
import itertools

import torch


class Endless(torch.utils.data.IterableDataset):
    def __iter__(self):
        for i in itertools.count():
            yield {"x": torch.full((5,), float(i)), "y": torch.tensor(i % 3)}


def make():
    return Endless()
"""


def test_a_stream_without_end_is_hashed_up_to_its_limit(tmp_path):
    (tmp_path / "stream.py").write_text(ENDLESS)
    cfg = load_config(make_project(tmp_path, data__path="stream.py:make", data__limit=9))
    assert data_identity(cfg.data).startswith("rows:")  # returns: 9 rows, not all of them


PADDED = """
import torch


def make():
    rows = [{"x": torch.arange(1.0, n + 1), "y": torch.tensor(n % 3)} for n in (2, 5, 3, 4, 6)]

    def padded(batch):  # each batch to its own longest row, as DataCollatorWithPadding does
        width = max(len(r["x"]) for r in batch)
        x = torch.stack([torch.nn.functional.pad(r["x"], (0, width - len(r["x"]))) for r in batch])
        return {"x": x, "y": torch.stack([r["y"] for r in batch])}

    return torch.utils.data.DataLoader(rows, batch_size=2, collate_fn=padded)
"""


def test_a_loader_padding_each_batch_to_its_own_width_is_hashed_as_it_collates(tmp_path):
    """Its batches cannot be joined into one run (they differ in width): the hash read them
    as runs of 4096 rows, and every run over such a loader was refused."""
    (tmp_path / "padded.py").write_text(PADDED)
    cfg = load_config(make_project(tmp_path, data__path="padded.py:make"))
    first = data_identity(cfg.data)
    assert first.startswith("rows:") and data_identity(cfg.data) == first


def test_files_stand_for_themselves(tmp_path):
    cfg = load_config(make_project(tmp_path, n=23))
    assert data_identity(cfg.data) == data_sha256(cfg.data.path) is not None


def test_a_report_over_code_made_rows_changed_since_is_refused(tmp_path):
    """The scores keep the rows' sha256: the report of rows changed since would show other
    examples' text beside the scores."""
    cfg = code_made(tmp_path)
    out = score_dataset(cfg)
    assert pd.read_parquet(out).shape[0] == 23
    write_report(out, cfg=cfg)
    limited = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, limit=10))
    write_report(score_dataset(limited), cfg=cfg)  # the rows scored, by the file's limit
    edit_data(tmp_path, lambda d: d["x"][0].add_(1))
    with pytest.raises(DataError, match="the data changed since it was scored"):
        write_report(out, cfg=cfg)
