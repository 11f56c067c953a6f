"""Wall time of the commands that should start at once: `--help`, `--version` and `summary`.

    python benchmarks/startup.py [--repeats 5] [--root PATH]

Each command runs as `python -m gradscope ...` in a fresh process with the code under ``--root``
(default: this checkout) first on PYTHONPATH; the median of the repeats is printed. `summary`
reads a 1500-row scores file written here with pyarrow (the digits example's columns), so the
number is the start-up and the ranking, not a model run. None of them should import torch.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]


def scores_file(path: Path, n: int = 1500) -> Path:
    rng = np.random.default_rng(0)
    grad_norm = rng.gamma(2.0, 1.0, n)
    columns = {"example_id": np.arange(n), "loss": grad_norm / 3, "grad_norm": grad_norm,
               "target": rng.integers(0, 10, n), "pred": rng.integers(0, 10, n),
               "prob": rng.random(n), "margin": rng.normal(size=n), "finite": np.ones(n, bool)}  # fmt: skip
    pq.write_table(pa.table(columns), path)
    return path


def seconds(args: list[str], root: Path, cwd: str) -> tuple[float, float]:
    """The command's wall and CPU (user + system) time; NaN when it fails (an older checkout
    without ``--version``). CPU time varies less than wall time on a shared machine."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    command = [sys.executable, "-m", "gradscope", *args]  # -m puts cwd first: not a checkout
    done = subprocess.run(command, env=env, cwd=cwd, capture_output=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return (wall, cpu) if done.returncode == 0 else (float("nan"), float("nan"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout whose code runs")
    options = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        scores = str(scores_file(Path(folder) / "scores.parquet"))
        for args in (["--help"], ["--version"], ["summary", scores]):
            runs = [seconds(args, options.root, folder) for _ in range(options.repeats)]
            wall, cpu = zip(*runs, strict=True)
            name = " ".join(args[:1])
            if any(t != t for t in wall):  # NaN: it failed
                print(f"{name:10} fails")
                continue
            print(f"{name:10} wall median {statistics.median(wall):.2f} s (min {min(wall):.2f} s), "
                  f"cpu median {statistics.median(cpu):.2f} s")  # fmt: skip


if __name__ == "__main__":
    main()
