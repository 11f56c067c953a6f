"""Where the flipped labels land in a scores file: counts among the top rows and the AUC.

    python examples/digits/flipped_rank.py SCORES.parquet [COLUMN:low|high ...]

``low`` ranks the most negative values first (margin, prob: the model disagrees with the label;
influence, cosine: a step on the example raises the reference loss), ``high`` the largest
(loss, grad_norm, self_influence). Without columns, every one of those the file has. Prints a
Markdown table.
"""

import sys
from pathlib import Path

import numpy as np
import pandas as pd
import torch

HERE = Path(__file__).resolve().parent
DEFAULT = ("loss:high", "prob:low", "margin:low", "grad_norm:high", "self_influence:high",
           "influence:low", "cosine:low")  # fmt: skip


def auc(scores: np.ndarray, positive: np.ndarray) -> float:
    """P(a random positive scores above a random negative), ties counted half (Mann-Whitney)."""
    ranks = pd.Series(scores).rank().to_numpy()  # average ranks for ties
    n_pos, n_neg = positive.sum(), (~positive).sum()
    return (ranks[positive].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)


def main() -> None:
    frame = pd.read_parquet(sys.argv[1])
    specs = sys.argv[2:] or [s for s in DEFAULT if s.partition(":")[0] in frame.columns]
    flipped = torch.load(HERE / "digits.pt", weights_only=True)["flipped"].numpy()
    flipped = flipped[frame["example_id"].to_numpy()]
    print(f"{len(frame)} rows, {flipped.sum()} flipped\n")
    print("| score | flipped in top 20 | flipped in top 150 | AUC |\n|---|---|---|---|")
    for spec in specs:
        column, _, direction = spec.partition(":")
        score = frame[column].to_numpy() * (-1 if direction == "low" else 1)
        order = np.argsort(-score, kind="stable")
        top = [f"{flipped[order[:k]].sum()}/{k}" for k in (20, 150)]
        print(f"| `{column}` ({direction} first) | {' | '.join(top)} | {auc(score, flipped):.4f} |")


if __name__ == "__main__":
    main()
