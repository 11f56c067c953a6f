"""Time of a training step with the watch against the same step without it.

    python benchmarks/watch.py [--workloads W1,W3] [--pairs 3] [--rounds 15] [--warmup 20]
                               [--against /work/main] [--heap kept] [--threads 1]

Each workload's model trains (train mode, SGD) on its batch: the plain step is zero_grad,
the forward, ``losses.mean().backward()`` and ``optimizer.step()``; the watched step is the
same with ``Watch.step(...).backward()`` in place of the forward and backward (rows written to
a temporary Parquet file). Each runs in a process of its own (no heap shared between the two,
nor what one leaves for the other to fault in), ``--warmup`` steps and then ``--rounds`` timed
ones, each step's CPU time (one thread: other processes' time is not counted) and minor page
faults kept. ``--pairs`` pairs of processes run one after the other, plain first and watched
first by turns; a pair's ratio is its watched median over its plain median, and the table gives
the median ratio over the pairs and their range. ``--against DIR`` also runs the watched step
of the gradscope in DIR (another worktree: main) in each pair, beside this one's, against the
same plain step: an A/B in one session.

``--heap kept`` (the default) runs each process on a heap that keeps what it was given (glibc:
no ``mmap``, no trim), so that after warm-up no step faults pages in and a ratio is the two
steps' own work. ``--heap system`` keeps glibc's defaults, under which whether a step's large
tensors are faulted in afresh at every step depends on the heap's history, from process to
process of the same code (the same watched W3 step: 3 and 7,594 minor faults a step, about 15%
of its time): the faults column shows it, as the median over the processes and their range.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from workloads import WORKLOADS, expand

HERE = Path(__file__).resolve()
# glibc's heap that neither maps large blocks apart nor gives memory back
KEPT = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(2**40)}


def _steps(step, warmup: int, rounds: int) -> dict[str, list[float]]:
    """Each timed step's CPU time (s) and minor page faults, after ``warmup`` untimed ones."""
    for _ in range(warmup):
        step()
    times, faults = [], []
    for _ in range(rounds):
        before, start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.process_time()
        step()
        times.append(time.process_time() - start)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return {"times": times, "faults": faults}


def child(name: str, mode: str, warmup: int, rounds: int, folder: Path) -> dict:
    """One process's steps of ``mode`` (plain or watched) on workload ``name``."""
    from gradscope.losses import resolve_loss
    from gradscope.training.watch import Watch

    problem = WORKLOADS[name].build()
    model = problem.model.train()
    x, y = problem.inputs, problem.targets
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    if mode == "plain":
        loss = resolve_loss(problem.loss)

        def plain() -> None:
            optimizer.zero_grad()
            loss(model(*x), y).mean().backward()
            optimizer.step()

        return _steps(plain, warmup, rounds)
    ids = torch.arange(len(y))
    with Watch(model, folder / f"{name}.parquet", problem.loss) as watch:

        def watched() -> None:
            optimizer.zero_grad()
            watch.step(x, y, ids).backward()
            optimizer.step()

        return _steps(watched, warmup, rounds)


def _spawn(name: str, mode: str, package: Path, args: argparse.Namespace) -> dict:
    """``child`` in a fresh process importing gradscope from ``package``."""
    env = dict(os.environ, PYTHONPATH=str(package), OMP_NUM_THREADS=str(args.threads))
    env |= KEPT if args.heap == "kept" else {}
    command = [sys.executable, str(HERE), "--child", mode, "--workloads", name,
               "--warmup", str(args.warmup), "--rounds", str(args.rounds),
               "--threads", str(args.threads)]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    lines = done.stdout.strip().splitlines()
    if done.returncode or not lines:
        raise RuntimeError(f"{name} {mode} ({package}): {done.stderr.strip()[-2000:]}")
    return json.loads(lines[-1])


def measure(name: str, args: argparse.Namespace) -> dict[str, list[dict]]:
    """``--pairs`` pairs of processes: each mode's steps, in order (watched: this tree's, and
    ``against``: the other's)."""
    trees = {"watched": HERE.parents[1]} | ({"against": args.against} if args.against else {})
    runs: dict[str, list[dict]] = {"plain": []} | {mode: [] for mode in trees}
    for pair in range(args.pairs):
        order = [("plain", HERE.parents[1]), *trees.items()]
        for mode, package in order if pair % 2 == 0 else order[::-1]:
            runs[mode].append(_spawn(name, "plain" if mode == "plain" else "watched", package,
                                     args))  # fmt: skip
    return runs


def _row(name: str, runs: dict[str, list[dict]]) -> str:
    """The table's row: each mode's median step and faults a step, each watched mode's median
    ratio over the pairs and its range."""
    med = {mode: [statistics.median(r["times"]) for r in rs] for mode, rs in runs.items()}
    cells = [f"{name} {WORKLOADS[name].title}"]
    for mode, rs in runs.items():
        faults = sorted(statistics.median(r["faults"]) for r in rs)
        cells.append(f"{statistics.median(med[mode]) * 1e3:.1f} ms / "
                     f"{statistics.median(faults):.0f} ({faults[0]:.0f}-{faults[-1]:.0f})")  # fmt: skip
        if mode != "plain":
            ratios = sorted(w / p for w, p in zip(med[mode], med["plain"], strict=True))
            cells.append(f"{statistics.median(ratios):.3f}x ({ratios[0]:.3f}-{ratios[-1]:.3f})")
    return "| " + " | ".join(cells) + " |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="T1,T2,T3,T4,W1,W3")
    parser.add_argument("--pairs", type=int, default=3, help="pairs of processes per workload")
    parser.add_argument("--rounds", type=int, default=15, help="timed steps per process")
    parser.add_argument("--warmup", type=int, default=20, help="untimed steps before them")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--against", type=Path, help="another tree's gradscope, watched too")
    parser.add_argument("--heap", choices=("kept", "system"), default="kept")
    parser.add_argument("--child", choices=("plain", "watched"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.child:
        from gradscope.errors import GradscopeError

        with tempfile.TemporaryDirectory() as folder:
            try:
                result = child(args.workloads, args.child, args.warmup, args.rounds, Path(folder))
            except GradscopeError as e:  # a model or loss the watch refuses
                result = {"refused": e.what}
        print(json.dumps(result))
        return
    head = "| workload | plain step / faults | watched / faults | ratio (range) |"
    if args.against:
        head += " against: watched / faults | ratio (range) |"
    print(head + "\n|---|---:|---:|---:|" + ("---:|---:|" if args.against else ""))
    for name in expand(args.workloads.split(",")):
        if WORKLOADS[name].missing:
            continue
        runs = measure(name, args)
        refused = [r["refused"] for rs in runs.values() for r in rs if "refused" in r]
        row = f"| {name} | | refused: {refused[0]} | |" if refused else _row(name, runs)
        print(row, flush=True)


if __name__ == "__main__":
    main()
