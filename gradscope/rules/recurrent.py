"""nn.RNN, nn.GRU and nn.LSTM in eval mode: the recurrence unrolled once more from the captured
input, one local backward to each step's gate pre-activations, then the Linear math per step.

Every weight of a recurrent layer enters through ``gi_t = x_t W_ihᵀ + b_ih`` or
``gh_t = h_(t-1) W_hhᵀ + b_hh`` (per layer and direction), so with ``s`` the gradient at those
pre-activations, ``G_i(W_ih) = Σ_t s_it x_itᵀ`` and ``G_i(W_hh) = Σ_t s'_it h_i(t-1)ᵀ``: the
``Outer`` of the Linear rule, over the time steps. The unrolled recurrence reproduces torch's
kernels (checked against the per-example loop); the layer's second output (the last hidden
state) reaching the loss sends its parameters to the fallback, as for attention weights.

On a packed sequence (the capture spreads it: data, batch sizes, the sorting's indices) each
example's rows are padded back into (B, T, I), in example order, and a step past an example's
length leaves its state as it was, as the packed kernels run it.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence, pad_packed_sequence

from .base import Contribution, Dense
from .outer import Outer
from .registry import register_rule

_Recurrent = nn.RNN | nn.GRU | nn.LSTM


def _batch_dim(module: _Recurrent, inputs: tuple[Tensor, ...]) -> int | None:
    if inputs[0].dim() != 3:
        return None  # an unbatched (T, I) call
    return 0 if module.batch_first else 1


def _packed(inputs: tuple[Tensor, ...]) -> bool:
    """Whether a call's inputs are a packed sequence's four tensors, then hx (an RNN's forward
    takes at most two tensors else: input and hx)."""
    return len(inputs) >= 4


def slots(sizes: Tensor, device: torch.device) -> Tensor:
    """(N,) the slot of each row of a packed sequence's data: row j of its step (the steps'
    rows one after another, ``sizes[t]`` of step t). Made once for each batch sizes (on the
    host, as a packed sequence keeps them) and device: never write into it."""
    return _slots(tuple(sizes.tolist()), device)


@functools.lru_cache(maxsize=256)
def _slots(sizes: tuple[int, ...], device: torch.device) -> Tensor:
    counts = torch.tensor(sizes, dtype=torch.long)
    starts = counts.cumsum(0) - counts  # (T,) each step's first row
    steps = torch.repeat_interleave(torch.arange(len(sizes)), counts)  # (N,)
    return (torch.arange(len(steps)) - starts[steps]).to(device)


def _bags(module: _Recurrent, inputs: tuple[Tensor, ...], kwargs: dict):
    """For the engine: the example of each row of a packed sequence's data, by its sorting
    (``Rule.bags``), and the batch; None for a call on a padded tensor."""
    if not _packed(inputs):
        return None
    _, sizes, order, _ = inputs[:4]
    return order[slots(sizes, order.device)], order.shape[0]


def _unpacked(inputs: tuple[Tensor, ...], grad_output: Tensor):
    """(B, T, I) input, (B, T, D*H) output gradient and (B, T) steps within each length, of a
    packed sequence, in example order."""
    data, sizes, order, inverse = inputs[:4]

    def pad(rows: Tensor) -> tuple[Tensor, Tensor]:
        return pad_packed_sequence(PackedSequence(rows, sizes, order, inverse), True)

    x, lengths = pad(data)
    grad, _ = pad(grad_output)
    steps = torch.arange(x.shape[1], device=x.device)
    return x, grad, steps < lengths.to(x.device)[:, None]


def _cell(module: _Recurrent, gi: Tensor, gh: Tensor, h: Tensor, c: Tensor | None):
    """One step from the pre-activations: the new (h, c)."""
    if isinstance(module, nn.LSTM):
        i, f, g, o = (gi + gh).chunk(4, -1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        return torch.sigmoid(o) * torch.tanh(c), c
    if isinstance(module, nn.GRU):
        (ri, zi, ni), (rh, zh, nh) = gi.chunk(3, -1), gh.chunk(3, -1)
        r, z = torch.sigmoid(ri + rh), torch.sigmoid(zi + zh)
        n = torch.tanh(ni + r * nh)
        return (1 - z) * n + z * h, None
    act = torch.tanh if module.nonlinearity == "tanh" else torch.relu
    return act(gi + gh), None


def _step(module: _Recurrent, gi: Tensor, gh: Tensor, h: Tensor, c, active: Tensor | None):
    """``_cell``, the state kept where a step is past the example's length (``active`` (B,))."""
    new_h, new_c = _cell(module, gi, gh, h, c)
    if active is None:
        return new_h, new_c
    keep = active[:, None]
    return torch.where(keep, new_h, h), None if c is None else torch.where(keep, new_c, c)


