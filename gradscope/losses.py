"""Per-example losses by name: each returns one loss per example, shape (B,)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils._pytree import tree_leaves, tree_map

from .errors import ConfigError, DataError, ModelError

LossFn = Callable[[Any, Tensor], Tensor]

NAMES = ("cross_entropy", "nll", "mse", "l1", "bce_with_logits", "causal_lm")
FLOAT_IDS = "floats (an integer column with a null reads back as floats, NaN there)"


def _reduce_positions(per_position: Tensor, weight: Tensor | None, how: str) -> Tensor:
    """Reduce (B, ...) per-position losses to (B,), counting only positions with weight 1."""
    if weight is None and per_position.numel() == per_position.shape[0]:
        return per_position.reshape(-1)  # one position (a (B, 1) regression): its loss itself
    flat = per_position.flatten(1)
    if how == "sum":
        return flat.sum(1)
    if weight is None:
        return flat.mean(1)
    # mean over the positions that count (not ignore_index), as PyTorch's own "mean" does per batch
    return flat.sum(1) / weight.flatten(1).sum(1).clamp_min(1)


def transformed() -> bool:
    """Whether a torch.func transform (vmap, grad, jvp) is running: checks that look at the
    values do not run there (the same batch has run eagerly first and passed them)."""
    return torch._C._functorch.peek_interpreter_stack() is not None


def _first(values: Tensor, bad: Tensor) -> str:
    return f"{values[bad].flatten()[0].item():g}"


def counted(name: str, targets: Tensor, ignore_index: int = -100) -> Tensor:
    """(B, ...) bool: the positions an example's loss is the mean over. Class ids count where
    they are not ``ignore_index`` (causal_lm's from the second token on); every element counts
    for the other losses, and for class probabilities."""
    if name == "causal_lm":
        targets = targets[:, 1:]
    if name in ("cross_entropy", "nll", "causal_lm") and not targets.is_floating_point():
        return targets != ignore_index
    return torch.ones_like(targets, dtype=torch.bool)


def nothing_counted(name: str, kwargs: dict, targets: Tensor) -> Tensor | None:
    """(B,) where an example's loss counts no position: every target is ``ignore_index`` (for
    causal_lm every target after the first, a row of one token included). None for losses
    that count every element, and for custom ones."""
    if name not in ("cross_entropy", "nll", "causal_lm") or targets.is_floating_point():
        return None
    return ~counted(name, targets, kwargs.get("ignore_index", -100)).reshape(len(targets), -1).any(
        1
    )


def not_class_ids(targets: Tensor, classes: int, ignore_index: int) -> Tensor:
    """Where integer targets are neither a class id of ``classes`` outputs nor ``ignore_index``."""
    return (targets != ignore_index) & ((targets < 0) | (targets >= classes))


def check_classes(targets: Tensor, classes: int, ignore_index: int) -> None:
    with torch._C.DisableTorchFunction():  # a check of the data, not the model: no mode's op
        bad = not_class_ids(targets, classes, ignore_index)
        found = bool(bad.any())
    if found:
        raise ModelError(
            f"target {_first(targets, bad)} is not a class id of the model's {classes} outputs "
            f"(0 to {classes - 1}, or ignore_index {ignore_index})",
            "data.targets",
        )


def in_unit_range(targets: Tensor) -> bool:
    """Whether binary targets are all in [0, 1] (NaN aside)."""
    with torch._C.DisableTorchFunction():  # a check of the data, not the model: no mode's op
        return not bool(((targets < 0) | (targets > 1)).any())


def check_class_dim(name: str, outputs: Tensor, targets: Tensor, class_dim: int) -> None:
    """Class-id targets of (B, ...) outputs must have the outputs' shape without the class dim,
    as F.cross_entropy asks: (B, C, H, W) logits with class_dim -1 and (B, H, W) targets would
    otherwise be read as (B, C, H) rows of W classes wherever C == W."""
    if targets.is_floating_point():
        return  # class probabilities: the outputs' own shape
    dims = outputs.dim()
    without = [outputs.shape[:d] + outputs.shape[d + 1 :] for d in range(dims)]
    if targets.shape == without[class_dim % dims]:
        return
    fits = [d for d in range(1, dims) if without[d] == targets.shape]
    hint = f"; the classes are along dim {fits[0]}: set loss.class_dim: {fits[0]}" if fits else ""
    raise ConfigError(
        f"{name} with loss.class_dim {class_dim} takes targets of shape "
        f"{tuple(without[class_dim % dims])} for outputs of shape {tuple(outputs.shape)}, got "
        f"{tuple(targets.shape)}{hint}",
        "loss.class_dim",
    )


def _classification(name: str, kwargs: dict, class_dim: int, token_reduction: str) -> LossFn:
    fn = F.cross_entropy if name == "cross_entropy" else F.nll_loss
    ignore_index = kwargs.get("ignore_index", -100)

    def loss(outputs: Tensor, targets: Tensor) -> Tensor:
        if targets.is_floating_point() and targets.dim() < outputs.dim():  # not probabilities
            raise DataError(f"{name} takes class ids as integers, got {FLOAT_IDS}", "data.targets")
        if not targets.is_floating_point():
            targets = targets.long()  # class indices stored as int32 (Arrow, Parquet)
            if not transformed():
                classes = outputs.shape[-1 if outputs.dim() <= 2 else class_dim]
                check_classes(targets, classes, ignore_index)
        if outputs.dim() <= 2:
            return fn(outputs, targets, reduction="none", **kwargs)
        check_class_dim(name, outputs, targets, class_dim)
        if class_dim in (-1, outputs.dim() - 1) and not targets.is_floating_point():
            # (B*T, C) rows: the (B, C, T) view of language-model logits makes log_softmax and
            # its backward stride over the vocabulary, which doubles the time of a small LM
            flat = fn(outputs.flatten(0, -2), targets.flatten(), reduction="none", **kwargs)
            per_position = flat.view(targets.shape)  # (B, ...)
        else:
            logits = outputs.movedim(class_dim, 1)  # (B, C, ...) as F.cross_entropy wants
            if targets.is_floating_point():  # class probabilities: their classes moved too
                targets = targets.movedim(class_dim, 1)
            per_position = fn(logits, targets, reduction="none", **kwargs)  # (B, ...)
        counts = None if targets.is_floating_point() else (targets != ignore_index)
        return _reduce_positions(per_position, counts, token_reduction)

    return loss


def _causal_lm(kwargs: dict, token_reduction: str) -> LossFn:
    """Next-token cross entropy: logits at positions 0..T-2 against targets at 1..T-1."""
    cross_entropy = _classification("cross_entropy", kwargs, -1, token_reduction)

    def loss(outputs: Tensor, targets: Tensor) -> Tensor:
        if outputs.dim() != 3 or targets.shape != outputs.shape[:2]:
            raise ValueError(
                f"causal_lm takes (B, T, V) logits and (B, T) token ids, got {tuple(outputs.shape)} "
                f"and {tuple(targets.shape)}"
            )
        return cross_entropy(outputs[:, :-1], targets[:, 1:])  # (B, T-1, V), (B, T-1)

    return loss


def _elementwise(name: str, kwargs: dict, token_reduction: str) -> LossFn:
    fn = {
        "mse": F.mse_loss,
        "l1": F.l1_loss,
        "bce_with_logits": F.binary_cross_entropy_with_logits,
    }[name]

    def loss(outputs: Tensor, targets: Tensor) -> Tensor:
        if name == "bce_with_logits" and not transformed() and not in_unit_range(targets):
            raise ModelError(
                f"bce_with_logits takes targets in [0, 1] (the probability of class 1); found "
                f"{_first(targets, (targets < 0) | (targets > 1))}",
                "data.targets",
            )
        if targets.shape != outputs.shape and targets.numel() == outputs.numel():
            targets = targets.reshape(outputs.shape)  # (B,) targets for (B, 1) outputs
        per_element = fn(outputs, targets.to(outputs.dtype), reduction="none", **kwargs)
        if per_element.dim() == 1:
            return per_element
        return _reduce_positions(per_element, None, token_reduction)

    return loss


def resolve_loss(
    spec: str | LossFn,
    kwargs: dict | None = None,
    class_dim: int = -1,
    token_reduction: str = "mean",
    alone: bool = True,
) -> LossFn:
    """Turn a loss name or a callable into ``(outputs, targets) -> Tensor[B]``.

    Names: cross_entropy, nll, mse, l1, bce_with_logits, causal_lm. A callable is used as it is and must
    return one loss per example, each example's alone (checked once per shape, ``alone``: not
    where the loss only trains, which needs no example's gradient of its own).
    """
    kwargs = dict(kwargs or {})
    if callable(spec):
        fn = spec
    elif spec in ("cross_entropy", "nll"):
        fn = _classification(spec, kwargs, class_dim, token_reduction)
    elif spec == "causal_lm":
        fn = _causal_lm(kwargs, token_reduction)
    elif spec in ("mse", "l1", "bce_with_logits"):
        fn = _elementwise(spec, kwargs, token_reduction)
    else:
        raise ConfigError(
            f"unknown loss {spec!r}; expected one of {', '.join(NAMES)} or file.py:fn"
        )
    if token_reduction not in ("mean", "sum"):
        raise ConfigError(f"token_reduction must be 'mean' or 'sum', not {token_reduction!r}")
    return _checked(fn, alone=alone and callable(spec))


def _tracked(outputs: Any) -> bool:
    """Whether any tensor of the model's outputs is tracked by autograd."""
    return any(isinstance(t, Tensor) and t.requires_grad for t in tree_leaves(outputs))


