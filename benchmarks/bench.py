"""Time and peak memory of per-example gradient norms and influence, as ratios to one plain backward.

    python benchmarks/bench.py [--quick] [--workloads W1,W2,tiny] [--methods ...]
                               [--skip METHODS@WORKLOADS] [--json out.json] [--markdown out.md]

Every method (``methods.py``) runs on the same model, batch and loss (``workloads.py``) as the
floor: one forward and one backward of the batch's summed loss with all parameters requiring grad.
Each workload runs in its own subprocess, where the methods take turns round-robin (the starting
method rotates every round) after warm-up, and the median of the repeats is reported; a sample
runs a method's call as many times as fill ``--sample-ms`` (on a 2-core CPU one or two calls of
W1-W10, a few dozen of the tiny workloads'), after one untimed call, and counts the time of one.
Peak memory is measured in a second subprocess per workload (see ``measure_memory``). Every
answer is checked against its task's loop before it is timed, so a fast wrong answer shows up as
"wrong", not as a win. Peers (torch.func, Opacus, BackPACK) are optional: one that is not
installed is "missing".
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from methods import METHODS, Skip, Step, clear_grads, known_failure, wrong_rel_err
from provenance import measured_commit
from torch import Tensor
from torch._C._profiler import _EventType
from workloads import SETS, WORKLOADS, Problem, expand

# ---------------------------------------------------------------- one workload, in one process

MAX_CALLS = 1000  # calls a sample at most (``calls``): a clock coarser than a call reads 0


@dataclass
class Result:
    workload: str
    method: str  # a METHODS key
    status: str = "ok"  # ok | wrong | missing | fails
    note: str = ""
    why: str = ""  # the few words of the note a table cell shows
    time_s: float | None = None
    mem_bytes: int | None = None
    rel_err: float | None = None
    time_ratio: float | None = None
    mem_ratio: float | None = None
    times_s: list[float] = field(default_factory=list)  # each sample's time of one call
    calls: int = 1  # calls a sample (``calls``)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _setup(
    pb: Problem, workload: str, keys: Sequence[str]
) -> tuple[dict[str, Step], dict[str, Result]]:
    steps: dict[str, Step] = {}
    results = {k: Result(workload, k) for k in keys}
    for key in keys:
        try:
            steps[key] = METHODS[key].setup(pb)
            results[key].note = getattr(steps[key], "note", "")  # what the step leaves out
        except Exception as e:  # noqa: BLE001 - a peer that breaks is a result, not a crash
            _fail(results[key], e)
    return steps, results


def _fail(result: Result, e: Exception) -> None:
    if isinstance(e, Skip):
        result.status, result.note, result.why = e.status, e.note, e.why
    else:
        result.status, result.note = "fails", f"{type(e).__name__}: {e}".splitlines()[0][:200]
        result.why = known_failure(METHODS[result.method].name, result.note)


def _rel_err(actual: Tensor, expected: Tensor) -> float:
    actual, expected = actual.detach().double().cpu(), expected.detach().double().cpu()
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-30)).item()


def _check(steps: dict[str, Step], results: dict[str, Result], dtype: torch.dtype | None) -> None:
    """Run each step once (its first warm-up call) and compare its answer with its task's loop.

    A step that raises leaves ``steps``; an answer off by more than ``wrong_rel_err(dtype)`` is
    "wrong".
    """
    answers: dict[str, Tensor | None] = {}
    for key, step in list(steps.items()):
        try:
            answers[key] = step()
        except Exception as e:  # noqa: BLE001
            _fail(results[key], e)
            del steps[key]
    for key in steps:
        method = METHODS[key]
        if method.task == "floor" or method.name == "loop":
            continue
        expected = answers.get(f"{method.task}:loop")
        if expected is None:
            results[key].note = "not checked: the loop did not run"
            continue
        results[key].rel_err = err = _rel_err(answers[key], expected)
        if err > wrong_rel_err(dtype):
            results[key].status = "wrong"
            results[key].note = f"off the loop's answer by {err:.2g} relative"


def time_workload(
    workload: str,
    keys: Sequence[str],
    repeats: int,
    warmup: int,
    device: torch.device,
    budget_s: float = float("inf"),
    clock: str = "wall",
    dtype: torch.dtype | None = None,
    sample_s: float = 0.0,
) -> list[Result]:
    """Check every method against the loop, then time them round-robin; medians in ``time_s``.

    A sample is ``calls`` of a method's calls (``sample_s``, ``_sample``). A method stops being
    timed once its samples add up to ``budget_s`` (it keeps at least one).
    ``clock="cpu"`` times the process's CPU time instead of the wall clock: on a machine shared
    with other work, with one thread, what each call computed rather than how long it waited.
    On CUDA, each method's peak memory is measured in the same process after the timing
    (``max_memory_allocated`` needs no process of its own; the CPU's profiler stays out of it).
    """
    now = time.process_time if clock == "cpu" else time.perf_counter
    pb = WORKLOADS[workload].build().to(device, dtype)
    steps, results = _setup(pb, workload, keys)
    _check(steps, results, dtype)
    for key, step in steps.items():
        results[key].calls = calls(step, now, device, sample_s)
    order = list(steps)
    for r in range(warmup - 1 + repeats):
        # rotate the starting method so none always runs right after the same neighbour
        for key in order[r % len(order) :] + order[: r % len(order)]:
            result = results[key]
            if sum(result.times_s) * result.calls > budget_s:
                continue  # a slow baseline: one or two samples place it well enough
            took = _sample(steps[key], now, device, result.calls)
            if r >= warmup - 1:
                result.times_s.append(took)
    for key in steps:
        results[key].time_s = statistics.median(results[key].times_s)
    if device.type == "cuda":
        for key, step in steps.items():
            clear_grads(pb.model.parameters())
            results[key].mem_bytes = _peak_bytes(step, device)
        clear_grads(pb.model.parameters())
    return list(results.values())


def _sample(step: Step, now: Callable[[], float], device: torch.device, n: int) -> float:
    """Seconds of one of ``n`` calls of ``step``, timed together after ``gc.collect`` and one
    untimed call: the collection walks the heap and leaves the caches cold, and a cold call
    among a sample's one or two (a host workload's) weighs on a method whose call fills the
    sample alone more than on one whose sample holds two."""
    gc.collect()
    _timed(step, now, device)
    return _timed(step, now, device, n) / n


def calls(step: Step, now: Callable[[], float], device: torch.device, sample_s: float) -> int:
    """How many calls of ``step`` fill one sample of ``sample_s`` (one where a call takes longer;
    at most ``MAX_CALLS``), from the faster of two calls (one, where it fills a sample alone): a
    tiny workload's call of a millisecond or two is near the grain of the clock and of the
    scheduler."""
    took = math.inf
    for _ in range(2 if sample_s > 0 else 0):
        took = min(took, _timed(step, now, device))
        if took >= sample_s:
            break
    return min(MAX_CALLS, max(1, math.ceil(sample_s / max(took, 1e-9))))


def _timed(step: Step, now: Callable[[], float], device: torch.device, n: int = 1) -> float:
    """Seconds of ``n`` calls of ``step``; on a GPU each call synchronised, so that they are
    calls one at a time, as a sample of one call measures."""
    _sync(device)
    start = now()
    for _ in range(n):
        step()
        _sync(device)
    return now() - start


def _allocated_peak(prof: torch.profiler.profile) -> int:
    """The most bytes of tensors held at once above what was held when ``prof`` began: the
    running sum of its allocation events (each allocation and free, in bytes, in time order)."""
    events, todo = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while todo:
        e = todo.pop()
        if e.tag == _EventType.Allocation:
            events.append((e.start_time_ns, e.extra_fields.alloc_size))
        todo.extend(e.children)
    running = peak = 0
    for _, size in sorted(events):
        running += size
        peak = max(peak, running)
    return peak


def _peak_bytes(step: Step, device: torch.device) -> int:
    """Memory above what was held before the call, at the call's peak: the bytes of tensors the
    device's allocator holds (on the CPU, as the profiler records each allocation and free)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        step()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    cpu = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=cpu, profile_memory=True) as prof:
        step()
    return _allocated_peak(prof)


