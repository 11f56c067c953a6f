"""Half-precision models against the float64 loop: the model runs in its dtype, norms add up in
float32. Measured on this project (relative to the largest value): bfloat16 5e-3, float16 6e-4;
most of it is the rounding of the weights and inputs themselves."""

from __future__ import annotations

import dataclasses

import pandas as pd
import pytest
import torch
from oracle import assert_rel_close, reference_norms
from project import load_net, make_project

from gradscope.config import load_config
from gradscope.io.parquet import read_metadata
from gradscope.run import score_dataset


@pytest.mark.parametrize(("dtype", "rtol"), [("bfloat16", 2e-2), ("float16", 5e-3)])
def test_half_precision_against_float64_loop(tmp_path, dtype, rtol):
    cfg = load_config(make_project(tmp_path, n=23))
    path = score_dataset(dataclasses.replace(cfg, dtype=dtype))
    frame = pd.read_parquet(path)
    assert read_metadata(path)["dtype"] == dtype
    net, x, y = load_net(tmp_path)
    loss, norm = reference_norms(net, (x,), y, "cross_entropy")
    assert_rel_close(torch.tensor(frame["grad_norm"].to_numpy()), norm, rtol)
    assert_rel_close(torch.tensor(frame["loss"].to_numpy()), loss, rtol)
    assert frame["finite"].all()
