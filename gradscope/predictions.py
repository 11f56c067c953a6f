"""The model's own view of each example, from the scoring forward: pred, prob and margin.

For classification losses with one label per example. ``prob`` is the model's probability of the
example's target and ``margin`` the target's logit minus the largest other logit (negative: the
model predicts another class). bce_with_logits is the two-class case with logits ``(0, z)``:
``prob = sigmoid(z)`` for target 1, ``1 - sigmoid(z)`` for target 0, and ``margin = +-z``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from .losses import in_unit_range, not_class_ids

Observe = Callable[[Tensor, Tensor], dict[str, Tensor]]
COLUMNS = ("pred", "prob", "margin")


def _one_label(outputs: Tensor, targets: Tensor) -> bool:
    return isinstance(outputs, Tensor) and outputs.dim() == 2 and targets.dim() == 1


def _classes(outputs: Tensor, targets: Tensor, log_probs: Tensor, ignore_index: int) -> dict:
    """(B, C) scores and (B,) labels -> pred, prob, margin; NaN where the target is ignored."""
    counted = targets != ignore_index
    target = torch.where(counted, targets, 0).long().unsqueeze(1)  # (B, 1)
    mine = outputs.gather(1, target).squeeze(1)  # (B,)
    others = outputs.scatter(1, target, float("-inf")).amax(1)  # (B,) the best other class
    nan = torch.full_like(mine, float("nan"))
    return {
        "pred": outputs.argmax(1),
        "prob": torch.where(counted, log_probs.gather(1, target).squeeze(1).exp(), nan),
        "margin": torch.where(counted, mine - others, nan),
    }


def _binary(outputs: Tensor, targets: Tensor) -> dict:
    """(B,) or (B, 1) logits and 0/1 (or soft) targets -> pred, prob, margin."""
    z, y = outputs.reshape(-1), targets.reshape(-1).to(outputs.dtype)  # (B,)
    sign = 2 * y - 1
    return {
        "pred": (z > 0).long(),
        # exp(-bce): the model's probability of the target, y log s + (1 - y) log (1 - s)
        "prob": (
            y * torch.nn.functional.logsigmoid(z) + (1 - y) * torch.nn.functional.logsigmoid(-z)
        ).exp(),
        "margin": sign * z,
    }


def predictions(name: str, kwargs: dict | None = None) -> Observe | None:
    """The ``observe`` callable for loss ``name``, or None when the loss has no single label.

    The callable returns ``{}`` for a batch that is not one label per example (sequence logits,
    class-probability targets, several binary labels), so those runs get no prediction columns.
    """
    ignore_index = int((kwargs or {}).get("ignore_index", -100))

    def observe(outputs: Tensor, targets: Tensor) -> dict[str, Tensor]:
        if (
            not isinstance(outputs, Tensor)
            or targets.is_floating_point()
            and name != "bce_with_logits"
        ):
            return {}
        if name == "bce_with_logits":  # targets outside [0, 1]: the loss names them
            one = outputs.numel() == len(targets) == targets.numel() and in_unit_range(targets)
            return _binary(outputs.detach().double(), targets) if one else {}
        if not _one_label(outputs, targets):  # before any copy: a language model's logits
            return {}
        scores = outputs.detach().double()
        if not_class_ids(targets, scores.shape[1], ignore_index).any():  # the loss names them
            return {}
        log_probs = scores.log_softmax(1) if name == "cross_entropy" else scores
        return _classes(scores, targets, log_probs, ignore_index)

    return observe if name in ("cross_entropy", "nll", "bce_with_logits") else None
