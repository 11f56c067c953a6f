"""One batch in, one tensor out: per-example gradient norms and influence of the tensors given."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from torch import Tensor, nn

from ..curvature import Diagonal, load_preconditioner
from ..curvature.adam import adam_denominator
from ..curvature.fitted import NONE, check_curvature, chosen, fit_exact
from ..curvature.products import KINDS
from ..engine import Engine, Forward, Influence, reference_gradients, total
from ..errors import ConfigError
from ..losses import LossFn, resolve_loss


def _as_tuple(inputs: Tensor | Sequence[Tensor]) -> tuple[Tensor, ...]:
    return (inputs,) if isinstance(inputs, Tensor) else tuple(inputs)


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
    (cross_entropy, nll, mse, l1, bce_with_logits) or a callable ``(outputs, targets) -> Tensor[B]``.
    ``include``/``exclude`` are globs over ``model.named_parameters()`` names; without
    ``include``, the parameters that require grad are scored (all of them if none does), so a
    frozen base under LoRA adapters is left out.
    The model's ``.grad`` fields, hooks and train/eval mode are left as they were. A model
    compiled with ``torch.compile`` (whole, or a module of it) runs eagerly here, as written.
    """
    engine = Engine(
        model, resolve_loss(loss), include, exclude, Forward(output=output, where="output=")
    )
    with engine:
        scores = engine.norms(_as_tuple(inputs), targets)
    return total(scores.norm_sq).sqrt()


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
    precondition: dict | str | Path | None = None,
    engine: str = "auto",
    curvature: str = "none",
    damping: float | None = None,
    solver: str = "auto",
) -> Tensor:
    """(B,) float64 ``<grad l_i, g_ref>``, g_ref the gradient of the MEAN loss over the reference.

    Positive: a gradient step on example i lowers the reference loss. ``precondition`` is an
    ``Adam``/``AdamW`` ``state_dict()`` of this model's optimizer, scores then use
    ``g_ref / (sqrt(v_hat) + eps)``; or the path of a ``gradscope factors`` file (or of a saved
    state dict), scores then use ``H^-1 g_ref`` with its K-FAC / EK-FAC curvature. ``engine`` is
    ``hooks``, ``jvp`` (forward mode, no backward) or ``auto`` (jvp, moving to hooks if an op
    lacks forward mode). ``curvature`` ``gn``, ``hessian`` or ``auto`` (``gn`` where
    its dense matrix fits) scores against
    ``(C + lambda I)^-1 g_ref`` instead, C the Gauss-Newton matrix or the Hessian of the mean
    loss over ``inputs`` (the training rows), fitted here (``solver``: ``dense``, ``cg`` or
    ``auto``), lambda ``damping`` (default: ``gradscope.defaults.DAMPING``) x C's mean
    eigenvalue. The parameters are selected as ``per_example_norms`` selects them. ``.grad``
    fields, hooks and train/eval mode are left as they were.
    """
    core = Engine(
        model, resolve_loss(loss), include, exclude, Forward(output=output, where="output=")
    )
    with core:
        refs = reference_gradients(core, [(_as_tuple(ref_inputs), ref_targets)])
        check_curvature(curvature, solver, damping, precondition)
        parameters = sum(p.param.numel() for p in core.plan.included)
        curvature, _ = chosen(curvature, solver, parameters)
        if curvature != NONE:
            if curvature not in KINDS:
                raise ConfigError(
                    f"curvature= fits gn or hessian here (K-FAC: precondition= a gradscope "
                    f"factors file), got {curvature!r}",
                    "curvature",
                )
            batch = [(_as_tuple(inputs), targets)]
            refs = fit_exact(core, lambda: batch, curvature, solver, damping).refs(refs)
        elif isinstance(precondition, str | Path):
            refs = load_preconditioner(precondition, core).refs(refs)
        elif precondition is not None:
            refs = Diagonal(adam_denominator(precondition, core, "precondition"), "adam").refs(refs)
        scores = Influence(core, refs, engine, norms=False)(_as_tuple(inputs), targets)
    return scores.inner[:, 0]