def measure_memory(
    workload: str, keys: Sequence[str], device: torch.device, dtype: torch.dtype | None = None
) -> list[Result]:
    """Peak memory of one call of each method, after one warm-up call, methods one at a time.

    On the CPU: the most bytes of tensors held at once during the call above those held before
    it, from the profiler's record of every allocation and free; on CUDA, max_memory_allocated.
    Not the resident set: the kernel counts it in batches of pages (a tensor of 64 KiB allocated
    and freed leaves VmHWM unchanged) and malloc's arenas keep freed small blocks, so at the
    tiny and host workloads' few MiB the resident set measured the allocator, not the call.
    """
    pb = WORKLOADS[workload].build().to(device, dtype)
    results = []
    for key in keys:
        result = Result(workload, key)
        try:
            step = METHODS[key].setup(pb)
            step()
            # the warm call's .grad (the floor's) would be freed inside the measured call and
            # hide the size of the gradients that call allocates again
            clear_grads(pb.model.parameters())
            result.mem_bytes = _peak_bytes(step, device)
        except Exception as e:  # noqa: BLE001
            _fail(result, e)
        step = None
        clear_grads(pb.model.parameters())
        results.append(result)
    return results


# ---------------------------------------------------------------- all workloads, one subprocess each


def _worker(args: argparse.Namespace) -> None:
    keys, device, dtype = args.methods.split(","), torch.device(args.device), _dtype(args)
    if args.mode == "time":
        results = time_workload(
            args.worker,
            keys,
            args.repeats,
            args.warmup,
            device,
            args.budget,
            args.clock,
            dtype,
            args.sample_ms / 1000,
        )
    else:
        results = measure_memory(args.worker, keys, device, dtype)
    Path(args.out).write_text(json.dumps([asdict(r) for r in results]))


