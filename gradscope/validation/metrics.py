"""The numbers validation reports: Spearman correlation per reference (the linear datamodeling
score), its mean with a spread over references, and detection AUROC."""

from __future__ import annotations

import numpy as np

BOOTSTRAP = 1000  # resamples of the references for the interval of the mean
LEVEL = 0.95  # the interval's coverage


def ranks(values: np.ndarray) -> np.ndarray:
    """(M,) values -> (M,) ranks from 1, ties given the mean of the ranks they share."""
    _, inverse, counts = np.unique(values, return_inverse=True, return_counts=True)
    last = np.cumsum(counts)  # (U,) the highest rank of each distinct value
    return (last - (counts - 1) / 2.0)[inverse]


def spearman(truth: np.ndarray, predicted: np.ndarray) -> np.ndarray:
    """(R, M) and (R, M) -> (R,) each row's Spearman correlation over its M columns: Pearson's
    on the ranks. NaN for a row with a non-finite value or with no spread to correlate."""
    out = np.full(len(truth), np.nan)
    for r, (t, p) in enumerate(zip(truth, predicted, strict=True)):
        if not (np.isfinite(t).all() and np.isfinite(p).all()):
            continue
        a, b = ranks(t) - (len(t) + 1) / 2, ranks(p) - (len(p) + 1) / 2  # (M,) centred
        scale = np.sqrt((a @ a) * (b @ b))
        out[r] = a @ b / scale if scale > 0 else np.nan
    return out


def summarize(per_ref: np.ndarray, seed: int = 0) -> dict[str, float]:
    """Per-reference scores -> their mean, standard deviation, a bootstrap interval of the mean
    (LEVEL, resampling the references) and how many references had a score. One reference has
    no spread: NaN there."""
    values = per_ref[np.isfinite(per_ref)]
    out = {"lds": np.nan, "lds_std": np.nan, "lds_low": np.nan, "lds_high": np.nan}
    out["references"] = len(values)
    if len(values) == 0:
        return out
    out["lds"] = float(values.mean())
    if len(values) > 1:
        out["lds_std"] = float(values.std(ddof=1))
        picks = np.random.default_rng(seed).integers(0, len(values), (BOOTSTRAP, len(values)))
        means = values[picks].mean(1)  # (BOOTSTRAP,)
        tail = (1 - LEVEL) / 2
        out["lds_low"], out["lds_high"] = map(float, np.quantile(means, [tail, 1 - tail]))
    return out


def auroc(scores: np.ndarray, bad: np.ndarray) -> float:
    """The probability that a bad row outranks a good one (higher score), ties counted half: the
    Mann-Whitney U over the product of the group sizes. NaN without both kinds of rows."""
    positives, negatives = int(bad.sum()), int((~bad).sum())
    if positives == 0 or negatives == 0:
        return np.nan
    u = ranks(scores)[bad].sum() - positives * (positives + 1) / 2
    return float(u / (positives * negatives))