def _checked(fn: LossFn, alone: bool = False) -> LossFn:
    """``fn`` with its value checked: one loss per example, attached to the outputs; a loss of
    the user's (``alone``) also once per shape against its first and last examples alone."""
    seen: set = set()

    def loss(outputs: Any, targets: Tensor) -> Tensor:
        try:
            value = fn(outputs, targets)
        except (RuntimeError, ValueError, IndexError, TypeError, KeyError, AttributeError) as e:
            raise ModelError(
                f"the loss cannot take the model's outputs: {type(e).__name__}: {e}", "loss"
            ) from e
        batch = targets.shape[0]
        if not isinstance(value, Tensor) or value.shape != (batch,):
            shape = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
            raise ModelError(
                f"the loss must return one value per example, shape ({batch},), got {shape}", "loss"
            )
        detached = torch.is_grad_enabled() and not value.requires_grad and _tracked(outputs)
        if detached and not transformed():
            raise ModelError(
                "the loss is detached from the model's outputs (.detach(), .item(), numpy?): "
                "no gradient reaches the model",
                "loss",
            )
        if alone and batch > 1:  # a loss of the user's: each shape's first batch
            shapes = (tuple(targets.shape), *(tuple(t.shape) for t in _tensors(outputs)))
            if shapes not in seen:
                _check_alone(fn, outputs, targets, value)
                if len(seen) > 1000:  # every batch a shape of its own (padded to its longest)
                    seen.clear()
                seen.add(shapes)  # once it holds: a refusal is raised again on the next call
        return value

    return loss