def _spawn(workload: str, mode: str, keys: Sequence[str], args: argparse.Namespace) -> list[Result]:
    env = dict(os.environ)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "results.json"
        cmd = [
            sys.executable, __file__, "--worker", workload, "--mode", mode,
            "--methods", ",".join(keys), "--repeats", str(args.repeats),
            "--warmup", str(args.warmup), "--budget", str(args.budget), "--device", args.device,
            "--threads", str(args.threads), "--clock", args.clock, "--dtype", args.dtype,
            "--sample-ms", str(args.sample_ms), "--out", str(out),
        ]  # fmt: skip
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0 or not out.exists():
            tail = (proc.stderr.strip().splitlines() or ["no output"])[-1][:200]
            return [
                Result(
                    workload,
                    k,
                    status="fails",
                    note=f"{mode} worker exit {proc.returncode}: {tail}",
                )
                for k in keys
            ]
        return [Result(**r) for r in json.loads(out.read_text())]


def run_workload(
    workload: str, keys: Sequence[str], args: argparse.Namespace, left_out: Collection[str] = ()
) -> list[Result]:
    """Timing and memory subprocesses for one workload, merged, as ratios to the floor, one result
    per key in order; the keys in ``left_out`` are not run and show as "left out"."""
    if WORKLOADS[workload].missing:
        note = f"{WORKLOADS[workload].requires} is not installed"
        return [Result(workload, k, status="missing", note=note) for k in keys]
    run = [k for k in keys if k not in left_out]
    timed = _spawn(workload, "time", run, args)
    # on CUDA the timing process measured the memory too
    by_method = {r.method: r for r in timed}
    cuda = torch.device(args.device).type == "cuda"
    memory = by_method if cuda else {r.method: r for r in _spawn(workload, "memory", run, args)}
    floor = next((r for r in timed if r.method == "floor"), None)
    floor_mem = memory.get("floor")
    for r in timed:
        r.mem_bytes = memory[r.method].mem_bytes if r.status in ("ok", "wrong") else None
        if r.time_s is not None and floor is not None and floor.time_s:
            r.time_ratio = r.time_s / floor.time_s
        if r.mem_bytes is not None and floor_mem is not None and floor_mem.mem_bytes:
            r.mem_ratio = r.mem_bytes / floor_mem.mem_bytes
    by_key = {r.method: r for r in timed}
    return [by_key.get(k) or Result(workload, k, status="left out") for k in keys]


