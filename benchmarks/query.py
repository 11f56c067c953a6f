"""`gradscope query`'s streamed scoring against a plain torch matmul of the same shapes read from
the same files, and its peak memory as the index grows.

    python benchmarks/query.py --rows 1000000 --width 804 --refs 1 16 256 [--threads 1]

It writes an index folder of random unit rows (float16, the layout of gradscope/index/layout.py,
no model needed), then for each reference count R, alternating, ``--repeats`` times:

- gradscope: ``Scores(shards, psi)`` streaming the shards in chunks: every example's score for
  R = 1 (``every``), each reference's top 20 otherwise (``top``);
- plain: each shard read whole with ``np.fromfile`` into a tensor, converted to float32 and
  multiplied by the (width, R) references: the limit of reading and multiplying.

It prints the medians, the rows per second and gradscope's share of the plain speed; and, with
``--memory``, the peak RSS of a fresh process running gradscope's scoring on the first shard
and on all of them (flat in the rows: the chunk, not the index; ``--shard-mib`` sets how many
shards there are).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from memory import peak_mib

from gradscope.index import layout
from gradscope.index.manifest import SEAL, seal
from gradscope.index.reader import Shards
from gradscope.index.stream import Scores


def make_index(root: Path, rows: int, width: int) -> Path:
    """An index folder of ``rows`` random unit float16 rows, written in chunks of 64Ki rows."""
    root.mkdir()
    rng = np.random.default_rng(0)
    writer = layout.ShardWriter(root, width, np.float16)
    for lo in range(0, rows, 1 << 16):
        x = rng.standard_normal((min(1 << 16, rows - lo), width), dtype=np.float32)
        x /= np.linalg.norm(x, axis=1, keepdims=True)
        writer.add(memoryview(x.astype(np.float16)).cast("B"), len(x))
    ids = {
        "example_id": np.arange(rows),
        "loss": np.ones(rows),
        "norm": rng.uniform(0.5, 2.0, rows),
        "finite": np.ones(rows, dtype=bool),
    }
    manifest = {
        "format": layout.FORMAT,
        "version": layout.VERSION,
        "rows": rows,
        "width": width,
        "dtype": "float16",
        "header_bytes": layout.HEADER,
        "shards": writer.finish(),
        "ids": layout.IDS,
        "projection": {
            "seed": 0,
            "width": width,
            "blocks": [
                {"name": "w", "shape": [width], "split": 0, "k_out": 1, "k_in": width, "start": 0}
            ],
        },
        "gradscope": {"model_files": {}, "gradients": {}},
    }
    text = json.dumps(manifest).encode()
    pq.write_table(pa.table(ids).replace_schema_metadata({SEAL: seal(text)}), root / layout.IDS)
    (root / layout.MANIFEST).write_bytes(text)
    return root


def gradscope_scores(index: Path, psi: torch.Tensor) -> None:
    with Shards(index) as shards:
        scores = Scores(shards, psi)
        scores.every() if len(psi) == 1 else scores.top(20)


def plain_scores(index: Path, psi: torch.Tensor) -> None:
    manifest = json.loads((index / layout.MANIFEST).read_text())
    psi_t = psi.T.contiguous()
    for shard in manifest["shards"]:
        x = np.fromfile(index / shard["file"], np.float16, offset=layout.HEADER)
        torch.from_numpy(x.reshape(shard["rows"], -1)).float() @ psi_t


# gradscope's scoring of the first N shards against 16 references; run by memory.peak_mib in a
# fresh interpreter (Linux keeps a forked child's peak RSS, this process's shards included)
SCORE = """
import sys, torch
from gradscope.index.reader import Shards
from gradscope.index.stream import Scores
torch.set_num_threads(int(sys.argv[3]))
shards = Shards(sys.argv[1])
shards.manifest["shards"] = shards.manifest["shards"][: int(sys.argv[2])]
Scores(shards, torch.randn(16, shards.width)).top(20)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--width", type=int, default=804)
    parser.add_argument("--refs", type=int, nargs="+", default=[1, 16, 256])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--shard-mib", type=int, default=1024, help="shard size (MiB)")
    parser.add_argument("--memory", action="store_true", help="peak RSS over the shards")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    layout.SHARD_BYTES = args.shard_mib << 20
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        index = make_index(Path(tmp) / "ix", args.rows, args.width)
        shards = len(json.loads((index / layout.MANIFEST).read_text())["shards"])
        print(f"# {args.rows:,} rows x {args.width} float16 in {shards} shards, written in "
              f"{time.perf_counter() - start:.0f} s; torch {torch.__version__}, "
              f"{args.threads} thread(s); medians of {args.repeats}")  # fmt: skip
        print("| R | gradscope s | plain matmul s | gradscope rows/s | share of plain |")
        print("|---:|---:|---:|---:|---:|")
        for r in args.refs:
            psi = torch.randn(r, args.width)
            times: dict[str, list[float]] = {"gradscope": [], "plain": []}
            gradscope_scores(index, psi)  # warm: the page cache holds the shards for both
            for _ in range(args.repeats):
                for name, run in (("gradscope", gradscope_scores), ("plain", plain_scores)):
                    t = time.perf_counter()
                    run(index, psi)
                    times[name].append(time.perf_counter() - t)
            ours, plain = (statistics.median(times[k]) for k in ("gradscope", "plain"))
            print(f"| {r} | {ours:.2f} | {plain:.2f} | {args.rows / ours:,.0f} | "
                  f"{plain / ours:.0%} |", flush=True)  # fmt: skip
        if args.memory:
            print("\n| shards read | rows | peak RSS MiB |\n|---:|---:|---:|")
            for n in sorted({max(1, shards // 10), shards}):
                peak = peak_mib(
                    [sys.executable, "-c", SCORE, str(index), str(n), str(args.threads)]
                )
                rows = sum(s["rows"] for s in Shards(index).manifest["shards"][:n])
                print(f"| {n} | {rows:,} | {peak:.0f} |")


if __name__ == "__main__":
    main()