def _tensors(outputs: Any) -> list[Tensor]:
    return [t for t in tree_leaves(outputs) if isinstance(t, Tensor)]


def _check_alone(fn: LossFn, outputs: Any, targets: Tensor, value: Tensor) -> None:
    """A loss of the user's must give an example, its outputs and targets alone, its loss in the
    batch: one scaled by the batch's size, or averaged over the batch's tokens, gives each
    example a gradient that changes with the batch it came in, which no trace of the model
    sees. Outputs not batch-first (every tensor's dimension 0 the batch's) are not cut, nor is
    a result other than one number checked; the calls draw from a forked random state, and no
    torch function mode (the analysis's trace) sees them."""
    batch, leaves = targets.shape[0], _tensors(outputs)
    if any(t.dim() == 0 or t.shape[0] != batch for t in leaves):
        return
    devices = sorted({t.device.index for t in leaves if t.device.type == "cuda"})
    # outside any trace of the pass that called the loss (its modes would see these calls)
    with torch.no_grad(), torch.random.fork_rng(devices=devices), torch._C.DisableTorchFunction():
        for i in dict.fromkeys((0, batch - 1)):
            one = slice(i, i + 1)
            rows = tree_map(lambda t, one=one: t[one] if isinstance(t, Tensor) else t, outputs)
            try:
                got = fn(rows, targets[one])
            except Exception:  # noqa: BLE001 - a structure this cut does not fit: unchecked
                return
            if not isinstance(got, Tensor) or got.numel() != 1:
                return  # (1,) or a squeezed (); anything else: outputs cut along another dim
            if _close(got.reshape(()), value[i]):
                continue
            again = fn(outputs, targets)[i]  # a loss that draws: not the batch's fault
            why = (
                "the loss gives another value on a second call (it draws random numbers?), so "
                "an example's gradient is not defined; make the loss deterministic"
                if not _close(again, value[i])
                else "the loss mixes the examples of a batch (as l - l.mean() does, or a scale "
                "by the batch's size or tokens), so an example has no gradient of its own; "
                "return each example's own loss"
            )
            raise ModelError(
                f"example {i}'s loss is {got.item():.6g} alone and {value[i].item():.6g} in its "
                f"batch: {why}",
                "loss",
            )


def _close(a: Tensor, b: Tensor) -> bool:
    """Equal up to the rounding of ``b``'s dtype (the same row's loss, computed alone)."""
    tol = 1e-2 if b.dtype in (torch.float16, torch.bfloat16) else 1e-5
    a, b = a.detach().double(), b.detach().double()
    return bool((a - b).abs() <= tol * max(a.abs().item(), b.abs().item(), 1e-12))
