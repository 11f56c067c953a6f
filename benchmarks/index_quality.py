"""How well the index's projected scores rank against the exact influence, as --dim grows.

    python benchmarks/index_quality.py --dims 64 256 1024 4096 16384 32768 \
        --json benchmarks/results/index-quality.json --markdown benchmarks/results/index-quality.md

On the bundled digits (1500 rows, 297 references) and LM (500 rows of up to 64 tokens, 64 clean
references) examples: the exact per-reference influence of every row (``gradscope influence
--per-ref``, the exact engine), then for each dimension an index (its build time and bytes per
example) queried with ``--per-ref``: the Spearman correlation of each reference's projected
scores with its exact ones, the recall of its exact top 20 among the projected top 20, and the
depth of each reference's exact top 20 in its projected ranking (the largest projected rank
among them). ``--exact`` with ``--candidates M`` returns the exact top 20 exactly when that
depth is at most 20 M: the share of references where it is, for several M, is what --exact
gives; at the default dimension and M, ``query --exact`` itself runs and its share is measured.
``--markdown`` renders the JSON (``--render`` renders a JSON without running).
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from gradscope.config import load_config, with_overrides
from gradscope.index.layout import read_manifest
from gradscope.index.projection import DEFAULT_DIM
from gradscope.index.query import CANDIDATES, Query, run_query
from gradscope.index.scorer import IndexScorer, index_output
from gradscope.run import score_dataset
from gradscope.scorers import InfluenceScorer

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = {
    "digits": (ROOT / "configs/digits.yaml", ROOT / "examples/digits/digits_ref.pt"),
    "lm": (ROOT / "configs/lm.yaml", ROOT / "examples/lm/clean_ref.parquet"),
}
TOP = 20
MULTIPLES = (1, 5, 10, 20, 30, 50)  # --candidates M


def ranks(x: np.ndarray) -> np.ndarray:
    return np.argsort(np.argsort(x, axis=0), axis=0).astype(np.float64)


def spearman(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per column of two (N, R) score matrices."""
    ra, rb = ranks(a), ranks(b)
    ra, rb = ra - ra.mean(0), rb - rb.mean(0)
    return (ra * rb).sum(0) / np.sqrt((ra**2).sum(0) * (rb**2).sum(0))


def matrix(frame: pd.DataFrame, score: str, rows: int) -> np.ndarray:
    """(N, R) from one row per (example, reference) pair."""
    refs = int(frame["ref_id"].max()) + 1
    out = np.full((rows, refs), np.nan)
    out[frame["example_id"].to_numpy(), frame["ref_id"].to_numpy()] = frame[score].to_numpy()
    return out


def exact_top(truth: np.ndarray) -> list[set[int]]:
    return [set(np.argsort(-truth[:, r])[:TOP].tolist()) for r in range(truth.shape[1])]


def depths(scores: np.ndarray, truth: np.ndarray) -> np.ndarray:
    """(R,) the largest projected rank (from 1) among each reference's exact top 20."""
    ranked = np.argsort(np.argsort(-scores, axis=0, kind="stable"), axis=0) + 1
    top = np.argsort(-truth, axis=0)[:TOP]  # (20, R)
    return np.take_along_axis(ranked, top, axis=0).max(0)


