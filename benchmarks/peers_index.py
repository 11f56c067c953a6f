"""gradscope's index beside bergson's on the bundled tiny GPT-2 and its data: build time and how
well each one's scores agree with the exact per-reference influence.

    python benchmarks/peers_index.py --bergson /path/to/venv/bin/python \
        [--json benchmarks/results/index-peers.json]

bergson (EleutherAI) lives in its own environment (PEERS.md: it pulls CUDA builds of torchvision
and torchaudio; uninstall them there). Both tools run as commands, one thread each, in turn:

- ``bergson build`` of the LM data and of the 64 clean references, its default projection (16
  per side: 256 numbers for each of the 8 Linear-like modules it tracks; no embeddings, norms
  or biases), per-example mean loss over the tokens (``--loss_reduction mean``), as gradscope's
  ``causal_lm``; on copies of the data folders, since its ``datasets.map`` writes cache files
  into a dataset's folder;
- ``gradscope index`` at ``--dim 256`` and ``gradscope query --per-ref`` against the same refs.

Agreement: per reference, the Spearman correlation of each tool's scores (bergson's inner
products and cosines of the stored rows; gradscope's projected scores) with the exact influence
of ``gradscope influence --per-ref`` (the exact engine), and the recall of the exact top 20.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd
from index_quality import TOP, matrix, spearman

ROOT = Path(__file__).resolve().parents[1]
LM = ROOT / "examples/lm"


def timed(command: list[str]) -> float:
    start = time.perf_counter()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(command, env=env, capture_output=True, text=True)
    if run.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{run.stderr[-3000:]}")
    return time.perf_counter() - start


def bergson_rows(folder: Path) -> np.ndarray:
    """(items, dims) the rows bergson stored, as its ``load_gradients`` maps them."""
    info = json.loads((folder / "info.json").read_text())
    dims = sum(info["grad_sizes"].values())
    rows = np.fromfile(folder / "gradients.bin", dtype=np.dtype(info["base_dtype"]))
    return rows.reshape(info["num_grads"], dims).astype(np.float64)


def agreement(scores: np.ndarray, truth: np.ndarray) -> dict:
    rho = spearman(scores, truth)
    recall = [
        len(set(np.argsort(-scores[:, r])[:TOP]) & set(np.argsort(-truth[:, r])[:TOP])) / TOP
        for r in range(truth.shape[1])
    ]
    return {
        "spearman_mean": float(rho.mean()),
        "spearman_min": float(rho.min()),
        "recall_top20": float(np.mean(recall)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bergson", required=True, help="the python of bergson's environment")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    gradscope = [sys.executable, "-m", "gradscope"]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        shutil.copytree(LM / "data", tmp / "data")
        from datasets import Dataset

        Dataset.from_pandas(pd.read_parquet(LM / "clean_ref.parquet")).save_to_disk(tmp / "ref")
        config, ref = ROOT / "configs/lm.yaml", str(LM / "clean_ref.parquet")
        exact_s = timed([*gradscope, "influence", str(config), "--ref", ref, "--per-ref",
                         "--out", str(tmp / "exact.parquet")])  # fmt: skip
        exact = pd.read_parquet(tmp / "exact.parquet")
        n = int(exact["example_id"].max()) + 1
        truth = matrix(exact, "influence", n)
        ours_s = timed([*gradscope, "index", str(config), "--dim", str(args.dim),
                        "--out", str(tmp / "ours")])  # fmt: skip
        query_s = timed([*gradscope, "query", str(tmp / "ours"), "--config", str(config), "--ref", ref, "--per-ref",
                         "--top-k", str(n), "--out", str(tmp / "q.parquet")])  # fmt: skip
        ours = matrix(pd.read_parquet(tmp / "q.parquet"), "score", n)
        build = [args.bergson, "-m", "bergson", "build"]
        common = ["--model", str(LM / "model"), "--tokenizer", str(LM / "tokenizer"),
                  "--projection_dim", "16", "--token_batch_size", "64",
                  "--loss_reduction", "mean"]  # fmt: skip
        theirs_s = timed([*build, str(tmp / "b-train"), "--dataset", str(tmp / "data"), *common])
        theirs_ref_s = timed([*build, str(tmp / "b-ref"), "--dataset", str(tmp / "ref"), *common])
        train, refs = bergson_rows(tmp / "b-train"), bergson_rows(tmp / "b-ref")
        unit = train / np.linalg.norm(train, axis=1, keepdims=True)
        unit_refs = refs / np.linalg.norm(refs, axis=1, keepdims=True)
        report = {
            "examples": n,
            "references": truth.shape[1],
            "threads": 1,
            "exact_influence_s": exact_s,
            "gradscope": {
                "dim": args.dim,
                "numbers_per_example": json.loads((tmp / "ours/manifest.json").read_text())["width"],
                "bytes_per_example": 2 * json.loads((tmp / "ours/manifest.json").read_text())["width"],
                "index_s": ours_s,
                "query_s": query_s,
                **agreement(ours, truth),
            },
            "bergson": {
                "version": subprocess.run([args.bergson, "-c", "import importlib.metadata as m; "
                                           "print(m.version('bergson'))"],
                                          capture_output=True, text=True).stdout.strip(),
                "projection_dim": 16,
                "numbers_per_example": train.shape[1],
                "bytes_per_example": int(train.shape[1] * 4),
                "build_s": theirs_s,
                "build_ref_s": theirs_ref_s,
                "inner": agreement(train @ refs.T, truth),
                "cosine": agreement(unit @ unit_refs.T, truth),
            },
        }  # fmt: skip
    print(json.dumps(report, indent=1))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
