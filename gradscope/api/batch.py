"""One batch in, one tensor out: per-example gradient norms and influence of the tensors given."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from torch import Tensor, nn

from ..curvature import Curvature, Diagonal, Factors, load_preconditioner
from ..curvature.adam import adam_denominator
from ..curvature.fitted import NONE, check_curvature, chosen, fit_exact
from ..curvature.made import check_made
from ..curvature.precondition import check_fits
from ..curvature.products import KINDS
from ..defaults import CG_TOLERANCE
from ..engine import Engine, Forward, Influence, batched, reference_gradients, total
from ..errors import ConfigError, ModelError
from ..losses import LossFn, resolve_loss
from .configured import in_api_words_of


def _as_tuple(inputs: Tensor | Sequence[Tensor]) -> tuple[Tensor, ...]:
    return (inputs,) if isinstance(inputs, Tensor) else tuple(inputs)


def _reference(
    inputs: Tensor | Sequence[Tensor], targets: Tensor
) -> tuple[tuple[Tensor, ...], Tensor]:
    """The reference batch, its inputs' and targets' examples counted alike (as a scored
    batch's are), its errors named by its own keywords."""
    inputs = _as_tuple(inputs)
    try:
        batched(inputs, targets)
    except ModelError as e:
        raise ModelError(e.what, "ref_inputs=, ref_targets=") from None
    return inputs, targets


@in_api_words_of
def per_example_norms(
    model: nn.Module,
    inputs: Tensor | Sequence[Tensor],
    targets: Tensor,
    loss: str | LossFn = "cross_entropy",
    *,
    include: Sequence[str] | None = None,
    exclude: Sequence[str] = (),
    output: str | int | None = None,
) -> Tensor:
    """(B,) L2 norm of each example's own loss gradient over the selected parameters.

    ``inputs`` is a tensor or a tuple of tensors passed to ``model(*inputs)``, each with the
    batch's examples along its first dimension, as ``targets``; ``loss`` is a name
    (cross_entropy, nll, mse, l1, bce_with_logits, causal_lm) or a callable
    ``(outputs, targets) -> Tensor[B]``.
    ``include``/``exclude`` are globs over ``model.named_parameters()`` names; without
    ``include``, the parameters that require grad are scored (all of them if none does), so a
    frozen base under LoRA adapters is left out.
    The model's ``.grad`` fields, hooks and train/eval mode are left as they were. A model
    compiled with ``torch.compile`` (whole, or a module of it) runs eagerly here, as written.

    Example:
        >>> import gradscope, torch
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
        >>> x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
        >>> gradscope.per_example_norms(model, x, y, loss="cross_entropy").shape
        torch.Size([16])
    """
    engine = Engine(
        model, resolve_loss(loss), include, exclude, Forward(output=output, where="output=")
    )
    with engine:
        scores = engine.norms(_as_tuple(inputs), targets)
    return total(scores.norm_sq).sqrt()


@in_api_words_of
def per_example_influence(
    model: nn.Module,
    inputs: Tensor | Sequence[Tensor],
    targets: Tensor,
    ref_inputs: Tensor | Sequence[Tensor],
    ref_targets: Tensor,
    loss: str | LossFn = "cross_entropy",
    *,
    include: Sequence[str] | None = None,
    exclude: Sequence[str] = (),
    output: str | int | None = None,
    precondition: dict | str | Path | Factors | None = None,
    engine: str = "auto",
    curvature: str = "none",
    damping: float | None = None,
    solver: str = "auto",
    cg_tolerance: float = CG_TOLERANCE,
) -> Tensor:
    """(B,) float64 ``<grad l_i, g_ref>``, g_ref the gradient of the MEAN loss over the reference.

    Positive: a gradient step on example i lowers the reference loss. ``precondition`` is an
    ``Adam``/``AdamW`` ``state_dict()`` of this model's optimizer, scores then use
    ``g_ref / (sqrt(v_hat) + eps)``; or the path of a ``gradscope factors`` file (or of a saved
    state dict), or the factors ``gradscope.factors`` returned, scores then use ``H^-1 g_ref``
    with its K-FAC / EK-FAC curvature. ``engine`` is
    ``hooks``, ``jvp`` (forward mode, no backward) or ``auto`` (jvp, moving to hooks if an op
    lacks forward mode; forward mode scores only batches of a shape the hooks have analysed,
    not a shape's first). ``curvature`` ``gn``, ``hessian`` or ``auto`` (``gn`` where
    its dense matrix fits) scores against
    ``(C + lambda I)^-1 g_ref`` instead, C the Gauss-Newton matrix or the Hessian of the mean
    loss over ``inputs`` (the training rows), fitted here (``solver``: ``dense``, ``cg`` or
    ``auto``; ``cg``'s stopping relative residual ``cg_tolerance``), lambda ``damping``
    (default: the curvature's entry of the dict ``gradscope.defaults.DAMPING``) x C's mean
    eigenvalue (``cg`` estimates it, by Hutchinson's trace, where ``dense`` computes it: their
    damping, and so their scores, differ by that estimate's error). The parameters are
    selected as ``per_example_norms`` selects them. ``.grad``
    fields, hooks and train/eval mode are left as they were.

    Example:
        >>> import gradscope, torch
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
        >>> x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
        >>> scores = gradscope.per_example_influence(model, x, y, x[:4], y[:4])
        >>> scores.shape, scores.dtype
        (torch.Size([16]), torch.float64)
    """
    core = Engine(
        model, resolve_loss(loss), include, exclude, Forward(output=output, where="output=")
    )
    with core:
        # the hooks' plain inner product reads a weight's reference as its factors where cheaper
        factored = engine == "hooks" and precondition is None and curvature == NONE
        refs = reference_gradients(core, [_reference(ref_inputs, ref_targets)], factored=factored)
        batch = [(_as_tuple(inputs), targets)]
        refs = _preconditioned(
            core, refs, batch, precondition, curvature, solver, damping, cg_tolerance
        )
        scores = Influence(core, refs, engine, norms=False)(_as_tuple(inputs), targets)
    return scores.inner[:, 0]


def _preconditioned(
    core: Engine,
    refs: dict[str, Tensor],
    batch: list[tuple[tuple[Tensor, ...], Tensor]],
    precondition: dict | str | Path | Factors | None,
    curvature: str,
    solver: str,
    damping: float | None,
    cg_tolerance: float,
) -> dict[str, Tensor]:
    """``refs`` through the curvature ``curvature`` fits on ``batch``, or through the
    preconditioner ``precondition`` gives; as they are with neither."""
    check_curvature(curvature, solver, damping, precondition, cg_tolerance)
    parameters = sum(p.param.numel() for p in core.plan.included)
    curvature, _ = chosen(curvature, solver, parameters)
    if curvature != NONE:
        if curvature not in KINDS:
            raise ConfigError(
                f"curvature= fits gn or hessian here (K-FAC: precondition= a gradscope "
                f"factors file), got {curvature!r}",
                "curvature",
            )
        fitted = fit_exact(core, lambda: batch, curvature, solver, damping, cg_tolerance)
        return fitted.refs(refs)
    if isinstance(precondition, str | Path):
        return load_preconditioner(precondition, core, {}).refs(refs)  # {}: this model's
    if isinstance(precondition, Factors):
        check_fits(precondition, core, "precondition")
        check_made(precondition, {}, core, "precondition")
        return Curvature(precondition).refs(refs)
    if precondition is not None:
        return Diagonal(adam_denominator(precondition, core, "precondition"), "adam").refs(refs)
    return refs
