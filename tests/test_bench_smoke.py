"""The benchmark script still runs: one tiny workload, the floor, the loop and gradscope, in-process."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench"] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    yield module
    del sys.modules["bench"]


KEYS = ["floor", "norms:loop", "norms:gradscope"]


def test_timing_checks_gradscope_against_the_loop(bench):
    results = {r.method: r for r in bench.time_workload("tiny", KEYS, 2, 1, torch.device("cpu"))}
    assert [r.status for r in results.values()] == ["ok"] * 3
    assert results["norms:gradscope"].rel_err < 1e-5
    assert all(len(r.times_s) == 2 and r.time_s > 0 for r in results.values())


def test_markdown_has_one_row_per_method(bench):
    results = bench.time_workload("tiny", KEYS, 1, 1, torch.device("cpu"))
    for r in results:
        r.time_ratio = r.time_s / results[0].time_s
    table = bench.markdown(results, ["tiny"])
    assert "| norms:gradscope | " in table and table.count("\n") == 5


@pytest.mark.skipif(
    not os.access("/proc/self/clear_refs", os.W_OK), reason="needs Linux's peak RSS reset"
)
def test_memory_is_measured_per_method(bench):
    results = bench.measure_memory("tiny", KEYS, torch.device("cpu"))
    assert all(r.status == "ok" and r.mem_bytes is not None for r in results)


def test_a_workload_whose_library_is_missing_is_reported_missing(bench, monkeypatch):
    workload = bench.Workload("lib", "needs a library", bench._cnn, "no_such_library_gradscope")
    monkeypatch.setitem(bench.WORKLOADS, "lib", workload)
    results = bench.run_workload("lib", KEYS, args=None)  # nothing is spawned
    assert [r.status for r in results] == ["missing"] * 3
    assert "no_such_library_gradscope is not installed" in results[0].note
