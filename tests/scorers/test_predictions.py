"""pred, prob and margin against a per-example computation written out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from gradscope.predictions import predictions


def by_hand(logits: list[float], target: int) -> tuple[int, float, float]:
    """argmax, softmax probability of the target, target logit minus the best other logit."""
    pred = max(range(len(logits)), key=lambda j: logits[j])
    prob = math.exp(logits[target]) / sum(math.exp(v) for v in logits)
    margin = logits[target] - max(v for j, v in enumerate(logits) if j != target)
    return pred, prob, margin


def check(observed: dict, expected: list[tuple[int, float, float]]) -> None:
    assert observed["pred"].dtype == torch.int64 and observed["prob"].dtype == torch.float64
    for i, (pred, prob, margin) in enumerate(expected):
        assert observed["pred"][i].item() == pred
        assert observed["prob"][i].item() == pytest.approx(prob, rel=1e-12)
        assert observed["margin"][i].item() == pytest.approx(margin, rel=1e-12, abs=1e-12)


def test_cross_entropy_and_nll_match_the_hand_computation():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 5, generator=g, dtype=torch.float32) * 3
    targets = torch.randint(0, 5, (7,), generator=g)
    expected = [
        by_hand(row.double().tolist(), int(t)) for row, t in zip(logits, targets, strict=True)
    ]
    check(predictions("cross_entropy")(logits, targets), expected)
    # nll takes log-probabilities: the same predictions from log_softmax(logits)
    check(predictions("nll")(logits.double().log_softmax(1), targets), expected)
    assert any(e[0] != t for e, t in zip(expected, targets.tolist(), strict=True))  # some wrong


def test_ignored_targets_have_no_prob_or_margin():
    logits = torch.tensor([[1.0, 2.0], [3.0, 0.0]])
    observed = predictions("cross_entropy", {"ignore_index": 7})(logits, torch.tensor([7, 0]))
    assert observed["pred"].tolist() == [1, 0]
    assert math.isnan(observed["prob"][0]) and math.isnan(observed["margin"][0])
    assert observed["margin"][1].item() == 3.0


def test_binary_is_the_two_class_softmax_with_logits_zero_and_z():
    z = torch.tensor([[2.0], [-0.5], [0.3], [-4.0]])
    y = torch.tensor([1.0, 1.0, 0.0, 0.0])
    expected = []
    for zi, yi in zip(z.view(-1).tolist(), y.tolist(), strict=True):
        pred, prob, margin = by_hand([0.0, zi], int(yi))
        expected.append((pred, prob, margin))
    check(predictions("bce_with_logits")(z, y), expected)
    check(predictions("bce_with_logits")(z.view(-1), y.long()), expected)


def test_no_columns_without_one_label_per_example():
    assert predictions("mse") is None and predictions("causal_lm") is None
    ce = predictions("cross_entropy")
    assert ce(torch.randn(2, 3, 4), torch.zeros(2, 3, dtype=torch.long)) == {}  # per position
    assert ce(torch.randn(2, 3), torch.rand(2, 3)) == {}  # class probabilities
    assert predictions("bce_with_logits")(torch.randn(2, 3), torch.rand(2, 3)) == {}  # 3 labels
