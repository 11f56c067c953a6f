"""Module capture: each call of the hooked modules, its inputs, arguments and where its output's
gradient arrives. The analysis (``analysis/session.py``) and the replay (``replay/session.py``)
capture calls alike and differ only in how they decide what a call's rows are; both hand each
call's output gradient on as it arrives in the one backward (``backward/backward.py``). All state
lives in the session; on exit, even after an exception, its hooks are removed, or the Engine's
(``hooks.ModuleHooks``) given back."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge
from torch.nn.utils.rnn import PackedSequence

from .hooks import GradHooks, ModuleHooks, positional_names
from .rows import Layout

if TYPE_CHECKING:
    from ..rules import Contribution
    from .plan import ParamPlan


@dataclass(eq=False)
class Use:
    """One read of parameters that the rules serve outside their modules' calls (the tap's, a
    light region's): where its output's gradient arrives, and what it gives then."""

    params: tuple[ParamPlan, ...]
    edge: GradientEdge
    parts: Callable[[Tensor], dict[str, Contribution]]  # output gradient -> {name: part}
    reached: bool = False  # its gradient arrived in the backward
    requested: bool = False  # the backward requests its gradient: nothing below needs it


@dataclass(eq=False, slots=True)
class Call:
    """One forward call of a module: its inputs, arguments and where its (first) output's gradient
    arrives. The output itself is not kept: the model may free it, and edit it in place, freely
    (a hook or edge taken before an in-place edit still sees the gradient of the unedited value)."""

    module: nn.Module
    inputs: tuple[Tensor, ...]  # the leading positional tensors
    edge: GradientEdge  # of the output (or its base): the step of the backward that receives it
    shape: torch.Size  # of the output
    versions: tuple[int, ...]  # of the inputs when captured: later in-place edits show up
    kwargs: dict[str, object] = field(default_factory=dict)  # every other argument, by name
    owners: tuple[Tensor, ...] = ()  # of the inputs, in the analysis: which example each is
    others: tuple[GradientEdge, ...] = ()  # further outputs with gradient (attention weights)
    expanded: bool = False  # its leading input was shared by the batch and expanded to it
    rows: Layout | None = None  # a row-by-row call's rows, where not one row per example
    reached: bool = False  # its output's gradient arrived in the backward
    others_reach_loss: bool = False  # a further output reached the loss: no rule sees that path
    viewed: Callable[[Tensor], Tensor] | None = None  # the output's gradient from its base's

    def release(self) -> None:
        """Drop the captured tensors once the rule has read them."""
        self.inputs, self.kwargs, self.owners = (), {}, ()

    @property
    def edited(self) -> bool:
        """Whether a captured input was changed in place after capture."""
        return versions(self.inputs) != self.versions


def counter() -> int:
    """Autograd's sequence counter: how many nodes this thread has made. A replay's witness of
    the differentiable ops run between two of its events, at the cost of one number each."""
    return torch._C._autograd._get_sequence_nr()


def shapes_of(args: tuple) -> tuple:
    """(shape, dtype) of each tensor argument, and None for any other: a call's witness, taken
    on every hooked call (most take one tensor: no generator for those)."""
    if len(args) == 1 and isinstance(args[0], Tensor):
        return ((args[0].shape, args[0].dtype),)
    return tuple([(a.shape, a.dtype) if isinstance(a, Tensor) else None for a in spread(args)])


def spread(args: tuple) -> tuple:
    """A call's arguments with a ``PackedSequence`` first (an RNN's) spread into its four
    tensors: data, batch sizes, and the sorting's indices (``arange`` where it came sorted),
    which say the example of each row of data."""
    if not args or not isinstance(args[0], PackedSequence):
        return args
    data, sizes, order, inverse = args[0]
    if order is None:
        order = inverse = torch.arange(int(sizes[0]) if len(sizes) else 0, device=data.device)
    return (data, sizes, order, inverse, *args[1:])


def versions(inputs: tuple[Tensor, ...]) -> tuple[int, ...]:
    """The version counters of a call's captured inputs: an in-place edit bumps them."""
    if len(inputs) == 1:
        return (inputs[0]._version,)
    return tuple([t._version for t in inputs])


def leading(args: tuple) -> int:
    """How many of a call's positional arguments are its leading tensors."""
    return next((i for i, a in enumerate(args) if not isinstance(a, Tensor)), len(args))


def edge(t: Tensor) -> GradientEdge:
    """Where ``t``'s gradient arrives: ``get_gradient_edge`` without its checks, for the
    outputs of calls (never a leaf: a leaf's edge is its gradient's accumulator)."""
    node = t.grad_fn
    if node is None:
        return torch.autograd.graph.get_gradient_edge(t)
    return GradientEdge(node, t.output_nr)


def first_output(output: object) -> tuple[object, tuple]:
    """A call's output the rule sees, and the rest: a module returning (output, extras)
    (MultiheadAttention's attention weights) has its extras watched for a path to the loss."""
    if isinstance(output, tuple) and output and isinstance(output[0], Tensor):
        return output[0], output[1:]
    if isinstance(output, tuple) and output and isinstance(output[0], PackedSequence):
        return output[0].data, output[1:]  # an RNN's on a packed sequence: its rows of data
    return output, ()