# ---------------------------------------------------------------- reports


def _ratio(x: float | None) -> str:
    return "" if x is None else f"{x:.2f}x"


def _cell(r: Result) -> str:
    """One markdown cell: time and memory ratios, or the status and the few words of why."""
    if r.status in ("ok", "wrong") and r.time_ratio is not None:
        text = f"{r.time_ratio:.2f}x / {_ratio(r.mem_ratio) or '?'}"
        return text if r.status == "ok" else f"wrong ({text})"
    return f"{r.status} ({r.why})" if r.why else r.status


def markdown(results: Sequence[Result], workloads: Sequence[str]) -> str:
    """Methods down, workloads across: 'time / peak memory' as multiples of the floor.

    A cell with a note (why it failed, was wrong, or was not checked) points with [n] to the
    numbered note below; cells with the same note share one number.
    """
    by = {(r.workload, r.method): r for r in results}
    notes: dict[str, int] = {}  # "status: note" -> its number

    def cell(r: Result) -> str:
        if not r.note:
            return _cell(r)
        return f"{_cell(r)} [{notes.setdefault(f'{r.status}: {r.note}', len(notes) + 1)}]"

    lines = [
        "| method | " + " | ".join(f"{w} {WORKLOADS[w].title}" for w in workloads) + " |",
        "|---|" + "---|" * len(workloads),
    ]
    floor = ["floor (absolute)"]
    for w in workloads:
        r = by.get((w, "floor"))
        mem = "?" if r is None or r.mem_bytes is None else f"{r.mem_bytes / 2**20:.0f} MiB"
        floor.append("?" if r is None or r.time_s is None else f"{r.time_s * 1e3:.1f} ms / {mem}")
    lines.append("| " + " | ".join(floor) + " |")
    for key in dict.fromkeys(r.method for r in results if r.method != "floor"):
        cells = [cell(by[(w, key)]) if (w, key) in by else "" for w in workloads]
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    listed = [f"{n}. {text}" for text, n in notes.items()]
    return "\n".join(lines + ([""] + listed if listed else [])) + "\n"


def print_table(results: Sequence[Result]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="ratios to the floor (one forward+backward of the summed loss)")
    for col in [
        "workload",
        "method",
        "time",
        "time/floor",
        "peak mem",
        "mem/floor",
        "rel err",
        "status",
    ]:
        table.add_column(
            col, justify="left" if col in ("workload", "method", "status") else "right"
        )
    for r in results:
        table.add_row(
            r.workload,
            r.method,
            "" if r.time_s is None else f"{r.time_s * 1e3:.1f} ms",
            _ratio(r.time_ratio),
            "" if r.mem_bytes is None else f"{r.mem_bytes / 2**20:.1f} MiB",
            _ratio(r.mem_ratio),
            "" if r.rel_err is None else f"{r.rel_err:.1e}",
            r.status if not r.note else f"{r.status}: {r.note}",
        )
    Console(width=200).print(table)


