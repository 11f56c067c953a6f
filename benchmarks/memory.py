"""Peak memory of `gradscope norms`, `index` and `query` as the dataset grows: each size in a
fresh process, ru_maxrss.

    python benchmarks/memory.py --rows 10000 100000 1000000 [--index]

For each size it writes a Parquet file of random rows (8 float columns and a label, in row
groups of 64Ki rows, as most writers cut them) and a small MLP, then runs, each in a new process:

- `python -m gradscope norms CONFIG`: the whole command, including the outlier tables at the end,
  which read the finished scores file (so they grow with the rows: ~40 bytes a row);
- `score_dataset` alone: the streaming read, scoring and writing;
- with `--index`: `python -m gradscope index CONFIG` (the whole command: one pass writing a part
  per batch, then the shards assembled from them), and `python -m gradscope query INDEX --ref
  REF --top-k 20` against the mean gradient of 8 reference rows (the shards streamed).

It prints one row per size: peak resident memory (MiB) of each, and the wall time of each
command.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODEL = """
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 4))

    def forward(self, *columns):
        return self.body(torch.stack(columns, 1))
"""

FEATURES = [f"f{i}" for i in range(8)]

# Runs in a fresh interpreter: a child's ru_maxrss is its own peak, not the benchmark's.
PEAK = """
import resource, subprocess, sys
subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL)
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
"""

SCORE_ONLY = "import sys; from gradscope.run import score_dataset; from gradscope.config import load_config; score_dataset(load_config(sys.argv[1]))"


def make_project(root: Path, rows: int, batch_size: int) -> Path:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch
    import yaml

    (root / "model.py").write_text(MODEL)
    sys.path.insert(0, str(root))
    from model import Net  # the file written just above

    torch.save(Net().state_dict(), root / "net.pt")
    sys.path.remove(str(root))
    rng = np.random.default_rng(0)
    with pq.ParquetWriter(root / "data.parquet", _schema()) as writer:
        for lo in range(0, rows, 1 << 16):  # generated a row group at a time, as it is read
            n = min(1 << 16, rows - lo)
            columns = {f: rng.standard_normal(n, dtype=np.float32) for f in FEATURES}
            columns["y"] = rng.integers(0, 4, n)
            writer.write_table(pa.table(columns, schema=_schema()))
    ref = pa.table({f: rng.standard_normal(8, dtype=np.float32) for f in FEATURES} | {
        "y": rng.integers(0, 4, 8)}, schema=_schema())  # fmt: skip
    pq.write_table(ref, root / "ref.parquet")
    config = {
        "model": {"factory": "model.py:Net", "checkpoint": "net.pt"},
        "data": {
            "path": "data.parquet",
            "inputs": FEATURES,
            "targets": "y",
            "batch_size": batch_size,
        },
        "device": "cpu",
        "output": {"path": "scores.parquet"},
    }
    (root / "config.yaml").write_text(yaml.safe_dump(config))
    return root / "config.yaml"


def _schema():
    import pyarrow as pa

    return pa.schema([(f, pa.float32()) for f in FEATURES] + [("y", pa.int64())])


def peak_mib(command: list[str]) -> float:
    out = subprocess.run([sys.executable, "-c", PEAK, *command], capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(out.stderr)
    kib = int(out.stdout.split()[-1])  # Linux reports KiB
    return kib / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--batch-size", type=int, default=4096)
    parser.add_argument("--index", action="store_true", help="also gradscope index and query")
    args = parser.parse_args()
    print(f"# python {sys.version.split()[0]}, peak RSS of a fresh process (ru_maxrss), "
          f"batch size {args.batch_size}")  # fmt: skip
    head = "| rows | `gradscope norms` peak MiB | `score_dataset` alone peak MiB | norms wall s |"
    if args.index:
        head += " `index` peak MiB | index wall s | `query --top-k 20` peak MiB | query wall s |"
    print(head)
    print("|---:" * head.count(" |") + "|")
    for rows in args.rows:
        with tempfile.TemporaryDirectory() as tmp:
            config = make_project(Path(tmp), rows, args.batch_size)
            cli, wall = timed([sys.executable, "-m", "gradscope", "norms", str(config)])
            alone = peak_mib([sys.executable, "-c", SCORE_ONLY, str(config)])
            line = f"| {rows:,} | {cli:.0f} | {alone:.0f} | {wall:.1f} |"
            if args.index:
                gradscope = [sys.executable, "-m", "gradscope"]
                index, index_wall = timed([*gradscope, "index", str(config)])
                ref = ["--ref", str(Path(tmp) / "ref.parquet"), "--top-k", "20"]
                query, query_wall = timed(
                    [
                        *gradscope,
                        "query",
                        str(Path(tmp) / "scores.index"),
                        "--config",
                        str(config),
                        *ref,
                    ]
                )
                line += f" {index:.0f} | {index_wall:.1f} | {query:.0f} | {query_wall:.1f} |"
            print(line, flush=True)


def timed(command: list[str]) -> tuple[float, float]:
    """(peak MiB, wall seconds) of ``command`` in a fresh process."""
    start = time.perf_counter()
    peak = peak_mib(command)
    return peak, time.perf_counter() - start


if __name__ == "__main__":
    main()
