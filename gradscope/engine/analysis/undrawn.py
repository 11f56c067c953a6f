"""A branch check (``ways.py``) where the forward draws its dropout masks. An example run alone,
or a few of them together, cannot draw the masks the batch drew, so a watched step
(``training/watchdraws.py``) refuses such a run (``Drew``). Where it does, the check is made
again with dropout left out (``Undrawn``): the batch's forward and each example's run without
it, and drawing nothing else, must agree, the batch's reading the values it read with dropout.
A value read from what dropout drew (``if h.sum() > 0`` after a dropout) may be another value
without it: refused, as before.

This proves each example's way gives its loss in the batch where no mask is drawn; that the two
ways drop out alike, which no forward without the batch's masks can show, is the premise:
transformers' shortcut past an attention mask with nothing padded, the branch every dynamically
padded batch of a model given its mask reads, passes the same attention to the same dropout
either way."""

from __future__ import annotations

import weakref

from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from ...errors import ModelError
from ..ops import SCALAR_READS, op_name

# dropout(input, p, training, inplace) and its kinds: with dropout left out, the input as is
DROPOUTS = frozenset({"dropout", "dropout1d", "dropout2d", "dropout3d", "feature_dropout"})
DROPOUTS |= {"alpha_dropout", "feature_alpha_dropout"}
_SDPA = "scaled_dot_product_attention"  # its dropout_p: 0
_SDPA_P = 4  # dropout_p's position among its arguments


class Drew(ModelError):
    """A run of other rows than the batch's, of a forward that draws: it cannot draw the
    batch's masks (``training/watchdraws.py``)."""


class Undrawn(TorchFunctionMode):
    """Forwards run with dropout left out; ``active`` while one runs. A value read on the host
    from what a dropout would have drawn is refused: without the draw it may be another."""

    depth = 0  # how many are entered (SameDraws lets their runs draw nothing, on any rows)

    def __init__(self):
        super().__init__()
        self._drawn: weakref.WeakValueDictionary[int, Tensor] = weakref.WeakValueDictionary()

    @classmethod
    def active(cls) -> bool:
        return cls.depth > 0

    def __enter__(self):
        Undrawn.depth += 1
        return super().__enter__()

    def __exit__(self, *exc):
        Undrawn.depth -= 1
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name, kwargs = op_name(func), kwargs or {}
        if name in DROPOUTS and args and isinstance(args[0], Tensor):
            x = args[0]  # left as is: in place, or a copy, as the dropout's own result is
            out = x if _arg(args, kwargs, "inplace", 3, False) else x.clone()
            on = kwargs.get("train", _arg(args, kwargs, "training", 2, "alpha" not in name))
            drew = (bool(on) and float(_arg(args, kwargs, "p", 1, 0.5)) > 0) or self._drew(x)
        else:
            drew = any(self._drew(t) for t in tree_leaves((args, kwargs)))
            if drew and name in SCALAR_READS:
                raise ModelError(
                    "the model draws random numbers in its forward (dropout) and reads a "
                    "value drawn from them on the host, where it branches on the batch's "
                    "values: each example's way cannot be checked without the batch's "
                    "masks; watch it without that randomness",
                    "model",
                )
            if name == _SDPA and float(_arg(args, kwargs, "dropout_p", _SDPA_P, 0.0)) > 0:
                drew = True
                if "dropout_p" in kwargs:
                    kwargs = {**kwargs, "dropout_p": 0.0}
                else:
                    args = (*args[:_SDPA_P], 0.0, *args[_SDPA_P + 1 :])
            out = func(*args, **kwargs)
        if drew:
            for t in tree_leaves(out):
                if isinstance(t, Tensor):
                    self._drawn[id(t)] = t
        return out

    def _drew(self, t: object) -> bool:
        return isinstance(t, Tensor) and self._drawn.get(id(t)) is t


def _arg(args: tuple, kwargs: dict, name: str, at: int, default: object) -> object:
    """A call's argument ``name``, given by keyword or at position ``at``, else ``default``."""
    return kwargs.get(name, args[at] if len(args) > at else default)