def _environment(args: argparse.Namespace) -> dict[str, object]:
    versions: dict[str, object] = {"python": platform.python_version(), "torch": torch.__version__}
    for dist in ("opacus", "backpack-for-pytorch", "gradscope", "transformers"):
        versions[dist] = _version(dist)
    device = torch.device(args.device)
    return {
        **versions,
        "machine": platform.machine(),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "dtype": args.dtype,
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": args.device,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "budget_s": args.budget,
        "sample_ms": args.sample_ms,
        "clock": args.clock,
        "commit": measured_commit(),  # the gradscope measured (the docs name it)
    }


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats: a few minutes in all")
    parser.add_argument(
        "--workloads",
        default="default",
        help=f"names or sets, comma-separated; sets: {_sets()}",
    )
    parser.add_argument(
        "--methods", default=",".join(METHODS), help="METHODS keys, comma-separated"
    )
    parser.add_argument(
        "--skip",
        action="append",
        default=[],
        metavar="METHODS@WORKLOADS",
        help='leave methods out on some workloads, e.g. "norms:opacus hooks@W4,W5"; repeatable',
    )
    parser.add_argument(
        "--repeats", type=int, default=None, help="timed rounds (default 7, quick 3)"
    )
    parser.add_argument(
        "--warmup", type=int, default=None, help="untimed rounds, checking included"
    )
    parser.add_argument(
        "--budget",
        type=float,
        default=None,
        help="seconds of samples per method (default 20, quick 4)",
    )
    parser.add_argument(
        "--sample-ms",
        type=float,
        default=50.0,
        help="a sample runs a method's call as many times as fill this many ms (at least once)",
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16", "float64"],
        default="float32",
        help="the models' parameters and the batches' floating-point tensors",
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    parser.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="cpu: the process's CPU time (with --threads 1, on a machine shared with others)",
    )
    parser.add_argument("--json", type=Path, help="write every result here")
    parser.add_argument("--markdown", type=Path, help="write the README table here")
    # the subprocess side
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=["time", "memory"], help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    return parser


def _dtype(args: argparse.Namespace) -> torch.dtype | None:
    """The dtype to cast the workloads to; None for float32, as they are built."""
    return None if args.dtype == "float32" else getattr(torch, args.dtype)


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _sets() -> str:
    return "; ".join(f"{name} = {','.join(members)}" for name, members in SETS.items())


def _selection(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> tuple[list[str], list[str], dict[str, set[str]]]:
    """The workloads, the method keys (the floor first) and {workload: keys left out there}."""
    workloads, keys = expand(args.workloads.split(",")), args.methods.split(",")
    left_out: dict[str, set[str]] = {}
    for spec in args.skip:
        names, _, where = spec.partition("@")
        if not where:
            parser.error(f"--skip {spec!r}: expected METHODS@WORKLOADS")
        for w in expand(where.split(",")):
            left_out.setdefault(w, set()).update(names.split(","))
    skipped = set().union(*left_out.values())
    unknown = {w for w in [*workloads, *left_out] if w not in WORKLOADS}
    unknown |= {k for k in [*keys, *skipped] if k not in METHODS}
    if unknown:
        parser.error(f"unknown workload or method: {', '.join(sorted(unknown))}")
    if "floor" in skipped:
        parser.error("--skip: the floor cannot be left out, every ratio needs it")
    return workloads, ["floor"] + [k for k in keys if k != "floor"], left_out


def main(argv: Sequence[str] | None = None) -> None:
    parser = _parser()
    args = parser.parse_args(argv)
    args.repeats = args.repeats or (3 if args.quick else 7)
    args.warmup = args.warmup or (1 if args.quick else 2)
    args.budget = args.budget or (4.0 if args.quick else 20.0)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.worker:
        _worker(args)
        return
    workloads, keys, left_out = _selection(parser, args)
    results: list[Result] = []
    for w in workloads:
        start = time.perf_counter()
        results += run_workload(w, keys, args, left_out.get(w, set()))
        print(f"{w} done in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    print_table(results)
    table = markdown(results, workloads)
    print(table)
    if args.markdown:
        args.markdown.write_text(table)
    if args.json:
        report = {"environment": _environment(args), "results": [asdict(r) for r in results]}
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
