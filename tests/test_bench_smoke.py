"""The benchmark script still runs: the smoke workload, the floor, the loops and gradscope,
in-process, each answer checked against its task's loop."""

from __future__ import annotations

import types

import bench  # benchmarks/ is on sys.path (conftest.py), as it is for the script
import methods
import pytest
import torch
import workloads

CPU = torch.device("cpu")
KEYS = ["floor", "norms:loop", "norms:gradscope"]
INFLUENCE = [
    "reference:loop",
    "reference:gradscope",
    "influence:loop",
    "influence:torch.func",
    "influence:gradscope hooks",
    "influence:gradscope jvp",
    "per-ref:loop",
    "per-ref:gradscope",
]


def test_timing_checks_gradscope_against_the_loop():
    results = {r.method: r for r in bench.time_workload("smoke", KEYS, 2, 1, CPU)}
    assert [r.status for r in results.values()] == ["ok"] * 3
    assert results["norms:gradscope"].rel_err < 1e-5
    assert all(len(r.times_s) == 2 and r.time_s > 0 for r in results.values())


class FakeClock:
    """A clock that only a step moves: each call of ``step`` takes ``took`` seconds, the first
    after ``collect`` (a fake ``gc.collect``) ``cold`` more."""

    def __init__(self, took: float, cold: float = 0.0):
        self.t, self.took, self.cold, self.steps = 0.0, took, cold, 0
        self._cold = False

    def now(self) -> float:
        return self.t

    def step(self) -> None:
        self.t += self.took + (self.cold if self._cold else 0.0)
        self._cold = False
        self.steps += 1

    def collect(self) -> None:
        self._cold = True


def test_a_sample_runs_as_many_calls_as_fill_it():
    fast, slow = FakeClock(0.002), FakeClock(0.2)
    assert bench.calls(fast.step, fast.now, CPU, 0.05) == 25
    assert fast.steps == 2  # sized from the faster of two calls
    assert bench.calls(slow.step, slow.now, CPU, 0.05) == 1  # a slow call: one a sample
    assert slow.steps == 1
    assert bench.calls(fast.step, fast.now, CPU, 0.0) == 1 and fast.steps == 2  # none asked
    assert bench.calls(FakeClock(0.0).step, fast.now, CPU, 0.05) == bench.MAX_CALLS


def test_a_timed_sample_counts_one_warm_call_of_its_many(monkeypatch):
    clock = FakeClock(1 / 16, cold=1 / 2)  # binary fractions: the clock's sums exact
    monkeypatch.setattr(bench, "time", types.SimpleNamespace(perf_counter=clock.now))
    monkeypatch.setattr(bench, "gc", types.SimpleNamespace(collect=clock.collect))
    fake = methods.Method("floor", "floor", lambda pb: clock.step)
    monkeypatch.setitem(bench.METHODS, "floor", fake)
    (floor,) = bench.time_workload("smoke", ["floor"], 3, 2, CPU, sample_s=1 / 4)
    assert floor.calls == 4
    # the checking call, two that size a sample, then a warm-up round and three samples, each
    # an untimed call after the collection and 4 timed calls
    assert clock.steps == 1 + 2 + 4 * (1 + 4)
    assert floor.times_s == [1 / 16] * 3 and floor.time_s == 1 / 16  # the cold call untimed


def test_reference_and_scoring_are_checked_against_their_loops():
    results = {r.method: r for r in bench.time_workload("smoke", ["floor", *INFLUENCE], 1, 1, CPU)}
    assert all(r.status == "ok" for r in results.values())
    checked = [k for k in INFLUENCE if not k.endswith(":loop")]
    assert all(results[k].rel_err < 1e-5 for k in checked)


def test_index_is_checked_against_the_projected_loop():
    keys = ["floor", "index:loop", "index:gradscope"]
    results = {r.method: r for r in bench.time_workload("smoke", keys, 1, 1, CPU)}
    assert all(r.status == "ok" for r in results.values())
    assert results["index:gradscope"].rel_err < 1e-5


def test_an_answer_off_the_loop_is_wrong(monkeypatch):
    def doubled(pb):
        step = methods.loop_influence(pb)
        return lambda: 2 * step()

    off = methods.Method("doubled", "influence", doubled)
    monkeypatch.setitem(bench.METHODS, off.key, off)
    results = bench.time_workload("smoke", ["floor", "influence:loop", off.key], 1, 1, CPU)
    assert results[-1].status == "wrong" and results[-1].rel_err == pytest.approx(1.0)
    for r in results:
        r.time_ratio = r.time_s / results[0].time_s
    table = bench.markdown(results, ["smoke"])
    assert "| influence:doubled | wrong (" in table and ") [1] |" in table
    assert table.endswith("\n1. wrong: off the loop's answer by 1 relative\n")


