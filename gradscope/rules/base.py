"""Per-example gradients in factored form, and the registry of layer rules that produce them.

A rule is a pure function ``(module, inputs, grad_output, **kwargs) -> {param_name: Contribution}``
for one call of one module: ``inputs`` are the call's leading positional tensors, ``kwargs`` its
other arguments by name. A Contribution holds one parameter's per-example gradient without forming
it where the layer's structure allows, and answers three questions about it: its squared norm, its
inner product with reference tensors, and (only when nothing cheaper exists) the gradient itself.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from .projection import Projection

# Bound on the elements of one temporary (Gram block, materialised chunk): 2**24 floats = 64 MiB.
CHUNK_ELEMENTS = 1 << 24
# Long sums of products run in blocks of this many terms whose partial sums then add up: the
# CPU's float32 kernels for a norm or a dot product over a long row (``vector_norm``, a matrix
# product's inner dimension) accumulate with an error that grows with its length, 3e-6 relative
# over 200k elements and 2e-4 over 2M, where the loop's gradients are within 1e-7; a block's sum
# stays at float32's rounding, and the blocks' add by a cascade.
BLOCK = 1024


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Half precision models accumulate norms and inner products in float32."""
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def _acc(t: Tensor) -> Tensor:
    # no ``.to`` where the dtype already accumulates: a call per tensor of every rule's parts
    return t if t.dtype in (torch.float32, torch.float64) else t.to(torch.float32)


def rows(t: Tensor) -> Tensor:
    """(B, *shape) -> (B, P): one row per example, also for a parameter of shape ()."""
    return t.reshape(t.shape[0], -1)


def _sq_norm(t: Tensor) -> Tensor:
    """Squared L2 norm over the last dim: fused reductions, no squared copy of ``t`` in memory,
    in ``BLOCK``s where the dim is longer."""
    n = t.shape[-1]
    if n <= BLOCK:
        return torch.linalg.vector_norm(t, dim=-1).square()
    k = n // BLOCK
    head = t[..., : k * BLOCK].unflatten(-1, (k, BLOCK))  # (..., k, BLOCK), a view
    total = torch.linalg.vector_norm(head, dim=-1).square().sum(-1)
    if n % BLOCK:
        total = total + torch.linalg.vector_norm(t[..., k * BLOCK :], dim=-1).square()
    return total


def _dots(x: Tensor, r: Tensor) -> Tensor:
    """(..., B, K) inner products of the rows of ``x`` (..., B, P) with those of ``r``
    (..., K, P), in ``BLOCK``s of P where it is longer."""
    p = x.shape[-1]
    if p <= BLOCK:
        return x @ r.mT  # (..., B, P) @ (..., P, K)
    k = p // BLOCK
    xb = x[..., : k * BLOCK].unflatten(-1, (k, BLOCK)).movedim(-2, 0)  # (k, ..., B, BLOCK)
    rb = r[..., : k * BLOCK].unflatten(-1, (k, BLOCK)).movedim(-2, 0)  # (k, ..., K, BLOCK)
    total = (xb @ rb.mT).sum(0)  # (k, ..., B, K) -> (..., B, K)
    if p % BLOCK:
        total = total + x[..., k * BLOCK :] @ r[..., k * BLOCK :].mT
    return total


def stacked(refs: Sequence[Tensor]) -> Tensor:
    """(n, K, *shape): n calls' references as one tensor, stacked where they come as a list;
    a view where they already lie stacked, consecutive rows of one tensor in order
    (``engine/backward/stacked.laid_out``), not a copy."""
    if isinstance(refs, Tensor):
        return refs
    first, n = refs[0], len(refs)
    step = first.numel()
    if (
        n > 1
        and first.is_contiguous()
        and all(
            t.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
            and t.storage_offset() == first.storage_offset() + j * step
            and t.shape == first.shape
            and t.dtype == first.dtype
            and t.is_contiguous()
            for j, t in enumerate(refs)
        )
        and first.storage_offset() + n * step <= first.untyped_storage().nbytes() // first.itemsize
    ):
        return first.as_strided((n, *first.shape), (step, *first.stride()))
    return torch.stack(list(refs))


