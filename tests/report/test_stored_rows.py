"""The report shows each example's row as stored, not as its batch padded it."""

from __future__ import annotations

import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import yaml
from typer.testing import CliRunner

from gradscope.cli import app

BAG = """
from torch import nn


class Bag(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.out = nn.Embedding(20, 4), nn.Linear(4, 3)

    def forward(self, input_ids, attention_mask):
        h = self.emb(input_ids) * attention_mask[..., None]  # (B, T, 4)
        return self.out(h.sum(1) / attention_mask.sum(1, keepdim=True))
"""


def test_the_report_shows_the_stored_row_not_the_padded_batch(tmp_path):
    rng = np.random.default_rng(0)
    lengths = rng.integers(2, 9, 12)
    ids = [rng.integers(2, 20, n) for n in lengths]  # no 0 (padding), no 1 (a mask)
    pq.write_table(pa.table({
        "input_ids": [list(map(int, i)) for i in ids],
        "attention_mask": [[1] * int(n) for n in lengths],
        "label": rng.integers(0, 3, 12),
    }), tmp_path / "data.parquet")  # fmt: skip
    (tmp_path / "bag.py").write_text(BAG)
    inputs = {"input_ids": "input_ids", "attention_mask": "attention_mask"}
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({
        "model": {"factory": "bag.py:Bag"},
        "data": {"path": "data.parquet", "inputs": inputs, "targets": "label",
                 "pad": {"input_ids": 0}, "batch_size": 12},
        "device": "cpu",
        "output": {"path": "scores.parquet"},
    }))  # fmt: skip
    result = CliRunner().invoke(app, ["norms", str(config), "--report", "--top-k", "5"])
    assert result.exit_code == 0, result.output
    page = (tmp_path / "scores.html").read_text()
    rows = re.findall(
        r'<td data-sort="[^"]*">(\d+)</td>\s*<td class="example"(.*?)</td>', page, re.S
    )
    assert len(rows) == 5
    for example, cell in rows:
        shown = dict(re.findall(r'<span class="name">(\w+)</span>([^<]*)</span>', cell))
        stored = ids[int(example)]
        assert shown["input_ids"] == "token ids: " + ", ".join(map(str, stored))
        assert shown["attention_mask"] == f"1 ×{len(stored)}"
    assert max(lengths) > min(lengths[int(e)] for e, _ in rows)  # some row was padded
