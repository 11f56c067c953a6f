"""Adam's preconditioner from a saved ``torch.optim.Adam``/``AdamW`` ``state_dict()``: which entry
of the state is which parameter, and ``sqrt(v_hat) + eps`` for each.

A state records parameters by number, in the order of its parameter groups. Since torch 2.6 an
optimizer built from ``model.named_parameters()`` also records each group's ``param_names``:
then entries are matched by name, whatever the groups' order. Without names, one group is matched
by position to ``model.parameters()`` (the order ``Adam(model.parameters())`` saw), every entry's
shape checked; several groups are refused, since nothing tells whether their concatenation
follows ``model.parameters()`` (a weight-decay split puts every weight before every bias), and
parameters of equal shapes matched wrongly would give wrong numbers without any error.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..errors import ModelError

Entry = tuple[dict, Any]  # (its parameter group, its key in state["state"])
POSITION = "matched by order of model.parameters(): the state has no parameter names"


def adam_denominator(state: Any, engine, where: str) -> dict[str, Tensor]:
    """{name: sqrt(v_hat) + eps} for the engine's selected parameters: v_hat = exp_avg_sq /
    (1 - beta2**step) (max_exp_avg_sq with amsgrad), betas and eps from the parameter's group."""
    if not isinstance(state, dict) or not {"state", "param_groups"} <= set(state):
        raise ModelError("not an optimizer state_dict (needs 'state' and 'param_groups')", where)
    if not isinstance(state["state"], dict) or not isinstance(state["param_groups"], list):
        raise ModelError("not an optimizer state_dict ('state' is a mapping of entries)", where)
    groups = [g for g in state["param_groups"] if isinstance(g, dict)]
    named = [(name, tuple(p.shape)) for name, p in engine.model.named_parameters()]
    if groups and all("param_names" in g for g in groups):
        entries, how = _by_name(groups, where), "matched by the state's parameter names"
    else:
        entries, how = _by_position(groups, named, state["state"], where), POSITION
    denominators = {}
    for p in engine.plan.included:
        if p.name not in entries:
            listed = ", ".join(list(entries)[:4]) + (" ..." if len(entries) > 4 else "")
            raise ModelError(
                f"the optimizer state has no entry for parameter {p.name} (it names {listed})",
                where,
            )
        group, key = entries[p.name]
        v, step, moment = _moment(state["state"].get(key), group, p.name, where)
        beta2, eps = _hyperparameters(group, where)
        if tuple(v.shape) != tuple(p.param.shape):
            raise ModelError(
                f"optimizer state for parameter {p.name} has shape {tuple(v.shape)}, the model's "
                f"is {tuple(p.param.shape)} ({how})",
                where,
            )
        v_hat = v.to(p.param.device, torch.float64) / (1 - beta2**step)
        denominator = v_hat.sqrt() + eps
        if not torch.isfinite(denominator).all():
            raise ModelError(
                f"Adam's second moment ({moment}) for parameter {p.name} holds NaN or infinite "
                "values: every score would be NaN",
                where,
            )
        if not (denominator > 0).all():  # eps 0 and entries never updated: g / 0
            raise ModelError(
                f"Adam's sqrt(v_hat) + eps is 0 for {int((denominator <= 0).sum())} entries of "
                f"parameter {p.name} (eps {eps:g}): every score would be NaN",
                where,
            )
        denominators[p.name] = denominator.to(p.param.dtype)
    return denominators


def _moment(entry: Any, group: dict, name: str, where: str) -> tuple[Tensor, float, str]:
    """(second moment, step, its key) of one entry of the state."""
    moment = "max_exp_avg_sq" if group.get("amsgrad") else "exp_avg_sq"
    if not entry and "betas" in group:  # torch keeps no state for a parameter no gradient reached
        raise ModelError(
            f"the optimizer state holds nothing for parameter {name}: the optimizer never "
            "stepped it (no gradient reached it); leave it out with params.exclude",
            where,
        )
    if not isinstance(entry, dict) or moment not in entry or "step" not in entry:
        raise ModelError(
            f"no Adam second moment ({moment}) for parameter {name}; is it an Adam/AdamW state "
            "that has taken a step?",
            where,
        )
    v = entry[moment]
    try:
        step = float(entry["step"])  # a number, or a one-element tensor
    except (TypeError, ValueError, RuntimeError):
        step = 0.0
    if not isinstance(v, Tensor) or not step >= 1:
        raise ModelError(
            f"the optimizer state's entry for parameter {name} is not an Adam second moment "
            f"after a step ({moment} a tensor, step at least 1)",
            where,
        )
    return v, step, moment


def _hyperparameters(group: dict, where: str) -> tuple[float, float]:
    """(beta2, eps) of a parameter group."""
    betas, eps = group.get("betas"), group.get("eps")
    try:
        beta2, eps = float(betas[1]), float(eps)
    except (TypeError, ValueError, IndexError, KeyError):
        raise ModelError(
            "the optimizer state's parameter group has no Adam betas and eps", where
        ) from None
    return beta2, eps


def _by_name(groups: list[dict], where: str) -> dict[str, Entry]:
    """Each named entry of the state, by the name its group records."""
    entries = {}
    for group in groups:
        names, keys = group["param_names"], group.get("params", [])
        if not isinstance(names, list) or len(names) != len(keys):
            raise ModelError(
                "the optimizer state's param_names do not list one name per parameter", where
            )
        entries |= {str(name): (group, key) for name, key in zip(names, keys, strict=True)}
    return entries


def _by_position(
    groups: list[dict], named: list[tuple[str, tuple]], states: dict, where: str
) -> dict[str, Entry]:
    """The entries of one unnamed group, by position in ``model.parameters()``; every entry
    with a second moment must have its parameter's shape, selected or not."""
    if len(groups) != 1:
        raise ModelError(
            f"the optimizer state has {len(groups)} parameter groups and no parameter names: "
            "which parameter each entry is cannot be told (groups need not follow "
            "model.parameters()); save the state of an optimizer built from "
            "model.named_parameters() (torch 2.6 and later record the names), or of one group",
            where,
        )
    keys = groups[0].get("params", [])
    if len(keys) != len(named):
        raise ModelError(
            f"optimizer state has {len(keys)} parameters, the model has {len(named)} ({POSITION})",
            where,
        )
    for (name, shape), key in zip(named, keys, strict=True):
        entry = states.get(key)
        v = entry.get("exp_avg_sq") if isinstance(entry, dict) else None
        if isinstance(v, Tensor) and tuple(v.shape) != shape:
            raise ModelError(
                f"optimizer state for parameter {name} has shape {tuple(v.shape)}, the model's "
                f"is {shape} ({POSITION})",
                where,
            )
    return {name: (groups[0], key) for (name, _), key in zip(named, keys, strict=True)}