def _cat(parts: list[Tensor], dim: int = 0) -> Tensor:
    """``torch.cat`` of fresh results, without its copy where there is one (a small batch's
    one chunk)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


class Contribution(ABC):
    """One parameter's per-example gradient, (B, *shape), kept in whatever form is cheapest."""

    shape: torch.Size
    # whether each example's gradient is at hand, or formed by ``norm_sq`` (a chunk at a time):
    # the batch sum from the same, ``norm_sq_and_sum``, then costs a sum, not a matrix product
    forms = False

    @abstractmethod
    def norm_sq(self) -> Tensor:
        """(B,) squared L2 norm of each example's gradient."""

    @abstractmethod
    def inner(self, refs: Tensor) -> Tensor:
        """(B, K) inner products of each example's gradient with ``refs`` of shape (K, *shape)."""

    @abstractmethod
    def materialize(self) -> Tensor:
        """(B, *shape) the per-example gradients themselves."""

    def project(self, p: Projection) -> Tensor:
        """(B, p.dim) each example's gradient projected, ``P_out^T G_i P_in`` (see
        ``projection.py``); here from the gradients formed, where no cheaper form exists."""
        return p.dense(self.materialize())

    def batch_sum(self) -> Tensor:
        """(*shape) the sum over examples: the batch gradient of the summed loss."""
        return self.materialize().sum(0)

    def examples(self, lo: int, hi: int) -> Contribution:
        """Examples ``lo`` to ``hi - 1`` alone, formed no further than their own share."""
        return Dense(self.materialize()[lo:hi])

    def merge(self, other: Contribution) -> Contribution:
        """The contribution of both (a module called twice, a weight shared by two modules)."""
        return Dense(self.materialize() + other.materialize())

    def norm_sq_and_inner(self, refs: Tensor) -> tuple[Tensor, Tensor]:
        """Both answers at once, for contributions that can share the work between them."""
        return self.norm_sq(), self.inner(refs)

    def norm_sq_and_sum(self) -> tuple[Tensor, Tensor]:
        """(B,) squared norms and (*shape) the batch sum, from one forming of the examples'
        gradients where ``forms``."""
        return self.norm_sq(), self.batch_sum()

    def inners(self, refs: Sequence[Tensor], batch: int) -> Tensor:
        """(n, batch, K) where this contribution holds the examples of n calls stacked, n *
        batch of them: each call's inner products with its own ``refs``, n (K, *shape) (a
        list, or one (n, K, *shape) tensor: ``stacked``)."""
        return torch.stack(
            [self.examples(k * batch, (k + 1) * batch).inner(r) for k, r in enumerate(refs)]
        )

    def cross(self, other: Contribution) -> Tensor | None:
        """(B,) <G_i, H_i> with ``other``'s per-example gradients, where a form cheaper than
        forming both exists (a tied embedding and output head); None where it does not."""
        return None


class Once:
    """(...) the squared norms of ``t`` (..., N) over its last dim, computed once for the parts
    of one call that each need them: a one-position Linear's output gradient s_i, whose
    ||s_i||^2 is its bias's norm and a factor of its weight's, ||s_i||^2 ||a_i||^2."""

    __slots__ = ("t", "sq")

    def __init__(self, t: Tensor):
        self.t, self.sq = t, None

    def __call__(self) -> Tensor:
        if self.sq is None:
            self.sq, self.t = _sq_norm(self.t), None
        return self.sq


class Dense(Contribution):
    """Per-example gradients formed directly: fine for small parameters (biases, norm scales).
    ``sq``: their squared norms where another part of the call computes them too (``Once``
    over the same (B, P) values)."""

    forms = True

    def __init__(self, grads: Tensor, sq: Once | None = None):
        self.grads = _acc(grads)  # (B, *shape)
        self.shape = grads.shape[1:]
        self.sq = sq

    def norm_sq(self) -> Tensor:
        return _sq_norm(rows(self.grads)) if self.sq is None else self.sq()

    def inner(self, refs: Tensor) -> Tensor:
        return _dots(rows(self.grads), rows(refs.to(self.grads.dtype)))

    def inners(self, refs: Sequence[Tensor], batch: int) -> Tensor:
        refs = stacked(refs)
        n = refs.shape[0]
        own = rows(self.grads).view(n, batch, -1)  # (n, B, P)
        return _dots(own, refs.to(own.dtype).reshape(n, refs.shape[1], -1))  # (n, B, K)

    def materialize(self) -> Tensor:
        return self.grads

    def batch_sum(self) -> Tensor:
        return self.grads.sum(0)

    def examples(self, lo: int, hi: int) -> Contribution:
        return Dense(self.grads[lo:hi])

    def merge(self, other: Contribution) -> Contribution:
        return Dense(self.grads + other.materialize())


