"""The optimizer a watched loop steps, read as the recipe's keys the replay retraces: PyTorch's
``SGD``, ``Adam`` or ``AdamW`` with the same settings in every param group; anything else is
one line as the watch is made."""

from __future__ import annotations

import torch

from ..errors import ConfigError

# the settings of a param group that change its step (not how it is computed: foreach, fused)
SETTINGS = ("momentum", "dampening", "nesterov", "betas", "eps", "weight_decay", "amsgrad",
            "maximize", "decoupled_weight_decay")  # fmt: skip


def read_recipe(optimizer: torch.optim.Optimizer) -> dict:
    """The recipe's optimizer keys (``optimizer``, ``momentum``, ``nesterov``, ``betas``,
    ``eps``, ``weight_decay``) read off PyTorch's ``SGD``, ``Adam`` or ``AdamW``; any other
    optimizer, settings the replay does not write out, or groups that differ: one line."""
    kind = type(optimizer)
    if kind not in (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW):
        raise ConfigError(
            f"the replay knows torch.optim's SGD, Adam and AdamW, not {kind.__name__}: its "
            "steps cannot be retraced",
            "optimizer",
        )
    first = settings(optimizer.param_groups[0])
    for group in optimizer.param_groups[1:]:
        differ = [k for k, v in settings(group).items() if first.get(k) != v]
        if differ:
            raise ConfigError(
                f"the optimizer's param groups differ in {', '.join(differ)}: the replay steps "
                "every weight alike",
                "optimizer",
            )
    unknown = [k for k in ("dampening", "amsgrad", "maximize") if first.get(k)]
    if unknown:
        raise ConfigError(f"the replay does not write out {unknown[0]}", "optimizer")
    if kind is torch.optim.SGD:
        return {"optimizer": "sgd", "momentum": first["momentum"], "nesterov": first["nesterov"],
                "weight_decay": first["weight_decay"]}  # fmt: skip
    decoupled = kind is torch.optim.AdamW or first.get("decoupled_weight_decay", False)
    return {"optimizer": "adamw" if decoupled else "adam", "betas": list(first["betas"]),
            "eps": first["eps"], "weight_decay": first["weight_decay"]}  # fmt: skip


def settings(group: dict) -> dict:
    """A param group's settings that change its step, betas as floats."""
    values = {k: group[k] for k in SETTINGS if k in group}
    return {k: [float(b) for b in v] if k == "betas" else v for k, v in values.items()}
