"""The model run with other tensors in place of its parameters, and left exactly as it was.

``torch.func.functional_call`` swaps by name, once per path: where one submodule is registered
under two paths (a tied encoder block, TabNet's shared layers) the second swap saves the first's
tensor as "the original" and puts it back, so the model keeps a plain tensor where its Parameter
was, and every later call scores fewer parameters. Here each (module, attribute) that holds a
parameter is swapped once, and the Parameter object itself is put back.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

from torch import Tensor, nn


@contextlib.contextmanager
def substituted(model: nn.Module, values: Mapping[str, Tensor]) -> Iterator[None]:
    """``model`` with ``values[name]`` in place of its parameter ``name`` (a name of
    ``model.named_parameters()``) at every module that holds it; restored on exit, also after
    an exception."""
    params = dict(model.named_parameters())
    by_param = {id(params[name]): value for name, value in values.items()}
    saved: list[tuple[nn.Module, str, nn.Parameter]] = []
    try:
        for module in model.modules():  # each module once, wherever it is registered
            for attr, p in list(module._parameters.items()):
                if p is not None and id(p) in by_param:
                    saved.append((module, attr, p))
                    module._parameters[attr] = by_param[id(p)]
        yield
    finally:
        for module, attr, p in saved:
            module._parameters[attr] = p
