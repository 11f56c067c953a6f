"""Every layer's exact per-example gradient norm by hand-written hooks: the yardstick for ``norms``.

``methods.linear_hooks`` computes the ``nn.Linear`` layers' ghost norms alone, so an exact pass
near it does little beyond hooks, but it leaves out what an exact pass cannot: the norms of the
embeddings, the normalisations, ``nn.MultiheadAttention``'s projections (its forward reads them
through ``F.linear``, never its ``out_proj`` module), convolutions, a router and routed experts,
and the cross term of a table tied to an output layer. These hooks compute all of it, a rule per
layer type as Opacus writes its grad samplers, each the cheaper of the Gram route and the
instantiated gradient at the call's shapes, and nothing else: no check, no other model. A model
with a parameter no rule here serves is refused at setup; the answer is checked against the loop
as every ``norms`` method's is.

Each rule keeps what its forward read and takes its output's gradient by a tensor hook; where
the parameter is read inside a forward (``F.linear`` in ``F.multi_head_attention_forward``,
``_grouped_linear`` in transformers' grouped experts), the module's hooks swap that function for
one that also hooks its output, for that forward only.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def linear_sq(a: Tensor, s: Tensor, biased: bool) -> Tensor:
    """(B,): ||sum_t s_t a_t^T||^2 (+ ||sum_t s_t||^2) per example, a (B, T, i), s (B, T, o)."""
    t, i, o = a.shape[1], a.shape[2], s.shape[2]
    if t == 1:
        return s[:, 0].square().sum(1) * (a[:, 0].square().sum(1) + biased)
    if t * (i + o) < i * o:  # the Gram route, B T^2 (i + o), against B T i o instantiated
        sq = ((a @ a.mT) * (s @ s.mT)).sum((1, 2))
    else:
        sq = (s.mT @ a).square().sum((1, 2))  # (B, o, i) instantiated
    return sq + s.sum(1).square().sum(1) if biased else sq


def embedding_sq(ids: Tensor, e: Tensor, rows: int) -> Tensor:
    """(B,): the table's gradient norm squared, ids (B, T), e (B, T, d) the output's gradient."""
    if rows <= ids.shape[1]:  # a short table (positions, token types): instantiated
        g = e.new_zeros(e.shape[0], rows, e.shape[2])  # (B, rows, d)
        return g.scatter_add_(1, ids[..., None].expand_as(e), e).square().sum((1, 2))
    same = ids[:, :, None] == ids[:, None, :]  # (B, T, T)
    return ((e @ e.mT) * same).sum((1, 2))


def tie_cross(ids: Tensor, e: Tensor, a: Tensor, s: Tensor) -> Tensor:
    """(B,): 2 <g_table, g_out> of a table tied to an output layer's weight (V, d): the table's
    gradient puts e_t in row ids_t, the layer's is sum_u s_u a_u^T, so the inner product is
    sum_{t,u} s_u[ids_t] (e_t . a_u); ids (B, T), e (B, T, d), a (B, U, d), s (B, U, V)."""
    picked = s.gather(2, ids[:, None, :].expand(-1, s.shape[1], -1))  # (B, U, T)
    return 2 * (picked.mT * (e @ a.mT)).sum((1, 2))  # (B, T, U) each


class Hooks:
    """The hooks on one model: ``total`` collects each rule's (B,) squared norms in a pass."""

    def __init__(self, model: nn.Module, batch: int):
        self.batch, self.total = batch, []
        self.outputs: dict[int, tuple[Tensor, Tensor]] = {}  # a tied weight's layer: (a, s)
        owners: dict[int, list[nn.Module]] = {}
        for m in model.modules():
            for p in m.parameters(recurse=False):
                owners.setdefault(id(p), []).append(m)
        self.tied = {k for k, ms in owners.items() if len(ms) > 1}
        served: set[int] = set()
        for m in model.modules():
            rule = next((r for kind, r in RULES if kind(m)), None)
            if rule is not None:
                rule(self, m)
                served |= {id(p) for p in m.parameters(recurse=False)}
        left = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in served]
        if left:
            raise ValueError(f"no rule for {', '.join(left)}")

    def add(self, sq: Tensor) -> None:
        self.total.append(sq)

    def rows(self, t: Tensor) -> Tensor:
        """(B, N, features): the leading dimensions as the batch, then positions."""
        return t.reshape(self.batch, -1, t.shape[-1])


