"""What the watch reads off each step's output beside the losses: each example's margin and
whether it was predicted (``correct``), its predicted class and probability, for one label an
example or a class id per token."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ..losses import LossFn
from ..predictions import predictions

TOKENWISE = ("causal_lm", "cross_entropy", "nll")  # the losses of a class id per token


def token_view(
    outputs: Tensor, targets: Tensor, ignore_index: int, shift: bool
) -> dict[str, Tensor]:
    """Logits (B, T, V) and class ids (B, T), each token's (``shift``: next-token logits, the
    targets one on) -> each example's margin (the mean over its counted tokens of the target's
    logit minus the best other) and correct (the share of them predicted); NaN where none
    counts. Its prob, ``exp(-loss)``, the watch adds."""
    logits, target = (outputs[:, :-1], targets[:, 1:]) if shift else (outputs, targets)
    target = target.long()  # (B, T', V) and (B, T'), T' = T - 1 shifted
    counted = target != ignore_index
    safe = torch.where(counted, target, 0).unsqueeze(-1)  # (B, T', 1)
    mine = logits.gather(-1, safe).squeeze(-1).double()  # (B, T')
    top, at = logits.topk(2, dim=-1)  # (B, T', 2)
    best = top[..., 0].double()
    other = torch.where(at[..., 0] == safe.squeeze(-1), top[..., 1].double(), best)
    n = counted.sum(1).double()  # (B,)
    none = torch.full_like(n, float("nan"))
    hit = ((at[..., 0] == target) & counted).sum(1).double()
    margin = ((mine - other) * counted).sum(1)
    return {
        "margin": torch.where(n > 0, margin / n.clamp_min(1), none),
        "correct": torch.where(n > 0, hit / n.clamp_min(1), none),
    }


def observer(name: str | LossFn, kwargs: dict) -> Callable[[Tensor, Tensor], dict] | None:
    """What the watch reads off each step's output: pred, prob, margin and correct for one
    label per example; margin and correct over the tokens for causal_lm, and for a class id
    per token (a token classifier's, a masked LM's); else nothing."""
    ignore_index = int(kwargs.get("ignore_index", -100))
    if name == "causal_lm":
        return lambda outputs, targets: token_view(outputs, targets, ignore_index, True)
    classes = predictions(name, kwargs) if isinstance(name, str) else None
    if classes is None:
        return None

    def observe(outputs: Tensor, targets: Tensor) -> dict[str, Tensor]:
        if name in TOKENWISE and outputs.dim() == 3 and targets.shape == outputs.shape[:2]:
            return token_view(outputs, targets, ignore_index, False)
        if name != "bce_with_logits" and (outputs.dim() != 2 or targets.dim() != 1):
            return {}  # a label per position: none per example (and no float64 copy of it)
        seen = classes(outputs, targets)
        if "pred" in seen:
            nan = torch.full_like(seen["prob"], float("nan"))
            right = (seen["pred"] == targets.reshape(-1).round().long()).double()
            seen["correct"] = torch.where(seen["prob"].isnan(), nan, right)
        return seen

    return observe