# (module, tensor inputs, output grad, **the call's other arguments by name) -> {attr: part}
RuleFn = Callable[..., dict[str, Contribution]]
# module -> how many trailing dimensions of its leading input are features, for a rule that
# treats every other dimension as rows (Linear: 1, Embedding: 0); None: not row by row
RowsFn = Callable[[nn.Module], int | None]
# (module, tensor inputs) -> the dimension of the call's inputs that indexes examples, for a rule
# that is not row by row; None when no dimension does (an unbatched call)
BatchDimFn = Callable[[nn.Module, tuple[Tensor, ...]], int | None]
# module -> a key: modules of equal keys are alike to the rule (see Rule)
AlikeFn = Callable[[nn.Module], Hashable]
# (module, tensor inputs, other arguments by name) -> for a call whose leading input's positions
# are cut into bags, each the rule's row of examples: the (N,) bag of each position and the
# bags' count; None for a call of rows
BagsFn = Callable[[nn.Module, tuple[Tensor, ...], dict], tuple[Tensor, int] | None]


@dataclass(frozen=True)
class Rule:
    """A rule and what the engine must know to feed it.

    ``submodules`` names child modules whose parameters the rule serves, keyed ``"child.attr"``
    in its result: the module uses them functionally, so the child's own hook never fires
    (``nn.MultiheadAttention`` and its ``out_proj``). ``rows`` marks a rule that works row by
    row (each row's output from that row's input alone): it gives the number of trailing feature
    dimensions of the leading input, and the engine can then hand it a call in any layout of
    rows (tokens flattened to (B*T, D), sequence-first, the tokens routed to one expert), each
    example's rows gathered into a (B, L, *features) batch. Other rules read examples on one
    dimension of their inputs: ``batch_dim`` says which (by default 0). ``alike`` keys the
    modules a rule treats alike: it reads of them nothing their keys do not say (shapes, eps;
    never a parameter's values), and each example's contributions come from that example's
    inputs and output gradient alone, so calls of modules with equal keys on inputs of one shape
    may be answered by one run of the rule over their examples stacked (the twelve ``c_attn``
    calls of a GPT-2 backward). ``bags`` marks a rule whose examples are bags of its leading
    input's positions (``nn.EmbeddingBag`` with offsets): the engine checks that bag i's
    positions are all example i's, whatever the other inputs' owners (offsets are positions).
    """

    name: str
    fn: RuleFn
    submodules: tuple[str, ...] = ()
    rows: RowsFn | None = None
    batch_dim: BatchDimFn | None = None
    alike: AlikeFn | None = None
    bags: BagsFn | None = None


RULES: dict[type[nn.Module], Rule] = {}
# Layers of model libraries, recognised without importing the library: by qualified class name
# ("transformers.pytorch_utils.Conv1D"), then by a structural predicate, in registration order.
# Recognition may be wrong (a class of the same name or shape doing other math); the engine's
# first-batch self-check moves a parameter whose rule does not reproduce autograd to the fallback.
NAMED: dict[str, Rule] = {}
MATCHERS: list[tuple[Callable[[nn.Module], bool], Rule]] = []


def qualified_name(cls: type) -> str:
    """``module.QualName`` of a class, as NAMED keys it."""
    return f"{cls.__module__}.{cls.__qualname__}"


def register_rule(
    *types: type[nn.Module],
    name: str,
    submodules: tuple[str, ...] = (),
    rows: RowsFn | None = None,
    batch_dim: BatchDimFn | None = None,
    qualnames: tuple[str, ...] = (),
    match: Callable[[nn.Module], bool] | None = None,
    alike: AlikeFn | None = None,
    bags: BagsFn | None = None,
) -> Callable[[RuleFn], RuleFn]:
    """Register ``fn`` as the rule for modules of exactly these types, of classes with these
    qualified names, and of any module ``match`` accepts (checked after types and names)."""

    def register(fn: RuleFn) -> RuleFn:
        rule = Rule(name, fn, submodules, rows, batch_dim, alike, bags)
        for t in types:
            RULES[t] = rule
        for qualname in qualnames:
            NAMED[qualname] = rule
        if match is not None:
            MATCHERS.append((match, rule))
        return fn

    return register


def find_rule(module: nn.Module) -> Rule | None:
    """The rule for ``module``'s exact type, or a parent's when the subclass keeps its forward;
    else the rule of its qualified class name, else the first whose predicate accepts it."""
    cls = type(module)
    if cls in RULES:
        return RULES[cls]
    for parent in cls.__mro__[1:]:
        if parent in RULES and cls.forward is parent.forward:
            return RULES[parent]
    if (named := NAMED.get(qualified_name(cls))) is not None:
        return named
    return next((rule for match, rule in MATCHERS if match(module)), None)
