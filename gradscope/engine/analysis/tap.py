"""Parameters where functions read them: exact per-example gradients from the forward as it runs.

Every selected parameter is watched by a torch function mode while the model runs, except
inside a call of the module whose rule serves it (``HookSession``). That covers a parameter held
by a module without a rule (a Linear subclass with its own forward, a scaled embedding, a
router's weight read by ``F.linear``, a fused 3-D expert weight, a ViT's ``cls_token``, a
LayerScale ``gamma``), and a ruled one read elsewhere (a tied head, ``out_proj``):

- views of it (``W[e]``, ``W[:, :k]``, ``W.chunk(3)``, ``W.T``, ``W.float()``, ``1 + w``, ``-w``)
  are followed, each with its ``Place`` in the parameter;
- a tensor that other ops compute from watched tensors and tensors no example owns
  (``-exp(A_log)``, a weight-norm weight, a table indexed by ``arange``) is followed as
  ``Computed`` (``../derived.py``): its gradient goes back to the parameters by a batched VJP;
- the functions of ``functions.py`` on any of these are served by the layer rules' math, on
  rows traced to their examples (``trace.py``);
- in an elementwise op whose result takes it broadcast along dimension 0, it is replaced by a
  view of it expanded along that dimension (zero-stride, no copy): each row of the view is read
  by the example that owns that row of the result (row i by example i, or a window's rows by
  their example), so the gradient there, summed over the other dimensions it was broadcast
  along and over the example's rows, is that example's gradient; ``p.expand(B, ...)`` and
  ``p.repeat(B, 1, ...)`` are such views already (``broadcasts.py``);
- a function that reads one inside it is run written out (``recipes.written_out``), so that
  the read is one of the above: an attention masked by it, ``F.group_norm`` of a watched weight
  and bias (BiT's norms) as the normalisation and the two broadcast along its channels.

Any other use (an op that mixes it with the batch in a way none of these follows, rows that
mix examples) is recorded, and the parameter goes to the fallback with the op's name.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.graph import GradientEdge
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from ..capture import Use
from ..constants import Constants, writes
from ..derived import Derived, Watched, compute
from ..hooks import ReadHooks
from ..ops import CASTS, GROUPED, METADATA, SCALES, SHIFTS, VIEWS, op_name
from ..parts import CONVS
from ..plan import ParamPlan
from ..recipes import OPENED, Recipe, lookup, written_out
from ..tensors import tensors_in, tensors_of
from ..views import places
from .broadcasts import WRITTEN, BroadcastReads
from .bytensor import ByTensor
from .experts import ExpertReads
from .functions import FunctionReads
from .policy import batch_free
from .trace import RowTrace

if TYPE_CHECKING:
    from .finder import Finder

# an op with a matrix product and an addition fused, run as the two (each served where it can
# be) when it scales neither: ``baddbmm(b, x, W)`` is ``b + bmm(x, W)``
FUSED = {"baddbmm": torch.bmm, "addmm": torch.matmul}


@dataclass
class Uses:
    reads: list[Use] = field(default_factory=list)
    other: str | None = None  # the first op that used the parameter some other way


class ParamTap(FunctionReads, ExpertReads, BroadcastReads, TorchFunctionMode):
    """The mode that watches ``params`` during one forward of a batch of ``batch`` examples."""

    def __init__(
        self,
        params: Sequence[ParamPlan],
        batch: int,
        trace: RowTrace,
        ruled: Callable[[ParamPlan], bool] = lambda p: False,
        expand: bool = False,
        assume: bool = False,
    ):
        super().__init__()
        self.batch, self.trace = batch, trace
        self.ruled = ruled  # whether a parameter's reads are, for now, its module rule's
        # as HookSession's: rows shared by the batch expanded to it, and B rows computed from no
        # example taken as the examples', each while the engine's checks confirm it
        self.expand, self.assume = expand, assume
        self.expanded = self.assumed = False
        self.derived = ByTensor()
        self.constants = Constants()  # with the model's buffers (``analyse.py``): ``pure``
        for p in params:
            self.derived[p.param] = Derived(p)
        self.uses: dict[str, Uses] = {p.name: Uses() for p in params}
        self.timeline: list[Use] = []  # every read, in the order the forward made them
        self.hooks = ReadHooks()
        self.finder: Finder | None = None  # the analysis's (finder.py): told what needs it

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = op_name(func)
        if name in METADATA or (func.__name__ == "__get__" and name not in VIEWS):
            return func(*args, **kwargs)  # metadata: asked before any lookup
        if name == "__set__" and len(args) == 2 and args[0] is args[1]:
            return func(*args, **kwargs)  # p.data = p: Module.to(the dtype it has already)
        found = self._watched_in(args, kwargs)
        if not found:
            out = func(*args, **kwargs)
            self.constants.after(func, name, tensors_in(args, kwargs), kwargs, out)
            return out
        if self.finder is not None:
            self.finder.read(tensors_of((args, kwargs)))
        if func in OPENED:
            with self:  # the function's own ops come to this mode, one by one
                return OPENED[func](*args, **kwargs)
        self.trace.own += 1  # the trace below sees this code's ops: not the model's host reads
        try:
            return self._tapped(name, found, func, args, kwargs)
        finally:
            self.trace.own -= 1

    def _tapped(self, name: str, found: list, func, args: tuple, kwargs: dict) -> object:
        """A read of watched tensors: served by a rule, computed from, or one no rule follows."""
        served = self._served(name, found, func, args, kwargs)
        if served is None and self._batch_free(args, kwargs) and not writes(name, kwargs):
            served = self._computed(func, args, kwargs)
        if served is not None:
            return None if served is WRITTEN else served
        for _, d in found:  # a use no rule can follow
            self._other(d, name)
        return func(*args, **kwargs)

    def _other(self, d: Watched, what: str) -> None:
        for p in d.params:
            self.uses[p.name].other = self.uses[p.name].other or what

    def _watched_in(self, args: tuple, kwargs: dict) -> list[tuple[int | None, Watched]]:
        """(position among args, or None when nested or by keyword; what it reads), per use; none
        of a parameter whose module's rule serves its reads now (a call of that module runs)."""
        found: list = self.derived.found_in(args)
        rest = [a for a in args if isinstance(a, (list, tuple))] + list(kwargs.values())
        nested = [t for a in rest for t in (a if isinstance(a, (list, tuple)) else (a,))]
        if nested:
            found += [(None, d) for _, d in self.derived.found_in(nested)]
        return [(i, d) for i, d in found if not any(map(self.ruled, d.params))]

    def _served(self, name: str, found: list, func, args: tuple, kwargs: dict) -> object:
        """The op's result, with what it reads of the watched parameters recorded; or None."""
        if name in ("linear", "embedding", "matmul", "__matmul__", "__rmatmul__"):
            out = self._function(name, func, args, kwargs)
            if out is None and name in ("matmul", "__matmul__"):  # experts' x @ W, or W @ x
                out = self._bmm(func, args, kwargs)
                out = self._product(name, func, args, kwargs) if out is None else out
            return out
        run_as = written_out(name, args, kwargs, self._watched)
        if run_as is not None:
            with self:  # a mask added to the scores, an affine's broadcasts: where the tap sees
                return run_as(*args, **kwargs)
        if name in GROUPED:
            return self._grouped(func, args, kwargs)
        if name in FUSED and len(args) == 3 and _unscaled(kwargs):
            with self:  # the product and the addition come to this mode, one by one
                return torch.add(args[0], FUSED[name](args[1], args[2]))
        if name == "bmm":  # each matrix of x one example's, or experts' rows of many
            out = self._product(name, func, args, kwargs)
            return self._bmm(func, args, kwargs) if out is None else out
        if name == "einsum":
            return self._einsum(func, args, kwargs)
        if name in CONVS:
            return self._conv(name, func, args, kwargs)
        if len(found) != 1 or found[0][0] is None:
            return None
        i, d = found[0]
        placed = isinstance(d, Derived)
        if name == "__getitem__" and i == 0 and lookup(d, args):
            return self._function("embedding", F.embedding, (args[1], args[0]), {})
        if placed and i == 0 and (name in CASTS or name in VIEWS):
            return self._derive(name, d, func, args, kwargs)
        if (
            placed
            and name in SHIFTS | SCALES
            and not any(isinstance(a, Tensor) for a in args if a is not args[i])
        ):
            return self._derive(name, d, func, args, kwargs)
        if name == "__setitem__" and i == 2:
            return self._write(d, func, args)
        return self._broadcast(name, i, d, func, args, kwargs)

    # -- tensors computed from parameters alone ---------------------------------------------

    def _batch_free(self, args: tuple, kwargs: dict) -> bool:
        """Whether no tensor among the op's arguments but the watched ones holds anything of an
        example (the rows policy's ``batch_free``)."""
        flat, _ = tree_flatten((args, kwargs))
        others = [t for t in flat if isinstance(t, Tensor) and t not in self.derived]
        return batch_free(self.trace, others)

    def _computed(self, func, args: tuple, kwargs: dict) -> object:
        """The op's result, each floating tensor of it followed as ``Computed`` from the
        watched tensors it reads; None when its result is not tensors."""
        output = compute(func, args, kwargs, self._watched, self.batch, self.constants)
        out = func(*args, **kwargs)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        if not all(isinstance(t, Tensor) for t in outs):
            return None
        for k, t in enumerate(outs):
            if t.requires_grad and t.is_floating_point():
                self.derived[t] = output(None if isinstance(out, Tensor) else k)
        return out

    # -- views of a parameter ---------------------------------------------------------------

    def _derive(self, name: str, d: Derived, func, args: tuple, kwargs: dict) -> object:
        """The op's result placed in the parameter; None, the op not run (the autograd nodes
        the witness counts are the op's own), where it cannot be placed."""
        out = None
        if name in CASTS:  # placed by the dtype it gives
            out = func(*args, **kwargs)
        where = places(name, d.place, args, kwargs, d.param.param, out)
        if where is None:
            return out  # not run; or a cast to integers, which no gradient crosses
        if out is None:
            out = func(*args, **kwargs)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        for t, place in zip(outs, where, strict=True):
            self.derived[t] = Derived(d.param, place)
        return out

    def _watched(self, t: object) -> Watched | None:
        """What ``t`` reads of a watched parameter, unless its module's rule serves it now."""
        d = self.derived.get(t) if isinstance(t, Tensor) else None
        return None if d is None or any(map(self.ruled, d.params)) else d

    # -- the backward --------------------------------------------------------------------------

    def _use(
        self, params: tuple[ParamPlan, ...], out: Tensor, parts, recipe: Recipe | None = None
    ) -> None:
        """A read the rules serve, its gradient to arrive at ``out``; ``recipe``: how a light
        region serves it again on a later batch (``replay/light.py``), where one can."""
        with torch._C.DisableTorchFunction():  # the trace below need not see this
            edge = _edge(out)
            if edge is None:  # read where no gradient is recorded (under no_grad)
                return
            use = Use(params, edge, parts)
            self.hooks.add(out, use)
        for p in params:
            self.uses[p.name].reads.append(use)
        self.timeline.append(use)
        if self.finder is not None:
            self.finder.need("a parameter read outside its module's calls", recipe)

    def reads(self) -> list[Use]:
        """Every read the rules serve, once each."""
        return list({id(u): u for uses in self.uses.values() for u in uses.reads}.values())

    def reading(self, on_grad: Callable[[Use, Tensor], None] | None) -> None:
        """Hand each read's gradient to ``on_grad`` from now on (None: stop, drop the hooks)."""
        self.hooks.reading(on_grad)


def _edge(out: Tensor) -> GradientEdge | None:
    """Where ``out``'s gradient arrives, or None where none can: not requiring grad, or made
    under ``no_grad`` (a view taken there requires grad, but torch gives it no gradient
    function, and asking for one makes an autograd node the replay's witness would count)."""
    if not out.requires_grad or not torch.is_grad_enabled():
        return None
    try:
        return torch.autograd.graph.get_gradient_edge(out)
    except AssertionError:
        return None


def _unscaled(kwargs: dict) -> bool:
    """Whether a fused ``addmm``'s keywords are ``beta=1, alpha=1`` at most."""
    return set(kwargs) <= {"beta", "alpha"} and all(v == 1 for v in kwargs.values())
