"""Light regions: a region call (``analysis/finder.py``) whose only needs are reads of whole
parameters on rows laid out by shapes alone (one row per example, or ``Lanes``) that a
``Recipe`` serves (``recipes.py``): ``nn.MultiheadAttention``'s projections, read inside
``F.multi_head_attention_forward`` on sequence-first rows; a LayerScale's ``gamma`` broadcast
along the tokens. A replayed batch runs the call under ``LightRegion``, a torch function mode
that passes every op through but the reads of the watched parameters, which it serves by their
recipes (``reads.py``): no trace, no owners, no tap. The hooked modules called inside it (a
BEiT layer's attention and MLP around its LayerScale) are the program's steps, replayed as
outside the regions; a read of a parameter inside a call of the module whose rule serves it is the rule's.
``RootReads`` (``root.py``) serves the same way the reads at the model's top level, which no
region call holds.

The witness of a light region call: its reads in the analysed order, each the same function on
an input of the same shape with the same parameters, after as many autograd nodes since the call
began as the analysed batch made; as many nodes over the whole call; as many outputs; its hooked
calls the program's, as any step's; and each scalar it read from tensors' values on the host
(``if mask.all():``, ``lengths.max().item()``) the analysed batch's, in the same order: Python
branched as it did for the analysed batch. Any other call is ``Diverged`` and analysed in full.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from ..capture import Capture, Use, counter
from ..constants import FACTORIES, Constants, writes
from ..derived import Computed, Derived, compute
from ..hooks import ReadHooks
from ..ops import CASTS, SCALES, SHIFTS, SPREAD, VIEWS, op_name, scalar_reads
from ..parts import CONVS
from ..plan import ParamPlan, Plan
from ..recipes import ARG, OPENED, Recipe, lookup, metadata, written_out
from ..steps import Diverged
from ..tensors import tensors_in
from ..views import places
from .intercept import Intercept, Intercepting
from .owned import Owned
from .reads import RecipeReads

_SEQUENCES = (list, tuple)


class LightRegion(RecipeReads, Intercepting, TorchFunctionMode):
    """One light region call of a replayed batch: ``recipes`` its reads, ``during`` the autograd
    nodes the analysed call made; entered at once, left by ``finish`` (or ``close``). With
    ``intercept`` its reads are intercepted where it ``intercepts`` (``intercept.py``), not seen
    by its mode, and ``intercept`` is told where its witness fails."""

    def __init__(
        self,
        plan: Plan,
        recipes: Sequence[Recipe],
        during: int | None,
        batch: int,
        ruled: Callable[[ParamPlan], bool] = lambda p: False,
        buffers: frozenset[int] = frozenset(),
        constant: Sequence[Tensor] = (),
        hosts: Sequence[tuple[str, object, object]] | None = None,
        branched: Callable[[], None] = lambda: None,
        intercept: Intercept | None = None,
        owned: list | None = None,
    ):
        super().__init__()
        self.recipes, self.during, self.batch, self.ruled = tuple(recipes), during, batch, ruled
        self.params = {name: plan.find(name) for r in self.recipes for _, name in r.roles}
        self.intercept = intercept
        self.intercepts = (
            intercept is not None
            and not hosts
            and not any(r.constants for r in self.recipes)
            and self._plain()
        )
        # constants (the buffers, the arguments the analysed call began with made from them,
        # and what ops make from them), followed by the mode where a recipe reads a tensor
        # made from parameters and them: elsewhere no op need be looked at for them
        follow = not self.intercepts and any(r.computed for r in self.recipes)
        self.constants = Constants(buffers, constant) if follow else Constants()
        self.factories = FACTORIES if follow else frozenset()
        self.by_id = {id(p.param): p for p in self.params.values()}
        self.watched = set(self.by_id)  # and the tensors made from them
        # by id: the tensors made from the parameters, placed in one or computed
        self.made: dict[int, tuple[Tensor, Derived | Computed]] = {}
        self.hot = self.watched | self.constants.ids  # what an op must be looked at for
        self.session = Capture(())  # the hooked calls inside it are the replay's steps
        self.uses: list[Use] = []
        self.hooks = ReadHooks()
        self.why: str | None = None
        # the analysed call's scalar reads on the host (None: not witnessed, as at the root),
        # and whom to tell when the batch's differ
        self.hosts, self.branched, self._host_next = hosts, branched, 0
        # as torch's are now (one may have been replaced), where the call's are witnessed
        self.scalar_reads = scalar_reads() if hosts is not None else frozenset()
        self.owned = Owned(hosts, batch, owned)  # its examples' own values of the branches
        self._next, self._start, self._open = 0, counter(), True
        if self.intercepts:
            self.hold(list(self.params.values()), intercept)
        else:
            self.__enter__()

    def _plain(self) -> bool:
        """Whether its reads may be intercepted (``intercepts``, with no scalar read on the
        host to witness and no tensor read made with constants, so that every op it must see
        touches a watched parameter or a tensor made from one): each a plain Parameter, not a
        subclass of its own (a sharded one's)."""
        return all(type(p.param) is nn.Parameter for p in self.params.values())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.hosts is not None and func in self.scalar_reads:
            return self._host(func, args, kwargs)
        hot = self.hot
        for a in args:  # loops, not a generator: this runs on every op
            if id(a) in hot:
                break
            if type(a) in _SEQUENCES and any(id(t) in hot for t in a):  # torch.cat([p, t])
                break
        else:
            for a in kwargs.values():
                if id(a) in hot:
                    break
            else:
                if func in self.factories:
                    return self._constant(func, args, kwargs)
                if func in self.owned.reducing:
                    return self.owned.reduce(func, args, kwargs)
                return func(*args, **kwargs)
        if self.constants.ids and not any(id(t) in self.watched for t in tensors_in(args, kwargs)):
            return self._constant(func, args, kwargs)  # an op on constants alone
        if metadata(func) or self._aside(args, kwargs) or not torch.is_grad_enabled():
            return func(*args, **kwargs)  # a read under ``no_grad``: none, as analysed
        if func in OPENED:
            with self:  # its projections come to this mode one by one
                return OPENED[func](*args, **kwargs)
        name = op_name(func)
        run_as = written_out(name, args, kwargs, self._source)
        if run_as is not None:
            with self:  # a mask added to the scores, an affine's broadcasts: as the tap ran it
                return run_as(*args, **kwargs)
        if name == "__getitem__" and lookup(self._source(args[0]), args):  # as the tap ran it
            func, args, kwargs, name = F.embedding, (args[1], args[0]), {}, "embedding"
        recipe = self.recipes[self._next] if self._next < len(self.recipes) else None
        # p.expand(B, ...) reads p; a lookup of shared ids expanded to the batch reads W, and
        # one of B rows taken as the examples' does, whatever made them
        spread = (
            recipe is not None
            and name == recipe.op
            and (name in SPREAD or recipe.expand or recipe.assumed)
        )
        if not spread and self._pure(name, args, kwargs):
            return self._compute(func, args, kwargs)
        if recipe is not None and name == recipe.op:
            self._next += 1
            if recipe.roles[0][0].startswith(ARG):
                return self._broadcast(recipe, func, args, kwargs)
            if recipe.op in CONVS:
                return self._conv(recipe, func, args, kwargs)
            return self._read(recipe, func, args, kwargs)
        out = func(*args, **kwargs)
        if not (isinstance(out, Tensor) and id(out) in self.watched):  # W.to(its own dtype): W
            self.why = self.why or f"another read than the analysed batch's ({name})"
        return out

    def _host(self, func, args: tuple, kwargs: dict) -> object:
        """A scalar read from tensors' values on the host: the analysed call's next one."""
        out = func(*args, **kwargs)
        k, name, self._host_next = self._host_next, op_name(func), self._host_next + 1
        if k >= len(self.hosts) or self.hosts[k][:2] != (name, out):
            self.why = self.why or f"other values read on the host ({name}) than analysed"
            self.branched()
            raise Diverged(self.why)  # Python branches otherwise from here: stop at once
        self.owned.read(k, args[0] if args else None)
        return out

    def _aside(self, args: tuple, kwargs: dict) -> bool:
        """Whether the op reads a parameter inside a call of the module whose rule serves it
        (``ruled``): the rule's read, not the region's."""
        found = {id(a) for a in (*args, *kwargs.values())}
        return any(self.ruled(p) for p in self.params.values() if id(p.param) in found)

    # -- tensors made from the watched parameters ------------------------------------------

    def _constant(self, func, args: tuple, kwargs: dict) -> object:
        """An op on no watched tensor: its result followed where made from constants alone."""
        out = func(*args, **kwargs)
        constants, known = self.constants, len(self.constants.alive)
        with torch._C.DisableTorchFunction():
            constants.after(func, op_name(func), tensors_in(args, kwargs), kwargs, out)
        self.hot.update(id(t) for t in constants.alive[known:])
        return out

    def _pure(self, name: str, args: tuple, kwargs: dict) -> bool:
        """Whether the op computes from the watched tensors, numbers and constants alone,
        writing nothing: a tensor every example reads the same (``Computed.pure``)."""
        if writes(name, kwargs):
            return False
        watched, constants = self.watched, self.constants
        for t in tensors_in(args, kwargs):
            if id(t) not in watched and t not in constants:
                return False
        return True

    def _compute(self, func, args: tuple, kwargs: dict) -> object:
        """The op's result, each floating tensor of it followed as placed in a parameter (a
        view, cast, shift or scale of one, as the tap places it: ``views.py``), or else as
        ``Computed``."""
        name = op_name(func)
        d = self._source(args[0]) if args else None
        if isinstance(d, Derived) and _placeable(name, args, kwargs, self.watched):
            out = func(*args, **kwargs) if name in CASTS else None  # placed by its dtype
            where = places(name, d.place, args, kwargs, d.param.param, out)
            if where is None and out is not None:
                return out  # a cast to integers, which no gradient crosses
            if where is not None:
                out = func(*args, **kwargs) if out is None else out
                outs = out if isinstance(out, (tuple, list)) else (out,)
                for t, place in zip(outs, where, strict=True):
                    self._follow(t, Derived(d.param, place))
                return out
        output = compute(func, args, kwargs, self._source, self.batch, self.constants)
        out = func(*args, **kwargs)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        for k, t in enumerate(outs):
            if isinstance(t, Tensor) and t.requires_grad and t.is_floating_point():
                self._follow(t, output(None if isinstance(out, Tensor) else k))
        return out

    def _follow(self, t: Tensor, source: Derived | Computed) -> None:
        self.made[id(t)] = (t, source)
        self.watched.add(id(t))
        self.hot.add(id(t))

    def _source(self, t: object) -> Derived | Computed | None:
        p = self.by_id.get(id(t))
        if p is not None:
            return Derived(p)
        made = self.made.get(id(t))
        return None if made is None else made[1]

    # -- as the replay and the backward ask a region ----------------------------------------

    @property
    def running(self) -> bool:
        """Whether its mode is still on."""
        return self._open

    def close(self) -> None:
        if self._open:
            self._open = False
            if self.intercepts:
                self.release()
            else:
                self.__exit__(None, None, None)

    def finish(self, outputs: Sequence[Tensor], exit: tuple) -> str | None:
        """The call's end: why the batch is not one the analysis describes, or None."""
        why = self._why(outputs, exit)
        if why and self.intercepts:
            self.intercept.failed()
        return why

    def _why(self, outputs: Sequence[Tensor], exit: tuple) -> str | None:
        self.close()
        if self.why:
            return self.why
        if self._next != len(self.recipes):
            return "fewer reads than the analysed batch's"
        if self.hosts is not None and self._host_next != len(self.hosts):
            return "fewer values read on the host than the analysed batch's"
        if len(outputs) != len(exit) or counter() - self._start != self.during:
            return "other operations than the analysed batch's"
        return None

    def calls(self) -> list:
        return []

    def pending(self) -> Tensor | None:
        """What the replay must read on the host at the forward's end: none here."""
        return None

    def reads(self) -> list[Use]:
        return list(self.uses)

    def reading(self, on_grad: Callable | None) -> None:
        self.hooks.reading(on_grad)


def _placeable(name: str, args: tuple, kwargs: dict, watched: set[int]) -> bool:
    """Whether the tap places the op's result in the parameter its first argument reads: a
    view or cast of it, or a shift or scale of it by numbers (``analysis/tap.py``)."""
    if name in CASTS or name in VIEWS:
        others = [t for t in tensors_in(args[1:], kwargs) if id(t) in watched]
        return not others
    if name in SHIFTS | SCALES:
        return not tensors_in(args[1:], kwargs)
    return False