def _on_grad(out: Tensor, fn: Callable[[Tensor], None]) -> None:
    if out.requires_grad:
        out.register_hook(fn)


def _linear(h: Hooks, m: nn.Module) -> None:
    tied = id(m.weight) in h.tied

    def forward(m: nn.Module, args: tuple, out: Tensor) -> None:
        a = h.rows(args[0].detach())

        def grad(s: Tensor) -> None:
            s = h.rows(s)
            h.add(linear_sq(a, s, m.bias is not None))
            if tied:
                h.outputs[id(m.weight)] = (a, s)

        _on_grad(out, grad)

    m.register_forward_hook(forward)


def _embedding(h: Hooks, m: nn.Embedding) -> None:
    if m.max_norm is not None:
        raise ValueError("an embedding with max_norm")

    def forward(m: nn.Module, args: tuple, out: Tensor) -> Tensor:
        ids = args[0]
        if ids.shape[0] != h.batch:  # a table the batch shares, (1, T) position ids: expanded,
            ids, out = ids.expand(h.batch, -1), out.expand(h.batch, -1, -1)  # per example

        def grad(e: Tensor) -> None:
            if m.padding_idx is not None:  # its row's gradient is zero
                e = e * (ids != m.padding_idx)[..., None]
            h.add(embedding_sq(ids, e, m.num_embeddings))
            if id(m.weight) in h.tied:  # the output layer's gradient came first
                h.add(tie_cross(ids, e, *h.outputs.pop(id(m.weight))))

        _on_grad(out, grad)
        return out

    m.register_forward_hook(forward)


def _normalisation(h: Hooks, m: nn.Module) -> None:
    """LayerNorm (weight and bias) and RMSNorm (weight): the gradients, instantiated (B, d)."""
    if getattr(m, "weight", None) is None:
        return
    rms = not isinstance(m, nn.LayerNorm)

    def normed(x: Tensor) -> Tensor:
        if rms:  # HF's: in float32, cast back
            f = x.float()
            return (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + m.variance_epsilon)).to(
                x.dtype
            )
        return F.layer_norm(x, m.normalized_shape, eps=m.eps)

    def forward(m: nn.Module, args: tuple, out: Tensor) -> None:
        x = args[0].detach()

        def grad(s: Tensor) -> None:
            s = h.rows(s)  # (B, T, d)
            sq = (s * h.rows(normed(x))).sum(1).square().sum(1)
            h.add(sq + s.sum(1).square().sum(1) if getattr(m, "bias", None) is not None else sq)

        _on_grad(out, grad)

    m.register_forward_hook(forward)


def _conv(h: Hooks, m: nn.Conv2d) -> None:
    if m.groups != 1 or isinstance(m.padding, str) or m.padding_mode != "zeros":
        raise ValueError("a grouped or padded-by-mode convolution")

    def forward(m: nn.Module, args: tuple, out: Tensor) -> None:
        x = args[0].detach()

        def grad(s: Tensor) -> None:
            a = F.unfold(x, m.kernel_size, m.dilation, m.padding, m.stride)  # (B, C k k, L)
            h.add(linear_sq(a.mT, s.flatten(2).mT, m.bias is not None))

        _on_grad(out, grad)

    m.register_forward_hook(forward)


def _swapped(owner: object, name: str, make: Callable) -> tuple[Callable, Callable]:
    """A pre-hook that puts ``make(original)`` in ``owner.name`` and a hook that puts it back."""
    original = getattr(owner, name)

    def pre(m: nn.Module, args: tuple, kwargs: dict | None = None) -> None:
        setattr(owner, name, make(m, args, original))

    def post(m: nn.Module, args: tuple, out: object) -> None:
        setattr(owner, name, original)

    return pre, post


