"""torchrun: ranks share the batches without duplicates or padding, and rank 0 writes one file."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pandas as pd
import pytest
import torch
from project import CountingNorms, make_project

from gradscope.config import load_config
from gradscope.distributed import World, broadcast_tensors
from gradscope.errors import Interrupted
from gradscope.run import score_dataset
from gradscope.scorers import InfluenceScorer


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
    assert broadcast_tensors({"w": t})["w"] is t


def torchrun(config, *args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
         "-m", "gradscope", "norms", str(config), *args],
        env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_torchrun_two_processes_equal_one(tmp_path):
    config = make_project(tmp_path, n=23, data__ids="name")
    one = pd.read_parquet(score_dataset(load_config(config)))
    out = tmp_path / "two.parquet"
    run = torchrun(config, "--out", str(out))
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count("wrote ") == 1  # only rank 0 reports
    pd.testing.assert_frame_equal(pd.read_parquet(out), one)


@pytest.mark.slow
def test_one_process_run_resumed_by_two(tmp_path):
    config = make_project(tmp_path, n=23)
    cfg = load_config(config)
    whole = pd.read_parquet(score_dataset(cfg))
    (tmp_path / "scores.parquet").unlink()

    with pytest.raises(Interrupted):
        score_dataset(cfg, CountingNorms(stop=3))  # at row 12
    run = torchrun(config, "--resume")
    assert run.returncode == 0, run.stderr[-3000:]
    pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "scores.parquet"), whole)


BROADCAST = """
import sys
import torch
from gradscope import distributed

with distributed.session() as world:
    mine = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.tensor([7], dtype=torch.int64)}
    got = distributed.broadcast_tensors(mine if world.main else None)
    torch.save(got, f"{sys.argv[1]}/rank{world.rank}.pt")
"""


@pytest.mark.slow
def test_broadcast_tensors_between_two_processes(tmp_path):
    (tmp_path / "bcast.py").write_text(BROADCAST)
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
         str(tmp_path / "bcast.py"), str(tmp_path)],
        env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    for rank in (0, 1):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert list(got) == ["a", "b"]
        a, b = got["a"], got["b"]
        torch.testing.assert_close(a, torch.arange(6.0).reshape(2, 3))
        assert b.dtype == torch.int64 and b.tolist() == [7]


@pytest.mark.slow
def test_torchrun_influence_equals_one_process(tmp_path):
    config = make_project(tmp_path, n=23)
    ref = tmp_path / "ref.pt"
    torch.save({"x": torch.randn(5, 5), "y": torch.randint(0, 3, (5,))}, ref)
    one = pd.read_parquet(score_dataset(load_config(config), InfluenceScorer(ref)))
    out = tmp_path / "two.parquet"
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
         "-m", "gradscope", "influence", str(config), "--ref", str(ref), "--out", str(out)],
        env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    pd.testing.assert_frame_equal(pd.read_parquet(out), one)


def free_port() -> int:
    with socket.socket() as s:  # a port where no one listens
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("rank", ["0", "1"])
def test_a_rank_whose_peers_never_come_says_so_and_gives_up(tmp_path, rank):
    """WORLD_SIZE=2 set for this process alone (not inherited), no second process: one line says
    at once what it waits for, then distributed.join_timeout ends the wait with one error line."""
    config = make_project(tmp_path, distributed={"join_timeout": 2})
    port = free_port()
    env = {**os.environ, "WORLD_SIZE": "2", "RANK": rank, "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}  # fmt: skip
    env.pop("GRADSCOPE_DEBUG", None)
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "gradscope", "norms", str(config)],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert time.monotonic() - start < 60  # not torch's 30 minutes
    assert done.returncode == 2, done.stderr[-3000:]
    waiting, error = done.stderr.strip().splitlines()
    assert waiting == (
        f"rank {rank} of 2: waiting up to 2 s for the other processes of WORLD_SIZE=2 at "
        f"127.0.0.1:{port} (distributed.join_timeout); not launched by torchrun? stop with "
        "Ctrl-C and unset WORLD_SIZE to run alone"
    )
    assert error == (
        f"error: the 2 processes of WORLD_SIZE=2 did not all meet at 127.0.0.1:{port} within "
        "2 s; launch them with torchrun, unset WORLD_SIZE to run alone, or raise "
        "distributed.join_timeout (environment)"
    )
    assert not (tmp_path / "scores.parquet").exists()


@pytest.mark.parametrize("command", ["train", "factors", "query"])
def test_a_command_of_one_process_under_torchrun_is_one_line(tmp_path, monkeypatch, command):
    """Each rank would do all of it: a query's ranks fought over the output's lock (the first
    refused, the second wrote), the factors were fitted and written by every rank."""
    from typer.testing import CliRunner

    from gradscope.cli import app

    config = make_project(tmp_path, n=8, train={"epochs": 1})
    monkeypatch.setenv("WORLD_SIZE", "2")  # this process's own, as torchrun sets a rank's
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))  # no peer: refused before it is met
    args = {"train": [config], "factors": [config], "query": [tmp_path, "--ref", config]}
    result = CliRunner().invoke(app, [command, *map(str, args[command])])
    assert result.exit_code == 2, result.output
    assert "runs in one process; run it without torchrun" in result.output
