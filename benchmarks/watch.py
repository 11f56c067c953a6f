"""Time of a training step with the watch against the same step without it.

    python benchmarks/watch.py [--workloads T1,T3,W1] [--rounds 7] [--warmup 2] [--threads 1]

Each workload's model trains (train mode, SGD) on its batch: the plain step is zero_grad,
the forward, ``losses.mean().backward()`` and ``optimizer.step()``; the watched step is the
same with ``Watch.step(...).backward()`` in place of the forward and backward (rows written to
a temporary Parquet file). The two take turns after ``--warmup`` steps of each; the medians are
printed with their ratio. Times are this process's CPU time (run with one thread). The two steps
share one heap: a longer warm-up lets it settle (W1 and W8 move by about 0.05 between runs of two
warm-up steps).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from workloads import WORKLOADS, expand

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gradscope.errors import GradscopeError  # noqa: E402
from gradscope.losses import resolve_loss  # noqa: E402
from gradscope.training.watch import Watch  # noqa: E402


def _timed(step) -> float:
    """The step's CPU time: on a shared machine, what other processes take is not counted
    (one thread: a step's CPU time is its time)."""
    start = time.process_time()
    step()
    return time.process_time() - start


def measure(name: str, rounds: int, folder: Path, warmup: int = 2) -> tuple[float, float]:
    problem = WORKLOADS[name].build()
    plain_model = problem.model.train()
    watched_model = copy.deepcopy(plain_model)
    loss = resolve_loss(problem.loss)
    x, y = problem.inputs, problem.targets
    ids = torch.arange(len(y))
    plain_opt = torch.optim.SGD(plain_model.parameters(), lr=1e-4)
    watched_opt = torch.optim.SGD(watched_model.parameters(), lr=1e-4)

    def plain() -> None:
        plain_opt.zero_grad()
        loss(plain_model(*x), y).mean().backward()
        plain_opt.step()

    with Watch(watched_model, folder / f"{name}.parquet", problem.loss) as watch:

        def watched() -> None:
            watched_opt.zero_grad()
            watch.step(x, y, ids).backward()
            watched_opt.step()

        for _ in range(warmup):
            plain(), watched()
        times = {"plain": [], "watched": []}
        for r in range(rounds):
            order = (plain, watched) if r % 2 == 0 else (watched, plain)
            for step in order:
                times["plain" if step is plain else "watched"].append(_timed(step))
    return statistics.median(times["plain"]), statistics.median(times["watched"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="T1,T2,T3,T4,W1,W3")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2, help="steps of each before timing")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print("| workload | plain step | watched step | ratio |\n|---|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as folder:
        for name in expand(args.workloads.split(",")):
            if WORKLOADS[name].missing:
                continue
            title = WORKLOADS[name].title
            try:
                plain, watched = measure(name, args.rounds, Path(folder), args.warmup)
            except GradscopeError as e:  # a model or loss the watch refuses
                print(f"| {name} {title} | | refused: {e.what} | |", flush=True)
                continue
            print(f"| {name} {title} | {plain * 1e3:.1f} ms | {watched * 1e3:.1f} ms "
                  f"| {watched / plain:.2f}x |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
