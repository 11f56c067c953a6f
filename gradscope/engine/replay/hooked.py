"""The ``nn.Linear`` calls inside a routed region (``routed.py``): a router's gate, an expert
that is a module of its own (JetMoE's router, Switch Transformers' experts). Its rule would take
the analysed batch's rows; here they are the rows the region follows, which the batch's values
may pick, so its weight and bias are served as a routed read of one expert (``rules/routed.py``)
at its ``F.linear``, on the device, no host sync. The analysis lets such calls into a routed
region (``analysis/finder.py``: ``linear_steps``)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ...rules.routed import Routed


class HookedLinears:
    """Uses the routed region's ``owned``, ``batch``, ``why``, ``_rows_at`` and ``_serve``."""

    def _hooked_init(self) -> None:
        self.inside: list[nn.Linear] = []  # the hooked Linear calls under way, innermost last

    def enter(self, module: nn.Module, args: tuple) -> None:
        """A hooked module's call inside the region: a Linear's is served by its reads."""
        if type(module) is nn.Linear and id(module.weight) in self.owned:
            self.inside.append(module)
            return
        self.why = (
            self.why or f"other operations than the analysed batch's ({type(module).__name__})"
        )

    def captured(self, module: nn.Module, args: tuple, kwargs: dict, output: object) -> None:
        if self.inside and self.inside[-1] is module:
            self.inside.pop()

    def _in_linear(self, name: str, args: tuple, kwargs: dict) -> bool:
        """Whether the op is the ``F.linear`` of the hooked Linear under way."""
        if not self.inside or name != "linear" or kwargs or len(args) not in (2, 3):
            return False
        if not isinstance(args[0], Tensor) or args[0].dim() < 2:
            return False
        module = self.inside[-1]
        return args[1] is module.weight and (args[2:] or (None,))[0] is module.bias

    def _linear(self, func, args: tuple) -> Tensor:
        """``F.linear(x, W, b)`` of a hooked Linear on followed rows: W and b (where selected)
        each a routed read of one expert, x's rows (N, *, in) flattened to tokens."""
        x, out = args[0], func(*args)
        bias = args[2] if len(args) > 2 else None
        weight, b = self.owned[id(args[1])], self.owned.get(id(bias))

        def routed(a: Tensor, grad: Tensor, rows: Tensor) -> dict:
            tokens = a.numel() // max(a.shape[-1], 1)  # N * (positions per row)
            own = rows.repeat_interleave(tokens // max(rows.shape[0], 1))  # (tokens,)
            a, grad = a.reshape(tokens, a.shape[-1]), grad.reshape(tokens, grad.shape[-1])
            zero = torch.zeros_like(own)
            parts = {
                weight.name: Routed(a, grad, own, zero, args[1].shape, self.batch, False, True)
            }
            if b is not None:
                ones = a.new_ones(tokens, 1)
                parts[b.name] = Routed(ones, grad, own, zero, bias.shape, self.batch, True, True)
            return parts

        params = (weight,) if b is None else (weight, b)
        return self._serve(params, x, args[1], out, routed)
