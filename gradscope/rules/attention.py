"""nn.MultiheadAttention in eval mode: in-projections and out_proj from one local backward."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .base import Contribution, Dense
from .outer import Outer
from .registry import register_rule


def _batch_dim(module: nn.MultiheadAttention, inputs: tuple[Tensor, ...]) -> int | None:
    if inputs[0].dim() != 3:
        return None  # an unbatched (L, E) call: its rows are positions, not examples
    return 0 if module.batch_first else 1


def _mask(
    module: nn.MultiheadAttention,
    batch: int,
    dtype: torch.dtype,
    key_padding_mask: Tensor | None,
    need_weights: bool,
    attn_mask: Tensor | None,
    is_causal: bool,
) -> tuple[Tensor | None, bool]:
    """The additive (B or 1, H or 1, L, S) mask and causal flag that attention ends up with.

    Mirrors ``nn.MultiheadAttention.forward`` and ``F.multi_head_attention_forward``: bool masks
    become -inf, the causal hint replaces ``attn_mask`` only without a padding mask and without
    weights, ``bias_k`` and ``add_zero_attn`` each add one key column that no mask hides.
    """
    key_padding_mask = F._canonical_mask(
        key_padding_mask, "key_padding_mask", None, "", dtype, check_other=False
    )
    if is_causal and key_padding_mask is None and not need_weights:
        return None, True  # torch hands the hint alone to scaled_dot_product_attention
    mask = F._canonical_mask(attn_mask, "attn_mask", None, "", dtype, check_other=False)
    extra = int(module.bias_k is not None) + int(module.add_zero_attn)
    if mask is not None:
        # (L, S) applies to every example and head; (B*H, L, S) is example-major
        mask = (
            mask[None, None]
            if mask.dim() == 2
            else mask.view(batch, module.num_heads, *mask.shape[1:])
        )
        mask = F.pad(mask, (0, extra))
    if key_padding_mask is not None:
        padding = F.pad(key_padding_mask, (0, extra))[:, None, None]  # (B, 1, 1, S)
        mask = padding if mask is None else mask + padding
    return mask, False


def _heads(t: Tensor, heads: int) -> Tensor:
    """(B, T, E) -> (B, H, T, E/H)."""
    return t.unflatten(-1, (heads, -1)).transpose(1, 2)


def _learned_key(module: nn.Module) -> bool:
    """nn.MultiheadAttention with ``add_bias_kv``: the one configuration this rule serves. The
    others run their projections as ``F.linear`` calls inside ``F.multi_head_attention_forward``,
    which the tap serves where they happen (``engine/tap.py``), with no recomputation."""
    return (
        isinstance(module, nn.MultiheadAttention)
        and type(module).forward is nn.MultiheadAttention.forward
        and module.bias_k is not None
    )


@register_rule(name="attention", submodules=("out_proj",), batch_dim=_batch_dim, match=_learned_key)
def attention(
    module: nn.MultiheadAttention,
    inputs: tuple[Tensor, ...],
    grad_output: Tensor,
    key_padding_mask: Tensor | None = None,
    need_weights: bool = True,
    attn_mask: Tensor | None = None,
    average_attn_weights: bool = True,  # shapes the weights only, never the output
    is_causal: bool = False,
) -> dict[str, Contribution]:
    if len(inputs) > 3:  # the padding mask passed positionally
        inputs, key_padding_mask = inputs[:3], inputs[3]
    query, key, value = inputs
    self_attention = query is key is value  # one input: the packed weight is one Outer
    if not module.batch_first:
        query, key, value, grad_output = (t.transpose(0, 1) for t in (*inputs, grad_output))
    b, length, e = query.shape
    heads = module.num_heads
    if module._qkv_same_embed_dim:
        weights = module.in_proj_weight.detach().chunk(3)  # 3 x (E, E)
    else:
        weights = (module.q_proj_weight, module.k_proj_weight, module.v_proj_weight)
        weights = tuple(w.detach() for w in weights)
    biases = (None,) * 3 if module.in_proj_bias is None else module.in_proj_bias.detach().chunk(3)
    xs = (query, key, value)
    q, k, v = (F.linear(x, w, c) for x, w, c in zip(xs, weights, biases, strict=True))  # (B, T, E)
    if module.bias_k is not None:
        # the learned key/value column joins the leaves: its gradient is bias_k's
        k = torch.cat([k, module.bias_k.detach().expand(b, 1, e)], 1)  # (B, S+1, E)
        v = torch.cat([v, module.bias_v.detach().expand(b, 1, e)], 1)
    mask, causal = _mask(
        module, b, query.dtype, key_padding_mask, need_weights, attn_mask, is_causal
    )
    with torch.enable_grad():
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        kh, vh = _heads(k, heads), _heads(v, heads)  # (B, H, S, E/H)
        if module.add_zero_attn:
            kh, vh = (F.pad(t, (0, 0, 0, 1)) for t in (kh, vh))  # one all-zero key and value
        context = F.scaled_dot_product_attention(
            _heads(q, heads), kh, vh, attn_mask=mask, is_causal=causal
        )  # (B, H, L, E/H)
        context = context.transpose(1, 2).reshape(b, length, e)  # (B, L, E)
        # out_proj is linear: the gradient at the context is grad_output through its weight
        g_context = grad_output @ module.out_proj.weight.detach()  # (B, L, E) @ (E, E)
        s_q, s_k, s_v = torch.autograd.grad(context, (q, k, v), g_context)
    grads = (s_q, s_k, s_v)
    return _contributions(module, xs, grads, grad_output, context.detach(), self_attention)


def _contributions(
    module: nn.MultiheadAttention,
    xs: tuple[Tensor, Tensor, Tensor],
    grads: tuple[Tensor, Tensor, Tensor],
    grad_output: Tensor,
    context: Tensor,
    self_attention: bool,
) -> dict[str, Contribution]:
    """Each parameter's per-example gradient from the projections' inputs ``xs`` (query, key,
    value, (B, T, E) each) and the output gradients ``grads`` at q, k, v (k and v with the
    learned bias column last, when the module has one); the output projection's from
    ``grad_output`` and the attention's ``context`` (B, L, E)."""
    query, key, _ = xs
    s_q, s_k, s_v = grads
    b, length, e = query.shape
    out: dict[str, Contribution] = {}
    src = key.shape[1]
    if module.bias_k is not None:
        out["bias_k"] = Dense(s_k[:, src].view(b, 1, 1, e))
        out["bias_v"] = Dense(s_v[:, src].view(b, 1, 1, e))
        s_k, s_v = s_k[:, :src], s_v[:, :src]  # (B, S, E)
    if not module._qkv_same_embed_dim:
        for name, s, x in zip(("q", "k", "v"), (s_q, s_k, s_v), xs, strict=True):
            w = getattr(module, f"{name}_proj_weight")
            out[f"{name}_proj_weight"] = Outer(s[:, None], x[:, None], w.shape)  # (B, 1, T, E)
    elif self_attention:
        s = torch.cat([s_q, s_k, s_v], -1)[:, None]  # (B, 1, L, 3E): the packed rows q, k, v
        out["in_proj_weight"] = Outer(s, query[:, None], module.in_proj_weight.shape)
    else:
        # three groups of the packed (3E, E) weight, each with its own input; padding positions
        # to one length adds zero terms
        t = max(length, src)
        s = torch.stack([F.pad(x, (0, 0, 0, t - x.shape[1])) for x in (s_q, s_k, s_v)], 1)
        a = torch.stack([F.pad(x, (0, 0, 0, t - x.shape[1])) for x in xs], 1)
        out["in_proj_weight"] = Outer(s, a, module.in_proj_weight.shape)  # (B, 3, T, E) each
    if module.in_proj_bias is not None:
        out["in_proj_bias"] = Dense(torch.cat([s.sum(1) for s in (s_q, s_k, s_v)], -1))  # (B, 3E)
    out["out_proj.weight"] = Outer(
        grad_output[:, None], context[:, None], module.out_proj.weight.shape
    )  # (B, 1, L, E) each
    if module.out_proj.bias is not None:
        out["out_proj.bias"] = Dense(grad_output.sum(1))  # (B, E)
    return out
