"""What the first batch of given shapes teaches about a model, kept for later batches and Engines.

Three questions are asked once per model and input shapes (``per_example_norms`` builds a new
Engine on every call, and each question costs about one more backward):
- which hooked modules read rows that are not the examples (the probe, for when T == B);
- whether expanding calls on rows shared by the batch leaves every loss as it was;
- whether each rule-served parameter's per-example gradients add up to autograd's batch gradient
  (the self-check: a weight also used outside its module, a module recognised wrongly).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn


@dataclass
class Findings:
    shared: weakref.WeakSet[nn.Module] | None = None  # None: not probed yet
    expand: bool | None = None  # None: not tried yet
    verified: bool = False  # the self-check has run
    failed: dict[str, str] = field(default_factory=dict)  # parameter name -> why it failed


_FINDINGS: weakref.WeakKeyDictionary[nn.Module, dict[tuple, Findings]] = weakref.WeakKeyDictionary()


def findings_for(model: nn.Module, key: tuple, inputs: tuple[Tensor, ...]) -> Findings:
    """The findings for ``model`` under the plan ``key`` and these input shapes."""
    shapes = tuple(tuple(t.shape) for t in inputs)
    return _FINDINGS.setdefault(model, {}).setdefault((key, shapes), Findings())


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
