"""From the ground truth and the score files to the table: LDS, the removal test and detection
AUROC, one row per (score file, column)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from .metrics import auroc, spearman, summarize
from .plan import removal_refs
from .scores import RANKED, ScoreFile
from .truth import Task, Truth

SIGN = {"loss": -1.0, "margin": 1.0}  # a subset's predicted target: SIGN * sum of its scores


def _means(truth: Truth, tasks: list[Task]) -> dict[tuple, dict[str, np.ndarray]]:
    """(kind, subset, ref) -> the loss and margin (R,) of its models, averaged over the seeds."""
    found = defaultdict(list)
    for task in tasks:
        model = truth.find(task)
        found[task.kind, task.subset, task.ref].append((model.loss, model.margin))
    return {
        key: {"loss": np.mean([m[0] for m in v], 0), "margin": np.mean([m[1] for m in v], 0)}
        for key, v in found.items()
    }


@dataclass
class Datamodel:
    """The subsets as (M, N) masks and each reference's target under each, (M, R), averaged
    over the seeds."""

    masks: np.ndarray
    values: np.ndarray

    @classmethod
    def of(cls, truth: Truth, tasks: list[Task], rows: int, target: str) -> Datamodel:
        means = _means(truth, tasks)
        count = max(t.subset for t in tasks) + 1
        masks = np.zeros((count, rows), bool)
        for t in tasks:
            masks[t.subset, t.rows] = True
        values = np.stack([means["subset", m, -1][target] for m in range(count)])
        return cls(masks, values)

    def lds(self, scores: np.ndarray, target: str) -> dict[str, float]:
        """(R', N) scores -> the LDS summary: one reference per row of a per-ref file, the mean
        over REF for a file of one row."""
        predicted = SIGN[target] * scores @ self.masks.T.astype(np.float64)  # (R', M)
        truth = self.values.T if len(scores) > 1 else self.values.mean(1, keepdims=True).T
        return summarize(spearman(truth, predicted))  # truth (R', M)


def removal(
    truth: Truth, tasks: list[Task], file: ScoreFile, refs: int, target: str
) -> dict[str, float]:
    """The mean change of each reference's target with its top-K rows removed and with K random
    rows removed, against the full data (the averages over seeds); with margins, the fraction
    of references whose prediction flips (the margin's sign) in each case."""
    means = _means(truth, tasks)
    full = means["full", -1, -1]
    changes, flips = {}, {}
    for kind, name in (("removed", "top"), ("random", "random")):
        changed, flipped = [], []
        for r in removal_refs(file, refs):
            after = means[kind, -1, r]
            at = slice(None) if r < 0 else slice(r, r + 1)
            changed.append((after[target][at] - full[target][at]).mean())
            flipped.extend(np.sign(after["margin"][at]) != np.sign(full["margin"][at]))
        changes[f"removal_{name}"] = float(np.mean(changed))
        flips[f"flips_{name}"] = float(np.mean(flipped))
    return changes | (flips if np.isfinite(full["margin"]).all() else {})


def detection(files: list[ScoreFile], bad: np.ndarray) -> list[dict[str, float]]:
    """Per file, the AUROC of each column that ranks examples (its suspicious end high); a
    column another file before it holds with the same values to float rounding (the loss that
    norms and influence both write) is measured there only."""
    seen: dict[str, list[np.ndarray]] = defaultdict(list)
    found = []
    for file in files:
        found.append({})
        for column in (c for c in file.columns if c in RANKED):
            values = file.suspicion(column)
            if not any(np.allclose(values, v, rtol=1e-6, atol=0) for v in seen[column]):
                seen[column].append(values)
                found[-1][column] = auroc(values, bad)
    return found
