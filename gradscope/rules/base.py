"""Per-example gradients in factored form, and the registry of layer rules that produce them.

A rule is a pure function ``(module, inputs, grad_output, **kwargs) -> {param_name: Contribution}``
for one call of one module: ``inputs`` are the call's leading positional tensors, ``kwargs`` its
other arguments by name. A Contribution holds one parameter's per-example gradient without forming
it where the layer's structure allows, and answers three questions about it: its squared norm, its
inner product with reference tensors, and (only when nothing cheaper exists) the gradient itself.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn

# Bound on the elements of one temporary (Gram block, materialised chunk): 2**24 floats = 64 MiB.
CHUNK_ELEMENTS = 1 << 24


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Half precision models accumulate norms and inner products in float32."""
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def _acc(t: Tensor) -> Tensor:
    return t.to(accumulation_dtype(t.dtype))


def rows(t: Tensor) -> Tensor:
    """(B, *shape) -> (B, P): one row per example, also for a parameter of shape ()."""
    return t.reshape(t.shape[0], -1)


def _sq_norm(t: Tensor, dim: int | tuple[int, ...]) -> Tensor:
    """Squared L2 norm over ``dim``: one fused reduction, no squared copy of ``t`` in memory."""
    return torch.linalg.vector_norm(t, dim=dim).square()


def _cat(parts: list[Tensor], dim: int = 0) -> Tensor:
    """``torch.cat`` of fresh results, without its copy where there is one (a small batch's
    one chunk)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


class Contribution(ABC):
    """One parameter's per-example gradient, (B, *shape), kept in whatever form is cheapest."""

    shape: torch.Size

    @abstractmethod
    def norm_sq(self) -> Tensor:
        """(B,) squared L2 norm of each example's gradient."""

    @abstractmethod
    def inner(self, refs: Tensor) -> Tensor:
        """(B, K) inner products of each example's gradient with ``refs`` of shape (K, *shape)."""

    @abstractmethod
    def materialize(self) -> Tensor:
        """(B, *shape) the per-example gradients themselves."""

    def batch_sum(self) -> Tensor:
        """(*shape) the sum over examples: the batch gradient of the summed loss."""
        return self.materialize().sum(0)

    def merge(self, other: Contribution) -> Contribution:
        """The contribution of both (a module called twice, a weight shared by two modules)."""
        return Dense(self.materialize() + other.materialize())

    def norm_sq_and_inner(self, refs: Tensor) -> tuple[Tensor, Tensor]:
        """Both answers at once, for contributions that can share the work between them."""
        return self.norm_sq(), self.inner(refs)

    def cross(self, other: Contribution) -> Tensor | None:
        """(B,) <G_i, H_i> with ``other``'s per-example gradients, where a form cheaper than
        forming both exists (a tied embedding and output head); None where it does not."""
        return None


class Dense(Contribution):
    """Per-example gradients formed directly: fine for small parameters (biases, norm scales)."""

    def __init__(self, grads: Tensor):
        self.grads = _acc(grads)  # (B, *shape)
        self.shape = grads.shape[1:]

    def norm_sq(self) -> Tensor:
        return _sq_norm(rows(self.grads), 1)

    def inner(self, refs: Tensor) -> Tensor:
        return rows(self.grads) @ rows(refs.to(self.grads.dtype)).T  # (B, P) @ (P, K)

    def materialize(self) -> Tensor:
        return self.grads

    def batch_sum(self) -> Tensor:
        return self.grads.sum(0)

    def merge(self, other: Contribution) -> Contribution:
        return Dense(self.grads + other.materialize())


