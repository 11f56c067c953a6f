"""torchrun: ranks share the batches without duplicates or padding, and rank 0 writes one file."""

from __future__ import annotations

import os
import subprocess
import sys

import pandas as pd
import pytest
import torch
from project import make_project

from gradscope.api import score_dataset
from gradscope.config import load_config
from gradscope.distributed import World, broadcast_tensors


@pytest.mark.parametrize(("total", "size"), [(23, 2), (23, 3), (8, 4), (3, 4), (1, 2)])
def test_ranks_cover_every_row_once(total, size):
    batch_size = 4
    batches = -(-total // batch_size)
    owners = [[r for r in range(size) if World(r, size).owns(b)] for b in range(batches)]
    assert all(len(o) == 1 for o in owners)
    assert sum(World(r, size).rows(total, batch_size) for r in range(size)) == total
    assert World(1, size).rows(None, batch_size) is None


def test_device_per_rank():
    assert World(1, 2, local_rank=1).device("cpu") == "cpu"
    assert World(0, 1).device("auto") == "auto"  # one process: the config decides
    expected = "cuda:1" if torch.cuda.is_available() else "cpu"
    assert World(1, 2, local_rank=1).device("auto") == expected


def test_broadcast_in_one_process_is_the_identity():
    t = torch.arange(3.0)
    (out,) = broadcast_tensors([t])
    assert out is t


def test_torchrun_two_processes_equal_one(tmp_path):
    config = make_project(tmp_path, n=23, data__ids="name")
    one = pd.read_parquet(score_dataset(load_config(config)))
    out = tmp_path / "two.parquet"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--standalone", "-m", "gradscope", "norms", str(config), "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count("wrote ") == 1  # only rank 0 reports
    pd.testing.assert_frame_equal(pd.read_parquet(out), one)
