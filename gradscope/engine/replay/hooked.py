"""The hooked calls inside a routed region (``routed.py``), on the rows it follows, which the
batch's values may pick. An ``nn.Linear``'s (a router's gate, an expert that is a module of its
own: JetMoE's router, Switch Transformers' experts): its rule would take the analysed batch's
rows, so its weight and bias are served as a routed read of one expert (``rules/routed.py``) at
its ``F.linear``, on the device, no host sync. A call whose rule reads bags (``Rule.bags``: a
packed RNN, whose rows the pack put in slots, an EmbeddingBag cut by offsets): captured as
the analysis captures it, its rule reading each bag as an example, and each bag's rows checked
to be its example's (a flag). The analysis lets such calls into a routed region
(``analysis/finder.py``: ``Entered.bags``)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ...rules.registry import find_rule
from ...rules.routed import Routed
from ..capture import spread
from ..tensors import tensors_in


class HookedCalls:
    """Uses the routed region's ``owned``, ``batch``, ``why``, ``flow``, ``session``,
    ``unfollowed`` and ``_serve``."""

    def _hooked_init(self, copy: set[int]) -> None:
        self.inside: list[nn.Linear] = []  # the hooked Linear calls under way, innermost last
        self.bagged: list[tuple[nn.Module, set[int]]] = []  # bag calls, their parameters' ids
        self.copy = copy  # ids of the modules whose captured inputs are copied

    def enter(self, module: nn.Module, args: tuple) -> None:
        """A hooked module's call inside the region: a Linear's is served by its reads, a bag
        call is captured at its end."""
        if type(module) is nn.Linear and id(module.weight) in self.owned:
            self.inside.append(module)
            return
        if not self.bagged and getattr(find_rule(module), "bags", None) is not None:
            self.bagged.append((module, {id(p) for p in module.parameters()}))
            return
        self.why = (
            self.why or f"other operations than the analysed batch's ({type(module).__name__})"
        )

    def captured(self, module: nn.Module, args: tuple, kwargs: dict, output: object) -> None:
        if self.inside and self.inside[-1] is module:
            self.inside.pop()
        elif self.bagged and self.bagged[-1][0] is module:
            self.bagged.pop()
            with torch._C.DisableTorchFunction():
                self._bags(module, args, kwargs, output)

    def _bags(self, module: nn.Module, args: tuple, kwargs: dict, output: object) -> None:
        """A bag call's end: its Call, each position's rows its bag's example (a flag)."""
        self.session.calls.setdefault(id(module), [])
        call = self.session.record(module, args, kwargs, output, id(module) in self.copy)
        if call is None:  # no gradient flows back through it
            return
        bagged = find_rule(module).bags(module, call.inputs, call.kwargs)
        if bagged is None or bagged[1] != self.batch:
            self.why = self.why or f"a call of {type(module).__name__} on bags not the examples"
            return
        rows = self._rows_at(spread(args)[0])
        if rows is not None:
            self.flow.flag(rows != bagged[0].to(rows.device))

    def _rows_at(self, x: Tensor) -> Tensor | None:
        """The rows of a read's input; None (and the region unfollowed) where not followed."""
        rows = self.flow.of(x)
        if rows is None or rows is False:
            rows = None
            self.why = self.why or f"rows the replay cannot follow ({self.flow.lost or 'none'})"
            self.unfollowed()
        return rows

    def _in_hooked(self, name: str, args: tuple, kwargs: dict) -> bool:
        """Whether the op is a hooked call's own read: the ``F.linear`` of the Linear under
        way, or any op of a bag call under way on its own parameters alone."""
        if self.bagged:
            own = self.bagged[-1][1]
            return all(id(t) in own for t in tensors_in(args, kwargs) if id(t) in self.owned)
        return self._in_linear(name, args, kwargs)

    def _hooked(self, func, args: tuple, kwargs: dict) -> Tensor:
        """A hooked call's own read: a bag call's runs as it is, its rule serves it."""
        return func(*args, **kwargs) if self.bagged else self._linear(func, args)

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

    def calls(self) -> list:
        """The bag calls captured inside the region."""
        return self.session.all_calls()