def _attention(h: Hooks, m: nn.MultiheadAttention) -> None:
    """Self-attention, batch first, packed: F.linear reads in_proj on (T, B, d), out_proj on
    (T B, d)."""
    if not m.batch_first or m.in_proj_weight is None:
        raise ValueError("attention that is not batch first or not packed")

    def make(m: nn.Module, args: tuple, linear: Callable) -> Callable:
        if not (args[0] is args[1] is args[2]):
            raise ValueError("attention that is not self-attention")
        t = args[0].shape[1]

        def swapped(x: Tensor, w: Tensor, b: Tensor | None = None) -> Tensor:
            out = linear(x, w, b)
            if w is m.in_proj_weight or w is m.out_proj.weight:
                a = x.detach().reshape(t, h.batch, -1).transpose(0, 1)  # (B, T, i)
                grad = lambda s: h.add(  # noqa: E731
                    linear_sq(a, s.reshape(t, h.batch, -1).transpose(0, 1), b is not None)
                )
                _on_grad(out, grad)
            return out

        return swapped

    pre, post = _swapped(F, "linear", make)
    m.register_forward_pre_hook(pre)
    m.register_forward_hook(post)


def _router(h: Hooks, m: nn.Module) -> None:
    """transformers' TopKRouter: F.linear(x, weight) on (B T, d), the logits first of three."""

    def forward(m: nn.Module, args: tuple, out: tuple) -> None:
        a = h.rows(args[0].detach())
        _on_grad(out[0], lambda s: h.add(linear_sq(a, h.rows(s), False)))

    m.register_forward_hook(forward)


def _experts(h: Hooks, m: nn.Module) -> None:
    """transformers' grouped experts (3-D gate_up_proj and down_proj): rows sorted by expert, an
    example's gradient of expert e sums its rows routed to e; the Gram route per (expert,
    example) group, its rows padded to the largest group's count."""
    from transformers.integrations import moe

    if m.config._experts_implementation != "grouped_mm" or m.has_bias or m.is_transposed:
        raise ValueError("experts other than grouped_mm's, unbiased, untransposed")

    def make(m: nn.Module, args: tuple, grouped: Callable) -> Callable:
        hidden, index = args[0], args[1]  # (N, d), (N, k)
        with torch.no_grad():
            experts, perm = torch.sort(index.reshape(-1))  # as the forward sorts them: (S,)
            groups = m.num_experts * h.batch
            key = experts * h.batch + perm // index.shape[1] // (hidden.shape[0] // h.batch)
            order = torch.argsort(key, stable=True)
            counts = torch.bincount(key, minlength=groups)
            width = int(counts.max())
            slot = (
                key[order] * width
                + torch.arange(len(key), device=key.device)
                - (counts.cumsum(0) - counts)[key[order]]
            )

        def padded(x: Tensor) -> Tensor:  # (S, f) -> (groups, width, f)
            flat = x.new_zeros(groups * width, x.shape[1]).index_copy_(0, slot, x[order])
            return flat.view(groups, width, -1)

        def swapped(x: Tensor, w: Tensor, offs: Tensor, **kw: object) -> Tensor:
            out = grouped(x, w, offs, **kw)
            a = padded(x.detach())
            sq = lambda s: (a @ a.mT * (s @ s.mT)).sum((1, 2)).view(-1, h.batch).sum(0)  # noqa: E731
            _on_grad(out, lambda s: h.add(sq(padded(s))))
            return out

        return swapped

    pre, post = _swapped(moe, "_grouped_linear", make)
    m.register_forward_pre_hook(pre)
    m.register_forward_hook(post)


def _conv1d(m: nn.Module) -> bool:
    return type(m).__name__ == "Conv1D"  # transformers' x @ W + b: the same norms as Linear


RULES: list[tuple[Callable[[nn.Module], bool], Callable[[Hooks, nn.Module], None]]] = [
    (lambda m: isinstance(m, nn.Linear) or _conv1d(m), _linear),
    (lambda m: isinstance(m, nn.Embedding), _embedding),
    (lambda m: isinstance(m, nn.LayerNorm) or type(m).__name__.endswith("RMSNorm"), _normalisation),
    (lambda m: isinstance(m, nn.Conv2d), _conv),
    (lambda m: isinstance(m, nn.MultiheadAttention), _attention),
    (lambda m: type(m).__name__.endswith("TopKRouter"), _router),
    (lambda m: type(m).__name__.endswith("Experts"), _experts),
]


def all_layer_hooks(model: nn.Module, batch: int) -> tuple[nn.Module, Hooks]:
    """A copy of ``model`` with the hooks on it (the model itself stays bare for the others)."""
    copied = copy.deepcopy(model)
    return copied, Hooks(copied, batch)
