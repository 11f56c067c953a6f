"""How far the halves truth is from the question a score of the one recorded run answers: each
half of the halves truth retrained in the recorded run's own batches, order and seed (the other
half weighted 0), its references' losses correlated with the halves truth's (each half trained
alone under ``--seeds`` seeds, the losses averaged, as ``gradscope validate`` builds it).

    PYTHONPATH=. python benchmarks/attribution/halves_ceiling.py lm --subsets 60 --seeds 2 \\
        [--scores benchmarks/attribution/runs/lm/through-training.parquet]

That correlation (Spearman over the halves, per reference, the mean over references: an LDS)
is what a scorer that knew the recorded run's every counterfactual exactly would reach on the
halves; also printed, the LDS between two seeds' halves trained alone (how well one seed's
models predict another's). With ``--scores`` (a per-reference file of ``influence``), its LDS
on both: on the halves truth, and on the recorded run's own halves (how far its first order
carries to removing half the rows).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from suite import SETTINGS  # noqa: E402

from gradscope.config import load_config  # noqa: E402
from gradscope.training.loop import fit  # noqa: E402
from gradscope.validation.metrics import spearman  # noqa: E402
from gradscope.validation.plan import seeds  # noqa: E402
from gradscope.validation.retrain import evaluate, task_rows  # noqa: E402
from gradscope.validation.truth import subsets  # noqa: E402


def lds(truth: np.ndarray, predicted: np.ndarray) -> float:
    """(M, R) and (M, R) -> the mean over references of the Spearman correlation over M."""
    return float(np.nanmean(spearman(truth.T, predicted.T)))


def summed(scores: Path, halves: list[np.ndarray]) -> np.ndarray:
    """(M, R) each half's predicted loss: minus the sum of its rows' per-reference scores."""
    frame = pd.read_parquet(scores, columns=["example_id", "ref_id", "influence"])
    matrix = frame.pivot(index="example_id", columns="ref_id", values="influence").to_numpy()
    return np.array([-matrix[kept].sum(0) for kept in halves])  # (M, R)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("setting", choices=list(SETTINGS))
    parser.add_argument("--subsets", type=int, default=60)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--scores", type=Path, help="a per-reference influence file to place")
    args = parser.parse_args()
    torch.set_num_threads(1)
    bench = SETTINGS[args.setting]
    cfg = load_config(bench.config)
    n, ref = task_rows(cfg), str(bench.ref)
    start = time.process_time()
    alone, same = [], []  # (M, seeds, R), (M, R)
    halves = subsets(cfg.train.seed, n, 0.5, args.subsets)
    for kept in halves:
        alone.append([evaluate(cfg, fit(cfg, kept, seed=s), ref)[0]
                      for s in seeds(cfg.train.seed, args.seeds)])  # fmt: skip
        weights = np.zeros(n)
        weights[kept] = 1.0
        same.append(evaluate(cfg, fit(cfg, weights=weights), ref)[0])
    alone, same = np.array(alone), np.array(same)
    print(f"{args.setting}: {args.subsets} halves x {args.seeds} seeds, "
          f"{time.process_time() - start:.0f} s CPU")  # fmt: skip
    print(f"  LDS of the recorded run's own retrains on the halves truth: "
          f"{lds(alone.mean(1), same):.3f}")  # fmt: skip
    for s in range(args.seeds):
        print(f"  LDS of the recorded run's own retrains on seed {s}'s halves alone: "
              f"{lds(alone[:, s], same):.3f}")  # fmt: skip
    if args.seeds > 1:
        print(f"  LDS between seed 0's and seed 1's halves: {lds(alone[:, 0], alone[:, 1]):.3f}")
    if args.scores:
        predicted = summed(args.scores, halves)
        print(f"  LDS of {args.scores.name}: {lds(alone.mean(1), predicted):.3f} on the halves "
              f"truth, {lds(same, predicted):.3f} on the recorded run's own halves")  # fmt: skip


if __name__ == "__main__":
    main()