class Formed(Dense):
    """Per-example gradients formed a few examples at a time, ``form(lo, hi)`` -> (hi - lo, *shape),
    and reduced chunk by chunk: norms, inner products and the batch sum never hold the (B, *shape)
    gradients (nor what forming them takes) of more than ``step`` examples at once. Each question
    forms them again; ``grads`` forms them all, for callers that need every one."""

    def __init__(
        self, form: Callable[[int, int], Tensor], batch: int, shape: torch.Size, step: int
    ):
        self.form, self.batch, self.step = form, batch, step
        self.shape = torch.Size(shape)

    def _chunks(self) -> Iterator[Tensor]:
        for lo in range(0, self.batch, self.step):
            yield _acc(self.form(lo, min(lo + self.step, self.batch)))  # (b, *shape)

    @property
    def grads(self) -> Tensor:
        return torch.cat(list(self._chunks()))  # (B, *shape)

    def norm_sq(self) -> Tensor:
        return _cat([_sq_norm(rows(m), 1) for m in self._chunks()])

    def inner(self, refs: Tensor) -> Tensor:
        return _cat([rows(m) @ rows(refs.to(m.dtype)).T for m in self._chunks()])

    def norm_sq_and_inner(self, refs: Tensor) -> tuple[Tensor, Tensor]:
        norms, inners = [], []
        for m in self._chunks():
            flat = rows(m)  # (b, P)
            norms.append(_sq_norm(flat, 1))
            inners.append(flat @ rows(refs.to(m.dtype)).T)  # (b, P) @ (P, K)
        return _cat(norms), _cat(inners)

    def batch_sum(self) -> Tensor:
        return sum(m.sum(0) for m in self._chunks())


