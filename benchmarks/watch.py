"""Time of a training step with the watch against the same step without it.

    python benchmarks/watch.py [--workloads W1,W3] [--pairs 3] [--rounds 15] [--warmup 20]
                               [--against /work/main] [--heap kept] [--threads 1] [--record]
                               [--dropout 0.1]

Each workload's model trains (train mode, SGD) on its batch: the plain step is zero_grad,
the forward, ``losses.mean().backward()`` and ``optimizer.step()``; the watched step is the
same with ``Watch.step(...).backward()`` in place of the forward and backward (rows written to
a temporary Parquet file; with ``--record`` its run record too: ``record=``, a checkpoint every
32 steps). ``--dropout P`` sets every ``nn.Dropout``'s probability, and an attention's held as
``dropout_prob`` or ``attention_dropout`` (BERT's, LLaMA's), to P: W6's batches, padded to
their longest rows, then check each unpadded row's way with dropout left out. Each runs in a process of its own, so no heap is shared between the two, nor what
one leaves for the other to fault in; the processes of a pair (plain, watched, and
with ``--against DIR`` the watched step of the gradscope in DIR, another worktree: main) warm
up with ``--warmup`` steps, then take ``--rounds`` steps by turns, one step each, in an order
that alternates, so that each sees the machine's load as the others do. Each step's CPU time
(one thread: other processes' time is not counted) and minor page faults are kept. A pair's
ratio is its watched median over its plain median; the table gives the median ratio over the
``--pairs`` pairs and their range.

``--heap kept`` (the default) runs each process on a heap that keeps what it was given (glibc:
no ``mmap``, no trim), so that after warm-up no step faults pages in and a ratio is the two
steps' own work. ``--heap system`` keeps glibc's defaults, under which whether a step's large
tensors are faulted in afresh at every step depends on the heap's history, from process to
process of the same code (the same watched W3 step: a median of 3 minor faults a step in three
processes, of 7,594 in three others, 7% of its time apart): the faults column shows it, as the
median over the processes and their range.
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


def _serve(step, warmup: int) -> None:
    """After ``warmup`` steps, one timed step for each line read: its CPU time (s) and minor
    page faults, a JSON line each."""
    for _ in range(warmup):
        step()
    print("ready", flush=True)
    for _ in sys.stdin:
        before, start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.process_time()
        step()
        seconds = time.process_time() - start
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        print(json.dumps({"time": seconds, "faults": faults}), flush=True)


def child(name: str, mode: str, warmup: int, folder: Path, record: bool, dropout: float) -> None:
    """One process's steps of ``mode`` (plain or watched, ``record``: with its run record) on
    workload ``name``, its dropout at ``dropout`` where it is above 0."""
    from gradscope.losses import resolve_loss
    from gradscope.training.watch import Watch

    problem = WORKLOADS[name].build()
    model = problem.model.train()
    if dropout:
        _dropped(model, dropout)
    x, y = problem.inputs, problem.targets
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    if mode == "plain":
        loss = resolve_loss(problem.loss)

        def plain() -> None:
            optimizer.zero_grad()
            loss(model(*x), y).mean().backward()
            optimizer.step()

        return _serve(plain, warmup)
    ids = torch.arange(len(y))
    run = folder / "run" if record else None
    with Watch(
        model, folder / f"{name}.parquet", problem.loss, record=run, optimizer=optimizer
    ) as watch:

        def watched() -> None:
            optimizer.zero_grad()
            watch.step(x, y, ids).backward()
            optimizer.step()

        return _serve(watched, warmup)


def _dropped(model: torch.nn.Module, p: float) -> None:
    """Every dropout of ``model`` at ``p``: its ``nn.Dropout`` modules', its attentions'."""
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = p
        for name in ("dropout_prob", "attention_dropout"):
            if isinstance(getattr(m, name, None), float):
                setattr(m, name, p)


def _spawn(name: str, mode: str, package: Path, args: argparse.Namespace) -> subprocess.Popen:
    """``child`` in a fresh process importing gradscope from ``package``."""
    env = dict(os.environ, PYTHONPATH=str(package), OMP_NUM_THREADS=str(args.threads))
    env |= KEPT if args.heap == "kept" else {}
    command = [sys.executable, str(HERE), "--child", mode, "--workloads", name,
               "--warmup", str(args.warmup), "--threads", str(args.threads)]  # fmt: skip
    command += ["--record"] if args.record else []
    command += ["--dropout", str(args.dropout)]
    return subprocess.Popen(command, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)  # fmt: skip


def _line(process: subprocess.Popen) -> str:
    line = process.stdout.readline().strip()
    if not line:
        raise RuntimeError(f"a benchmark process ended: {process.args}")
    return line


def _pair(name: str, trees: dict[str, Path], args: argparse.Namespace, flip: bool) -> dict:
    """One process per mode, their steps taken by turns: each mode's times and faults (or
    why the watch refused the workload)."""
    processes = {mode: _spawn(name, "plain" if mode == "plain" else "watched", tree, args)
                 for mode, tree in trees.items()}  # fmt: skip
    runs: dict = {mode: {"times": [], "faults": []} for mode in trees}
    try:
        for process in processes.values():
            line = _line(process)
            if line != "ready":
                return {"refused": json.loads(line)["refused"]}
        for r in range(args.rounds):
            order = list(processes) if (r % 2 == 0) != flip else list(processes)[::-1]
            for mode in order:
                processes[mode].stdin.write("step\n")
                processes[mode].stdin.flush()
                step = json.loads(_line(processes[mode]))
                runs[mode]["times"].append(step["time"])
                runs[mode]["faults"].append(step["faults"])
    finally:
        for process in processes.values():
            process.stdin.close()
            process.wait()
    return runs


def measure(name: str, args: argparse.Namespace) -> dict[str, list[dict]]:
    """``--pairs`` pairs of processes: each mode's steps, by pair (watched: this tree's, and
    ``against``: the other's)."""
    trees = {"plain": HERE.parents[1], "watched": HERE.parents[1]}
    trees |= {"against": args.against} if args.against else {}
    pairs = [_pair(name, trees, args, flip=k % 2 == 1) for k in range(args.pairs)]
    refused = [p["refused"] for p in pairs if "refused" in p]
    if refused:
        return {"refused": refused[0]}
    return {mode: [p[mode] for p in pairs] for mode in trees}


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
    parser.add_argument("--record", action="store_true", help="the watch writes a run record")
    parser.add_argument("--dropout", type=float, default=0.0, help="every dropout at this")
    parser.add_argument("--child", choices=("plain", "watched"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.child:
        from gradscope.errors import GradscopeError

        with tempfile.TemporaryDirectory() as folder:
            try:
                child(args.workloads, args.child, args.warmup, Path(folder), args.record,
                      args.dropout)  # fmt: skip
            except GradscopeError as e:  # a model or loss the watch refuses
                print(json.dumps({"refused": e.what}), flush=True)
        return
    head = "| workload | plain step / faults | watched / faults | ratio (range) |"
    if args.against:
        head += " against: watched / faults | ratio (range) |"
    print(head + "\n|---|---:|---:|---:|" + ("---:|---:|" if args.against else ""))
    for name in expand(args.workloads.split(",")):
        if WORKLOADS[name].missing:
            continue
        runs = measure(name, args)
        refused = runs.get("refused")
        print(f"| {name} | | refused: {refused} | |" if refused else _row(name, runs), flush=True)


if __name__ == "__main__":
    main()