def test_influence_steps_leave_the_reference_batch_to_their_setup():
    pb = workloads.WORKLOADS["smoke"].build()  # batch 4, reference batch 8
    scoring = ("influence:", "per-ref:")
    steps = [methods.METHODS[k].setup(pb) for k in INFLUENCE if k.startswith(scoring)]
    rows: list[int] = []
    pb.model.register_forward_pre_hook(lambda _, args: rows.append(args[0].shape[0]))
    for step in steps:
        step()
    assert rows and 8 not in rows
    methods.METHODS["reference:gradscope"].setup(pb)()
    assert rows[-1] == 8


def test_markdown_has_one_row_per_method():
    results = bench.time_workload("smoke", KEYS, 1, 1, CPU)
    for r in results:
        r.time_ratio = r.time_s / results[0].time_s
    table = bench.markdown(results, ["smoke"])
    assert "| norms:gradscope | " in table and table.count("\n") == 5


def test_tiny_expands_to_its_workloads():
    assert workloads.expand(["W1", "tiny", "T2"]) == ["W1", "T1", "T2", "T3", "T4"]
    assert workloads.expand(["default"])[-1] == "W10"


def test_the_script_leaves_a_skipped_method_out_where_asked(tmp_path):
    table = tmp_path / "table.md"
    argv = ["--quick", "--threads", "1", "--workloads", "smoke", "--markdown", str(table)]
    bench.main([*argv, "--methods", "norms:loop,norms:gradscope", "--skip", "norms:loop@smoke"])
    lines = table.read_text().splitlines()
    assert lines[3] == "| norms:loop | left out |"
    assert lines[4].startswith("| norms:gradscope | ") and lines[4].endswith(" [1] |")
    assert lines[-1] == "1. ok: not checked: the loop did not run"


def test_memory_is_measured_per_method():
    results = bench.measure_memory("smoke", KEYS, CPU)
    assert all(r.status == "ok" and r.mem_bytes is not None for r in results)


def test_the_cpu_peak_is_the_most_tensor_bytes_held_at_once():
    held = torch.empty(2**20)  # before the call: not counted, nor is its free inside it

    def step() -> None:
        nonlocal held
        held = None
        a, b = torch.empty(2**18), torch.empty(2**16)  # 1 MiB and 256 KiB at once
        del a, b
        c = torch.empty(2**17)  # 512 KiB after both are freed: below the peak
        del c

    assert bench._peak_bytes(step, CPU) == 2**20 + 2**18


def test_a_workload_whose_library_is_missing_is_reported_missing(monkeypatch):
    smoke = bench.WORKLOADS["smoke"]
    workload = workloads.Workload("lib", "needs a library", smoke.build, "no_lib")
    monkeypatch.setitem(bench.WORKLOADS, "lib", workload)
    results = bench.run_workload("lib", KEYS, args=None)  # nothing is spawned
    assert [r.status for r in results] == ["missing"] * 3
    assert "no_lib is not installed" in results[0].note


@pytest.mark.parametrize("positions", [None, 5])
def test_the_linear_hooks_are_the_loop_where_every_layer_is_linear(positions: int | None):
    """The scale reference hooks Linear layers alone: on a model of nothing else its norms are
    the loop's, on one position per example and on several (the Gram route)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    shape = (positions,) if positions else ()

    def make(n: int):
        return torch.randn(n, *shape, 4), torch.randn(n, *shape, 3)

    pb = workloads._problem(model, make, 6, "mse")
    step = methods.METHODS["floor:linear hooks"].setup(pb)
    torch.testing.assert_close(step(), methods.METHODS["norms:loop"].setup(pb)(), rtol=1e-5, atol=0)
    assert step.note == ""


def test_the_linear_hooks_say_what_they_leave_out():
    """Beside a layer of another kind the Linear-only hooks compute less than an exact pass
    must: the result says how much, and which modules hold it (a cell's note on the page)."""
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 3, bias=False))
    pb = workloads._problem(model, lambda n: (torch.randint(10, (n,)), torch.randn(n, 3)), 4, "mse")
    result = bench._setup(pb, "smoke", ["floor:linear hooks"])[1]["floor:linear hooks"]
    assert result.note == "leaves out 77% of the weights (1 of 2 tensors: Embedding)"


def test_products_counts_each_pass_product():
    """The smoke MLP 8-16-1 at batch 4: the forward's two addmm, 2 B (8*16 + 16*1) flops; the
    floor's backward the two weight gradients (as many) and the second layer's input gradient,
    2 B 16; gradscope's norms no weight gradient, the input gradient alone."""
    import products

    forward, weights, inputs = 2 * 4 * (8 * 16 + 16), 2 * 4 * (8 * 16 + 16), 2 * 4 * 16
    floor = products.products("smoke", "floor")
    assert floor == pytest.approx({"addmm": forward / 1e6, "mm": (weights + inputs) / 1e6})
    norms = products.products("smoke", "norms:gradscope")
    assert norms == pytest.approx({"addmm": forward / 1e6, "mm": inputs / 1e6})
