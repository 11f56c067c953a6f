"""LDS's Spearman, its summary and detection AUROC against brute-force definitions."""

import numpy as np
import pytest

from gradscope.validation import auroc, ranks, spearman, summarize


def brute_ranks(x: np.ndarray) -> np.ndarray:
    """Each value's rank from 1: the values below it, plus the middle of those equal to it."""
    return np.array([(x < v).sum() + ((x == v).sum() + 1) / 2 for v in x])


@pytest.mark.parametrize("ties", [False, True])
def test_ranks_and_spearman(ties):
    rng = np.random.default_rng(3)
    truth = rng.normal(size=(6, 30))
    pred = truth + rng.normal(size=(6, 30))
    if ties:
        truth, pred = truth.round(0), pred.round(0)
    for t in truth:
        assert np.array_equal(ranks(t), brute_ranks(t))
    expected = [
        np.corrcoef(brute_ranks(t), brute_ranks(p))[0, 1] for t, p in zip(truth, pred, strict=True)
    ]
    np.testing.assert_allclose(spearman(truth, pred), expected, rtol=0, atol=1e-12)
    if not ties:  # no ties: ranks are argsort of argsort
        a, b = truth.argsort(1).argsort(1), pred.argsort(1).argsort(1)
        np.testing.assert_allclose(
            spearman(truth, pred),
            [np.corrcoef(x, y)[0, 1] for x, y in zip(a, b, strict=True)],
            atol=1e-12,
        )


def test_spearman_undefined_rows():
    truth = np.array([[1.0, 2.0, 3.0], [1.0, 1.0, 1.0], [1.0, np.nan, 3.0]])
    got = spearman(truth, np.array([[3.0, 2.0, 1.0]] * 3))
    assert got[0] == pytest.approx(-1.0) and np.isnan(got[1:]).all()


def test_summarize():
    values = np.array([0.1, 0.5, np.nan, 0.3, 0.7])
    s = summarize(values)
    finite = values[np.isfinite(values)]
    assert s["references"] == 4
    assert s["lds"] == pytest.approx(finite.mean())
    assert s["lds_std"] == pytest.approx(finite.std(ddof=1))
    assert finite.min() <= s["lds_low"] < s["lds"] < s["lds_high"] <= finite.max()
    one = summarize(np.array([0.4]))
    assert one["lds"] == 0.4 and one["references"] == 1 and np.isnan(one["lds_std"])


def test_auroc_against_pairs():
    rng = np.random.default_rng(0)
    scores = rng.integers(0, 5, 40).astype(float)  # many ties
    bad = rng.random(40) < 0.3
    pairs = [1.0 if b > g else 0.5 if b == g else 0.0 for b in scores[bad] for g in scores[~bad]]
    assert auroc(scores, bad) == pytest.approx(np.mean(pairs), abs=1e-12)
    assert np.isnan(auroc(scores, np.zeros(40, bool)))