class Outer(Contribution):
    """G_i = sum_t s_it a_it^T for each of ``G`` groups: the weight of Linear and Conv layers.

    ``s`` is (B, G, T, O) output gradients and ``a`` is (B, G, T, I) inputs at T positions; the
    parameter, of ``shape``, is the (G*O, I) matrix stacked group by group and reshaped.
    """

    def __init__(self, s: Tensor, a: Tensor, shape: torch.Size):
        self.s, self.a, self.shape = _acc(s), _acc(a), torch.Size(shape)

    @property
    def dims(self) -> tuple[int, int, int, int, int]:
        (b, g, t, o), i = self.s.shape, self.a.shape[-1]
        return b, g, t, o, i

    def merge(self, other: Contribution) -> Contribution:
        b, g, _, o, i = self.dims
        if isinstance(other, Outer) and (b, g, o, i) == tuple(other.dims[k] for k in (0, 1, 3, 4)):
            # positions of both calls add up: concatenate them, cross terms come out of the Gram
            return Outer(
                torch.cat([self.s, other.s], 2), torch.cat([self.a, other.a], 2), self.shape
            )
        return super().merge(other)

    def norm_sq(self) -> Tensor:
        b, g, t, o, i = self.dims
        if t == 1:  # ||s a^T||^2 = ||s||^2 ||a||^2
            return (_sq_norm(self.s, -1) * _sq_norm(self.a, -1)).sum((1, 2))
        if self._gram_cheaper:
            return self._gram_norm_sq()
        return _cat([_sq_norm(m.flatten(1), 1) for m in self._materialized_chunks()])

    @property
    def _gram_cheaper(self) -> bool:
        """Whether the (T, T) Gram matrices cost less than forming G."""
        _, _, t, o, i = self.dims
        return t * (i + o) < i * o

    def norm_sq_and_inner(self, refs: Tensor) -> tuple[Tensor, Tensor]:
        """Where the norm forms G anyway (many positions, as an LM head over a sequence), the
        inner products come from the same chunks for (B, K, P) more, instead of sum_t s^T R a."""
        if self.dims[2] == 1 or self._gram_cheaper:
            return self.norm_sq(), self.inner(refs)
        r = rows(refs.to(self.s.dtype))  # (K, P)
        norms, inners = [], []
        for m in self._materialized_chunks():
            flat = m.flatten(1)  # (b, P)
            norms.append(_sq_norm(flat, 1))
            inners.append(flat @ r.T)  # (b, P) @ (P, K)
        return _cat(norms), _cat(inners)

    def _gram_norm_sq(self) -> Tensor:
        """sum_{t,t'} (a_t . a_t')(s_t . s_t'), in (c, c) blocks so no (T, T) matrix is needed."""
        b, g, t, _, _ = self.dims
        c = max(1, min(t, int((CHUNK_ELEMENTS / (b * g)) ** 0.5)))
        if c == t:  # one block: its sum, with no running total
            gram_a, gram_s = self.a @ self.a.mT, self.s @ self.s.mT  # (B, G, T, T) each
            return (gram_a * gram_s).sum((1, 2, 3))
        total = self.s.new_zeros(b)
        for lo in range(0, t, c):
            a_lo, s_lo = self.a[:, :, lo : lo + c], self.s[:, :, lo : lo + c]
            for hi in range(lo, t, c):
                a_hi, s_hi = self.a[:, :, hi : hi + c], self.s[:, :, hi : hi + c]
                block = (a_lo @ a_hi.transpose(-1, -2)) * (
                    s_lo @ s_hi.transpose(-1, -2)
                )  # (B, G, c, c)
                total += block.sum((1, 2, 3)) * (1 if hi == lo else 2)  # off-diagonal blocks twice
        return total

    def _materialized_chunks(self):
        b, g, _, o, i = self.dims
        step = max(1, CHUNK_ELEMENTS // (g * o * i))
        for lo in range(0, b, step):
            # (b, G, O, T) @ (b, G, T, I) -> (b, G, O, I)
            yield self.s[lo : lo + step].transpose(-1, -2) @ self.a[lo : lo + step]

    def materialize(self) -> Tensor:
        return torch.cat(list(self._materialized_chunks())).reshape(-1, *self.shape)

    def batch_sum(self) -> Tensor:
        b, g, t, o, i = self.dims
        s, a = (
            self.s.transpose(0, 1).reshape(g, b * t, o),
            self.a.transpose(0, 1).reshape(g, b * t, i),
        )
        return (s.transpose(1, 2) @ a).reshape(self.shape)  # (G, O, B*T) @ (G, B*T, I)

    def inner(self, refs: Tensor) -> Tensor:
        b, g, t, o, i = self.dims
        r = refs.to(self.s.dtype).reshape(-1, g, o, i)  # (K, G, O, I)
        # sum_t s_t^T R a_t: project the inputs through R, never forming G; a few references at
        # a time, so that --per-ref's K of up to 1000 holds no (B, K, G, T, O) product at once
        step = max(1, CHUNK_ELEMENTS // (b * g * t * min(o, i)))
        return _cat([self._inner(r[lo : lo + step]) for lo in range(0, r.shape[0], step)], 1)

    def _inner(self, r: Tensor) -> Tensor:
        _, _, _, o, i = self.dims
        if o <= i:
            ra = torch.einsum("kgoi,bgti->bkgto", r, self.a)  # (B, K, G, T, O)
            return torch.einsum("bkgto,bgto->bk", ra, self.s)
        rs = torch.einsum("kgoi,bgto->bkgti", r, self.s)  # (B, K, G, T, I)
        return torch.einsum("bkgti,bgti->bk", rs, self.a)


# (module, tensor inputs, output grad, **the call's other arguments by name) -> {attr: part}
RuleFn = Callable[..., dict[str, Contribution]]
# module -> how many trailing dimensions of its leading input are features, for a rule that
# treats every other dimension as rows (Linear: 1, Embedding: 0); None: not row by row
RowsFn = Callable[[nn.Module], int | None]
# (module, tensor inputs) -> the dimension of the call's inputs that indexes examples, for a rule
# that is not row by row; None when no dimension does (an unbatched call)
BatchDimFn = Callable[[nn.Module, tuple[Tensor, ...]], int | None]


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
    dimension of their inputs: ``batch_dim`` says which (by default 0).
    """

    name: str
    fn: RuleFn
    submodules: tuple[str, ...] = ()
    rows: RowsFn | None = None
    batch_dim: BatchDimFn | None = None


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
) -> Callable[[RuleFn], RuleFn]:
    """Register ``fn`` as the rule for modules of exactly these types, of classes with these
    qualified names, and of any module ``match`` accepts (checked after types and names)."""

    def register(fn: RuleFn) -> RuleFn:
        rule = Rule(name, fn, submodules, rows, batch_dim)
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
