"""What the passes learn about a model, kept whole for later batches and later Engines.

``per_example_norms`` builds a new Engine on every call, and a CLI run scores many batches: what
one pass decides must hold for every later one, or a later pass could serve a parameter that an
earlier one found the rules cannot (and give it a wrong number). So one ``Record`` per model and
parameter selection keeps every decision: each move to the fallback with its reason (replayed
whole by each new Engine's plan), and the modules whose captured inputs the model edits in place.
Per input shapes it also keeps what costs a pass to learn:
- whether expanding calls on rows shared by the batch leaves every loss as it was;
- whether calls on B rows computed from no example keep each row to one example;
- whether the self-check has run: each rule-served parameter's per-example gradients must add up
  to autograd's batch gradient, and two single examples must match their own backward.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn


@dataclass
class Findings:
    """What the first batch of given input shapes found."""

    expand: bool | None = None  # None: not tried yet
    deterministic: bool | None = None  # None: not compared with a second forward yet
    assume: bool = True  # False: a call taken to have one row per example had shared rows
    verified: bool = False  # the self-check has run


@dataclass
class Record:
    """Every decision about one model and parameter selection."""

    fallback: dict[str, tuple[str, bool]] = field(default_factory=dict)  # Plan.decisions
    copy: set[int] = field(default_factory=set)  # modules whose captured inputs are edited later
    shapes: dict[tuple, Findings] = field(default_factory=dict)

    def at(self, inputs: tuple[Tensor, ...]) -> Findings:
        """The findings for these input shapes."""
        return self.shapes.setdefault(tuple(tuple(t.shape) for t in inputs), Findings())


_RECORDS: weakref.WeakKeyDictionary[nn.Module, dict[tuple, Record]] = weakref.WeakKeyDictionary()


def record_for(model: nn.Module, key: tuple) -> Record:
    """The record of ``model`` under the selection ``key``, made empty on first use."""
    return _RECORDS.setdefault(model, {}).setdefault(key, Record())


def tolerance(dtype: torch.dtype) -> float:
    """The worst relative error a correct engine stays under, given rounding in ``dtype``."""
    return {torch.float64: 1e-6, torch.float32: 1e-4}.get(dtype, 1e-2)


def agrees(ours: Tensor, theirs: Tensor, total: float = 0.0) -> bool:
    """Equal up to rounding in ``theirs``' dtype: every element within a small share of the
    larger of the two norms, or of ``total``, the norm of the whole model's batch gradient.

    The second scale is for gradients that are zero but for rounding (the key bias of an
    attention layer, which softmax cancels): their rounding is relative to the terms summed,
    not to the near-zero result. An error below it is below what ``gradscope check`` resolves.
    """
    tol = tolerance(theirs.dtype)
    ours, theirs = ours.double(), theirs.to(ours.device).double()
    own = max(ours.nan_to_num(0).norm().item(), theirs.nan_to_num(0).norm().item())
    atol = max(10 * tol * own, tol * total, 1e-30)
    return torch.allclose(ours, theirs, rtol=0, atol=atol, equal_nan=True)
