"""Half-precision models against the float64 loop: the model runs in its dtype, norms add up in
float32. Measured on this project (relative to the largest value): bfloat16 5e-3, float16 6e-4;
most of it is the rounding of the weights and inputs themselves."""

from __future__ import annotations

import dataclasses

import pandas as pd
import pytest
import torch
from oracle import assert_rel_close, reference_norms
from project import MODEL_PY, load_net, make_project

from gradscope.config import load_config
from gradscope.io.parquet import read_metadata
from gradscope.run import score_dataset


@pytest.mark.parametrize(("dtype", "rtol"), [("bfloat16", 2e-2), ("float16", 5e-3)])
def test_half_precision_against_float64_loop(tmp_path, dtype, rtol):
    cfg = load_config(make_project(tmp_path, n=23))
    path = score_dataset(dataclasses.replace(cfg, dtype=dtype))
    frame = pd.read_parquet(path)
    assert read_metadata(path)["dtype"] == read_metadata(path)["computed_in"] == dtype
    net, x, y = load_net(tmp_path)
    loss, norm = reference_norms(net, (x,), y, "cross_entropy")
    assert_rel_close(torch.tensor(frame["grad_norm"].to_numpy()), norm, rtol)
    assert_rel_close(torch.tensor(frame["loss"].to_numpy()), loss, rtol)
    assert frame["finite"].all()


AUTOCAST_PY = (
    MODEL_PY
    + """

class Autocast(Net):
    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return super().forward(x).float()
"""
)


def test_metadata_names_the_dtype_an_autocast_forward_computed_in(tmp_path):
    """Float32 weights whose forward runs under autocast: the numbers carry bfloat16's rounding,
    which the metadata says beside the weights' dtype (it said float32 alone)."""
    (tmp_path / "autocast.py").write_text(AUTOCAST_PY)
    cfg = load_config(make_project(tmp_path, n=9, model__factory="autocast.py:Autocast"))
    meta = read_metadata(score_dataset(cfg))
    assert (meta["dtype"], meta["computed_in"]) == ("float32", "bfloat16")
    model = dataclasses.replace(cfg.model, factory=f"{tmp_path / 'model.py'}:Net")
    output = dataclasses.replace(cfg.output, path=str(tmp_path / "plain.parquet"))
    plain = dataclasses.replace(cfg, model=model, output=output)
    meta = read_metadata(score_dataset(plain))
    assert (meta["dtype"], meta["computed_in"]) == ("float32", "float32")