def read_at(
    out: Tensor, inputs: Sequence[object]
) -> tuple[Tensor, Callable[[Tensor], Tensor] | None]:
    """The tensor whose gradient gives ``out``'s, and how (None: as it is). ``out`` itself;
    or, where ``out`` is a view of a tensor the call made (a float64 Linear's (B, T, out) view
    of its (B*T, out) product, einsum's permuted product), that tensor, its gradient viewed as
    ``out``: an in-place edit of a view of it later (``h += e``, ``x[..., :n] *= m``) takes the
    view's own node out of the backward, not its base's. Not where the base is one of the
    call's inputs (a view of what was passed in: its gradient holds other uses too)."""
    base = out._base
    if (
        base is None
        or not base.is_contiguous()
        or any(t is base or getattr(t, "_base", None) is base for t in inputs)
    ):
        return out, None
    size, stride = out.size(), out.stride()
    offset = out.storage_offset() - base.storage_offset()
    # as_strided's offset counts from the storage's start: the gradient may begin past it (a
    # slice of a concatenation's gradient, ``torch.cat([cls, h], 1)`` at batch 1)
    return base, lambda grad: (g := grad.contiguous()).as_strided(
        size, stride, g.storage_offset() + offset
    )


class Capture:
    """Context manager that hooks ``modules`` for one forward: ``_enter`` runs before each call
    (it may replace the call's arguments), ``_captured`` after it; ``record`` makes the Call and
    hooks its output, whose gradient goes to ``on_grad`` while the backward runs. ``hooks``:
    the Engine's, borrowed where they hook these modules, instead of hooking them anew."""

    def __init__(self, modules: Iterable[nn.Module], hooks: ModuleHooks | None = None):
        self.modules = list(modules)
        self.calls: dict[int, list[Call]] = {id(m): [] for m in self.modules}
        self.on_grad: Callable[[Call, Tensor], Tensor | None] | None = None
        self.hooks = hooks
        self._own = False  # ``hooks`` made for this capture alone: closed on exit
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._grad_hooks = GradHooks()  # live until the backward
        self.coarsest: torch.dtype | None = None  # a call's output in bfloat16 or float16

    def __enter__(self) -> Capture:
        if self.hooks is None or not self.hooks.lend(self):
            self.hooks, self._own = ModuleHooks(), True  # hooked anew, as the Engine's hook
            self.hooks.open(self.modules)
            self.hooks.lend(self)
        return self

    def __exit__(self, *exc) -> None:
        if self.hooks is not None and self.hooks.session is self:
            self.hooks.session = None
        if self._own:
            self.hooks.close()
            self._own = False
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _enter(self, module: nn.Module, args: tuple) -> tuple | None:
        raise NotImplementedError

    def _captured(self, module: nn.Module, args: tuple, kwargs: dict, output: object) -> None:
        raise NotImplementedError

    def record(
        self, module: nn.Module, args: tuple, kwargs: dict, output: object, copy: bool, **more
    ) -> Call | None:
        """The Call of one finished call (``more``: its Call fields the session decided), or
        None where no gradient flows back through it. ``copy``: the inputs are cloned, for a
        model that edits them in place after the call has read them."""
        output, rest = first_output(output)
        if isinstance(output, Tensor) and output.dtype in (torch.bfloat16, torch.float16):
            self.coarsest = output.dtype  # autocast's, or the model's own
        if not isinstance(output, Tensor) or not output.requires_grad:
            return None
        named: dict[str, object] = {}
        if len(args) == 1 and not kwargs and not copy and isinstance(args[0], Tensor):
            inputs = (args[0].detach(),)  # most calls: one input, nothing else
        else:
            args, inputs, named = _kept(module, args, kwargs, copy)
        target, viewed = read_at(output, (*args, *kwargs.values()))
        call = Call(
            module,
            inputs,
            edge(target),
            output.shape,
            versions(inputs),
            kwargs=named,
            others=tuple(edge(t) for t in rest if isinstance(t, Tensor) and t.requires_grad)
            if rest
            else (),
            viewed=viewed,
            **more,
        )
        self.calls[id(module)].append(call)
        self._grad_hooks.add(target, functools.partial(self._read, call))
        return call

    def _read(self, call: Call, grad: Tensor) -> Tensor | None:
        """The hook on each captured output: hands its gradient on during the backward."""
        return None if self.on_grad is None else self.on_grad(call, grad)

    def release_hooks(self) -> None:
        """Drop the hooks on the captured outputs (the backward is over)."""
        self._grad_hooks.clear()

    def all_calls(self) -> list[Call]:
        return [c for cs in self.calls.values() for c in cs]

    def edited_in_place(self) -> set[int]:
        """Modules whose captured tensors were changed in place after capture."""
        return {id(call.module) for call in self.all_calls() if call.edited}


def _kept(module: nn.Module, args: tuple, kwargs: dict, copy: bool) -> tuple[tuple, tuple, dict]:
    """A call's arguments (a packed sequence spread), its leading tensors detached (cloned
    where ``copy``), and every other argument by name, its tensors alike."""
    detached: dict[int, Tensor] = {}  # one per distinct argument: `query is key` still holds

    def keep(t: Tensor) -> Tensor:
        if id(t) not in detached:
            detached[id(t)] = t.detach().clone() if copy else t.detach()
        return detached[id(t)]

    whole = spread(args)
    extra, args = len(whole) - len(args), whole  # a packed sequence's tensors: 3 more
    n = leading(args)
    inputs, named = tuple(keep(a) for a in args[:n]), {}
    if n < len(args) or kwargs:
        # positional arguments after the leading tensors, named as the forward names them
        names = positional_names(type(module))[n - extra :]
        named = {**dict(zip(names, args[n:], strict=False)), **kwargs}
        named = {k: keep(v) if isinstance(v, Tensor) else v for k, v in named.items()}
    return args, inputs, named


@dataclass
class Captured:
    """What the forward of one batch recorded, replayed or analysed (``analysis.analyse.Analysed``
    adds what the analysis found)."""

    session: Capture  # the calls of the rule-served modules
    tap: Any  # the reads of watched parameters (analysis/tap.ParamTap), when any are watched
    losses: Tensor  # (B,), graph kept
    observed: dict[str, Tensor]