def measure(name: str, dims: list[int], tmp: Path) -> dict:
    config, ref = EXAMPLES[name]
    cfg = with_overrides(load_config(config), out=str(tmp / f"{name}-exact.parquet"))
    start = time.perf_counter()
    exact = pd.read_parquet(score_dataset(cfg, InfluenceScorer(ref, per_ref=True)))
    exact_s = time.perf_counter() - start
    n = int(exact["example_id"].max()) + 1
    truth = matrix(exact, "influence", n)
    tops = exact_top(truth)
    found = {"examples": n, "references": truth.shape[1], "exact_influence_s": exact_s}
    found["dims"] = []
    for dim in dims:
        out = tmp / f"{name}-{dim}.index"
        start = time.perf_counter()
        score_dataset(index_output(load_config(config), str(out)), IndexScorer(dim))
        built = time.perf_counter() - start
        manifest = read_manifest(out)
        start = time.perf_counter()
        every = pd.read_parquet(
            run_query(out, Query(str(ref), per_ref=True, top_k=n), config=config)
        )
        query_s = time.perf_counter() - start
        scores = matrix(every, "score", n)
        projected_top = [set(np.argsort(-scores[:, r])[:TOP].tolist()) for r in range(len(tops))]
        rho, depth = spearman(scores, truth), depths(scores, truth)
        found["dims"].append(
            {
                "dim": dim,
                "width": manifest["width"],
                "bytes_per_example": manifest["width"] * 2,
                "index_s": built,
                "query_s": query_s,
                "spearman_mean": float(rho.mean()),
                "spearman_min": float(rho.min()),
                "recall_top20": float(np.mean([len(p & t) / TOP for p, t in zip(projected_top, tops, strict=True)])),
                "depth_median": float(np.median(depth)),
                "depth_max": int(depth.max()),
                "exact_top20_by_candidates": {m: float(np.mean(depth <= TOP * m)) for m in MULTIPLES},
            }
        )  # fmt: skip
        if dim == DEFAULT_DIM:
            start = time.perf_counter()
            asked = Query(str(ref), per_ref=True, top_k=TOP, exact=True)
            reranked = pd.read_parquet(run_query(out, asked, config=config)).sort_values("ref_id")
            got = [set(g["example_id"]) for _, g in reranked.groupby("ref_id")]
            found["dims"][-1]["exact_query"] = {
                "candidates": CANDIDATES,
                "seconds": time.perf_counter() - start,
                "top20_equal": float(np.mean([g == t for g, t in zip(got, tops, strict=True)])),
            }
        print(name, found["dims"][-1], flush=True)
    return found


def markdown(report: dict) -> str:
    multiples = " | ".join(f"M={m}" for m in MULTIPLES)
    lines = [
        "| example | --dim | numbers per example | bytes per example (float16) | index s | "
        "Spearman (mean / min) | projected top 20: recall | --exact top 20 exact, share of "
        f"references: {multiples} |",
        "|---|---:|---:|---:|---:|---:|---:|" + "---:|" * len(MULTIPLES),
    ]
    for name, found in report["examples"].items():
        for d in found["dims"]:
            shares = " | ".join(f"{d['exact_top20_by_candidates'][str(m)]:.0%}" for m in MULTIPLES)
            lines.append(
                f"| {name} | {d['dim']} | {d['width']:,} | {d['bytes_per_example']:,} | "
                f"{d['index_s']:.1f} | {d['spearman_mean']:.3f} / {d['spearman_min']:.3f} | "
                f"{d['recall_top20']:.2f} | {shares} |"
            )
    notes = []
    for name, f in report["examples"].items():
        notes.append(
            f"- {name}: {f['examples']} examples, {f['references']} references; the exact "
            f"per-reference influence took {f['exact_influence_s']:.1f} s"
        )
        for d in f["dims"]:
            if "exact_query" in d:
                q = d["exact_query"]
                notes.append(
                    f"- {name}, `query --per-ref --exact` at --dim {d['dim']}, --candidates "
                    f"{q['candidates']}: top 20 exact for {q['top20_equal']:.0%} of references "
                    f"({q['seconds']:.0f} s)"
                )
    return "\n".join(lines + [""] + notes) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", type=int, nargs="+", default=[64, 256, 1024, 4096, 16384, 32768])
    parser.add_argument("--examples", nargs="+", default=list(EXAMPLES))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--markdown", type=Path)
    parser.add_argument("--render", type=Path, help="render this JSON to --markdown, no run")
    args = parser.parse_args()
    if args.render:
        args.markdown.write_text(markdown(json.loads(args.render.read_text())))
        return
    torch.set_num_threads(args.threads)
    report = {
        "environment": {
            "machine": platform.machine(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "threads": args.threads,
        },
        "examples": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.examples:
            report["examples"][name] = measure(name, args.dims, Path(tmp))
    report = json.loads(json.dumps(report))  # int keys as JSON has them, as --render reads
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    if args.markdown:
        args.markdown.write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