def _initial(module: _Recurrent, hx: object, b: int, like: Tensor) -> tuple[Tensor, Tensor | None]:
    """(h0, c0) as (layers * directions, B, H), zeros where not given."""
    h0, c0 = (hx if isinstance(hx, tuple) else (hx, None)) if hx is not None else (None, None)
    d = 2 if module.bidirectional else 1
    zeros = like.new_zeros(module.num_layers * d, b, module.hidden_size)
    h0 = zeros if h0 is None else h0.detach()
    if isinstance(module, nn.LSTM):
        c0 = zeros if c0 is None else c0.detach()
    return h0, c0


@register_rule(nn.RNN, nn.GRU, nn.LSTM, name="recurrent", batch_dim=_batch_dim, bags=_bags)
def recurrent(
    module: _Recurrent, inputs: tuple[Tensor, ...], grad_output: Tensor, hx: object = None
) -> dict[str, Contribution]:
    packed, active = _packed(inputs), None
    if getattr(module, "proj_size", 0) or inputs[0].dim() != 3 - packed:
        raise NotImplementedError("proj_size or an unbatched input")
    if packed:
        hx = inputs[4] if len(inputs) > 4 else hx  # in example order, as given
        x, grad_output, active = _unpacked(inputs, grad_output)  # (B, T, I), (B, T)
    else:
        hx = inputs[1] if len(inputs) > 1 else hx
        x = inputs[0] if module.batch_first else inputs[0].transpose(0, 1)  # (B, T, I)
        grad_output = grad_output if module.batch_first else grad_output.transpose(0, 1)
    b, t, _ = x.shape
    h0, c0 = _initial(module, hx, b, x)
    directions = ("", "_reverse") if module.bidirectional else ("",)
    layer_in, steps = x.detach(), []  # steps: (suffix, input (B, T, in), gi list, gh list, h_prev)
    with torch.enable_grad():
        for layer in range(module.num_layers):
            outs = []
            for k, rev in enumerate(directions):
                suffix = f"_l{layer}{rev}"
                w_ih, w_hh = (getattr(module, f"weight_{n}{suffix}").detach() for n in ("ih", "hh"))
                b_ih, b_hh = (
                    (getattr(module, f"bias_{n}{suffix}").detach() for n in ("ih", "hh"))
                    if module.bias
                    else (None, None)
                )
                h = h0[layer * len(directions) + k]
                c = None if c0 is None else c0[layer * len(directions) + k]
                gis, ghs, prev, hs = [], [], [], [None] * t
                for step in reversed(range(t)) if rev else range(t):
                    gi = nn.functional.linear(layer_in[:, step], w_ih, b_ih).requires_grad_()
                    gh = nn.functional.linear(h, w_hh, b_hh).requires_grad_()
                    prev.append(h)
                    h, c = _step(module, gi, gh, h, c, None if active is None else active[:, step])
                    gis.append(gi)
                    ghs.append(gh)
                    hs[step] = h
                order = slice(None, None, -1) if rev else slice(None)  # back to time order
                steps.append((suffix, layer_in, gis[order], ghs[order], prev[order]))
                outs.append(torch.stack(hs, 1))  # (B, T, H)
            layer_in = torch.cat(outs, -1)  # (B, T, directions * H)
        wanted = [g for _, _, gis, ghs, _ in steps for g in (*gis, *ghs)]
        grads = iter(torch.autograd.grad(layer_in, wanted, grad_output, allow_unused=True))
    out: dict[str, Contribution] = {}
    for suffix, inp, gis, ghs, prev in steps:
        s_i = torch.stack([_zero_if_none(next(grads), g) for g in gis], 1)  # (B, T, gates*H)
        s_h = torch.stack([_zero_if_none(next(grads), g) for g in ghs], 1)
        hp = torch.stack([p.detach() for p in prev], 1)  # (B, T, H): the state each step read
        out[f"weight_ih{suffix}"] = Outer(
            s_i[:, None], inp.detach()[:, None], (s_i.shape[-1], inp.shape[-1])
        )
        out[f"weight_hh{suffix}"] = Outer(s_h[:, None], hp[:, None], (s_h.shape[-1], hp.shape[-1]))
        if module.bias:
            out[f"bias_ih{suffix}"], out[f"bias_hh{suffix}"] = Dense(s_i.sum(1)), Dense(s_h.sum(1))
    return out


def _zero_if_none(grad: Tensor | None, like: Tensor) -> Tensor:
    return torch.zeros_like(like) if grad is None else grad
