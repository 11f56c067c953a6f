"""The models of ``tests/engine/test_computed.py``: parameters read through tensors computed from
them, and read in layouts other than one row per example."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

D, T = 6, 4


class StateSpace(nn.Module):
    """Mamba's discretisation: ``A = -exp(A_log)`` indexed and multiplied into the batch, a skip
    ``D`` read broadcast, and the same ``A`` read twice; RWKV's running maximum, whose state
    starts as a (B, D) tensor of no example's (``zeros_like(k[:, 0]) - 1e38``), so that
    ``maximum(state + decay, k)`` first reads a tensor computed from the parameter."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, D)
        self.A_log = nn.Parameter(torch.randn(D, 2) * 0.3)
        self.D = nn.Parameter(torch.randn(D))
        self.decay = nn.Parameter(torch.randn(D))

    def forward(self, x: Tensor) -> Tensor:  # (B, T, 3)
        h = self.fc(x)  # (B, T, D)
        a = -torch.exp(self.A_log.float()).to(h.dtype)  # (D, 2)
        decay = torch.exp(a[None, None, :, :] * h[..., None])  # (B, T, D, 2)
        state, w = torch.zeros_like(h[:, 0]) - 1e38, -torch.exp(self.decay)
        for t in range(T):
            state = torch.maximum(state + w, h[:, t])
        return decay.sum(-1).sum(1) + h.sum(1) * self.D + a.sum(-1) + state


class WeightNormed(nn.Module):
    """A weight-norm Linear and Conv1d: the weight ``g * v / ||v||`` is computed each forward
    (``torch._weight_norm``) and read by ``F.linear`` and ``F.conv1d``."""

    def __init__(self):
        super().__init__()
        self.lin = nn.utils.parametrizations.weight_norm(nn.Linear(3, D))
        self.conv = nn.utils.parametrizations.weight_norm(nn.Conv1d(D, D, 3, padding=1), dim=2)
        self.head = nn.Linear(D, 2)

    def forward(self, x: Tensor) -> Tensor:  # (B, T, 3)
        h = self.lin(x).transpose(1, 2)  # (B, D, T)
        return self.head(torch.tanh(self.conv(h)).mean(-1))


class Tables(nn.Module):
    """A position table gathered by ``arange`` and added, attention sinks reshaped, expanded and
    concatenated to each example's scores, and a scalar mixing weight computed from two vectors
    (DiffLlama's lambda)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, D)
        self.table = nn.Parameter(torch.randn(2 * T, D))
        self.sinks = nn.Parameter(torch.randn(2))
        self.lq, self.lk = nn.Parameter(torch.randn(D)), nn.Parameter(torch.randn(D))

    def forward(self, x: Tensor) -> Tensor:  # (B, T, 3)
        b = x.shape[0]
        h = self.fc(x) + self.table[torch.arange(T) + 1]  # (B, T, D)
        scores = (h @ h.transpose(1, 2)).view(b, 1, T, T).expand(b, 2, T, T)
        sinks = self.sinks.reshape(1, -1, 1, 1).expand(b, -1, T, 1)
        probs = torch.cat([scores, sinks], -1).softmax(-1)[..., :T]  # (B, 2, T, T)
        lam = torch.exp(torch.sum(self.lq * self.lk))
        out = probs[:, 0] @ h - lam * (probs[:, 1] @ h)
        return out.sum(1)


class FunctionalConv(nn.Module):
    """Raw weights read by ``F.conv2d`` (groups, stride, ``"same"`` padding, a flipped copy)
    and ``F.conv1d`` (dilation), no conv module anywhere."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 4 * 5)
        self.w = nn.Parameter(torch.randn(4, 2, 3, 3) * 0.3)
        self.b = nn.Parameter(torch.randn(4))
        self.w1 = nn.Parameter(torch.randn(3, 4, 2) * 0.3)

    def forward(self, x: Tensor) -> Tensor:  # (B, T, 3)
        h = self.fc(x).view(x.shape[0], T, 4, 5).transpose(1, 2)  # (B, 4, T, 5)
        h = torch.tanh(F.conv2d(h, self.w, self.b, stride=(1, 2), padding=1, groups=2))
        h = F.conv2d(h, self.w.flip(-1), padding="same", groups=2)  # (B, 4, T, 3)
        return F.conv1d(h.flatten(2), self.w1, dilation=2).mean(-1)  # (B, 3)


class Standardized(nn.Module):
    """BiT's and timm's weight-standardised convolutions: each output channel of the weight
    normalised by ``F.batch_norm`` of its reshape (no running statistics, no affine), reshaped
    back (``reshape_as`` the parameter itself) and read by a grouped, strided ``F.conv2d``; a
    conv1d weight flattened, unsqueezed, standardised, squeezed and viewed back."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 4 * 5)
        self.w = nn.Parameter(torch.randn(6, 2, 3, 3))
        self.w1 = nn.Parameter(torch.randn(3, 6, 2))

    def forward(self, x: Tensor) -> Tensor:  # (B, T, 3)
        h = self.fc(x).view(x.shape[0], T, 4, 5).transpose(1, 2)  # (B, 4, T, 5)
        w = F.batch_norm(self.w.reshape(1, 6, -1), None, None, training=True, momentum=0.0)
        h = F.conv2d(h, w.reshape_as(self.w), stride=(1, 2), padding=1, groups=2)  # (B, 6, T, 3)
        w1 = self.w1.flatten(1).unsqueeze(0)  # (1, 3, 12)
        w1 = F.batch_norm(w1, None, None, None, None, True, 0.0, 1e-3).squeeze(0).view(3, 6, 2)
        return F.conv1d(torch.tanh(h).flatten(2), w1, dilation=2).mean(-1)  # (B, 3)


class Windows(nn.Module):
    """Swin's attention: each example's tokens folded into windows along dimension 0, a relative
    position bias gathered from a table by an index buffer and added to every window's scores,
    and a shift added to the windows in a shuffled order."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, D)
        self.table = nn.Parameter(torch.randn(3, 2))  # 3 relative offsets, 2 heads
        self.register_buffer("index", torch.tensor([[1, 2], [0, 1]]))
        self.shift = nn.Parameter(torch.randn(1, 1, D))

    def forward(self, x: Tensor) -> Tensor:  # (B, T, 3)
        b = x.shape[0]
        h = self.fc(x).view(b * 2, T // 2, D)  # (B * windows, 2, D)
        bias = self.table[self.index.view(-1)].view(2, 2, 2).permute(2, 0, 1)  # (heads, 2, 2)
        scores = (h @ h.transpose(1, 2)).unsqueeze(1) + bias.unsqueeze(0)  # (B*w, heads, 2, 2)
        h = scores.softmax(-1).sum(1) @ h  # (B * windows, 2, D)
        order = torch.arange(b * 2).flip(0)
        h = h[order] + self.shift  # rows shuffled, each one example's
        return h[order.argsort()].view(b, T, D).sum(1)


class ReadsAround(nn.Module):
    """A probe repeated to the batch (SigLIP's pooling head), a layer's weight applied from the
    left (Mamba's ``dt_proj.weight @ x.transpose(1, 2)``), and a bias table as the additive mask
    of ``F.scaled_dot_product_attention`` on windows (Swin), causal too."""

    def __init__(self):
        super().__init__()
        self.fc, self.dt = nn.Linear(3, D), nn.Linear(D, D)
        self.probe = nn.Parameter(torch.randn(1, 1, D))
        self.table = nn.Parameter(torch.randn(2 * T, 2))

    def forward(self, x: Tensor) -> Tensor:  # (B, T, 3)
        b = x.shape[0]
        h = self.fc(x)  # (B, T, D)
        h = h + (self.dt.weight @ h.transpose(1, 2)).transpose(1, 2)
        q = self.probe.repeat(b, 1, 1)  # (B, 1, D)
        pooled = F.scaled_dot_product_attention(q, h, h).squeeze(1)  # (B, D)
        windows = h.reshape(b * 2, 1, T // 2, D).expand(-1, 2, -1, -1)  # (B*2, heads, 2, D)
        index = torch.arange(T // 2)
        bias = self.table[index[:, None] - index[None, :] + T].permute(2, 0, 1)  # (heads, 2, 2)
        att = F.scaled_dot_product_attention(windows, windows, windows, attn_mask=bias)
        att = F.scaled_dot_product_attention(att, att, att, attn_mask=bias.exp(), is_causal=False)
        return pooled + att.sum((1, 2)).view(b, 2, D).sum(1)


class FusedExperts(nn.Module):
    """Llama 4's experts: every token through every expert, (E, N, in) @ (E, in, out) by
    ``torch.bmm`` and by ``@``, the tokens of one example spread over the rows."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, D)
        self.gate_up = nn.Parameter(torch.randn(2, D, 2 * D) * 0.3)
        self.down = nn.Parameter(torch.randn(2, D, D) * 0.3)

    def forward(self, x: Tensor) -> Tensor:  # (B, T, 3)
        h = self.fc(x).reshape(-1, D)  # (B*T, D)
        routed = h[None].expand(2, -1, -1)  # (E, B*T, D)
        gate, up = torch.bmm(routed, self.gate_up).chunk(2, -1)
        out = (torch.tanh(gate) * up) @ self.down  # (E, B*T, D)
        return out.sum(0).view(x.shape[0], T, D).sum(1)


class Lookups(nn.Module):
    """Tables indexed by the batch's ids (``W[ids]``: an embedding by another name), by
    position ids expanded to the batch (Whisper's decoder positions), grouped heads of a
    Linear's weight viewed as (G, out, in) and run by ``bmm`` (DeepSeek-V4's grouped linear),
    and a vector written where an id is 0 (T5Gemma 2's end-of-image embedding)."""

    def __init__(self):
        super().__init__()
        self.tokens, self.positions = (
            nn.Parameter(torch.randn(7, D)),
            nn.Parameter(torch.randn(T, D)),
        )
        self.grouped = nn.Linear(D // 2, 3, bias=False)
        self.eoi = nn.Parameter(torch.randn(D))

    def forward(self, ids: Tensor) -> Tensor:  # (B, T) ints
        b = ids.shape[0]
        h = self.tokens[ids] + self.positions[torch.arange(T).expand(b, T)]  # (B, T, D)
        h[ids == 0] = self.eoi.to(h.dtype)
        w = self.grouped.weight.view(1, 3, D // 2).expand(2, -1, -1).transpose(1, 2)  # (2, D/2, 3)
        out = torch.bmm(h.reshape(b * T, 2, D // 2).transpose(0, 1), w)  # (2, B*T, 3)
        return out.transpose(0, 1).reshape(b, T, 6).sum(1)


class RelativeBias(nn.Module):
    """T5's relative position bias: an ``nn.Embedding`` (a module with a rule) called on a
    (T, T) table of buckets made from ``arange``, the batch's shared table, then added to two
    layers' scores, the second in place."""

    def __init__(self):
        super().__init__()
        self.fc, self.bias = nn.Linear(3, D), nn.Embedding(2 * T, 2)

    def forward(self, x: Tensor) -> Tensor:  # (B, T, 3)
        h = self.fc(x)
        buckets = torch.arange(T)[None, :] - torch.arange(T)[:, None] + T  # (T, T)
        position_bias = self.bias(buckets).permute(2, 0, 1).unsqueeze(0)  # (1, heads, T, T)
        for _ in range(2):
            scores = (h @ h.transpose(1, 2)).unsqueeze(1).expand(-1, 2, -1, -1).clone()
            scores += position_bias
            h = scores.softmax(-1).mean(1) @ h
        return h.sum(1)


class Einsums(nn.Module):
    """SAM's decomposed relative positions (``einsum("bhwc,hkc->bhwk", q, R)``, R gathered
    from a table by an index buffer; heads in their own dimension or folded into the batch) and
    Funnel's position projection (``einsum("td,dnh->tnh",
    r, kernel)`` on a table, then with the batch's queries), the parameter first and second."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, D)
        self.rel = nn.Parameter(torch.randn(2 * T, D // 2))
        self.kernel = nn.Parameter(torch.randn(D // 2, 2, D // 2))
        self.register_buffer("index", torch.arange(T)[:, None] - torch.arange(T)[None, :] + T)

    def forward(self, x: Tensor) -> Tensor:  # (B, T, 3)
        b = x.shape[0]
        q = self.fc(x).view(b, T, 2, D // 2).transpose(1, 2)  # (B, heads, T, D/2)
        r = self.rel[self.index]  # (T, T, D/2): computed
        att = torch.einsum("bhwc,wkc->bhwk", q, r)  # (B, heads, T, T)
        folded = q.reshape(b * 2, T, D // 2)  # heads folded into the batch, as SAM's
        att = att + torch.einsum("bwc,wkc->bwk", folded, r).view(b, 2, T, T)
        heads = torch.einsum("td,dnh->tnh", self.rel[:T], self.kernel)  # (T, 2, D/2): computed
        pos = torch.einsum("tnh,bnih->bnit", heads, q)  # the parameter first
        return att.sum((1, 3)) + pos.sum((1, 2))


class HeadsFirst(nn.Module):
    """Zamba's per-head projections ``W[:, None] @ x`` of heads-first (heads, B, in, T) states,
    Recurrent Gemma's gates ``baddbmm(b[:, None, :], x, W)`` of (heads, B*T, w) rows, and
    wav2vec2-Conformer's relative positions: a Linear on a table no example owns, (1, heads, in,
    T) after a permute, multiplied by each example's queries ``q @ proj``."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, D)
        self.x_proj = nn.Parameter(torch.randn(2, 4, D // 2))  # (heads, out, in)
        self.gate_w = nn.Parameter(torch.randn(2, D // 2, D // 2))  # (heads, w, w)
        self.gate_b = nn.Parameter(torch.randn(2, D // 2))
        self.pos = nn.Linear(D // 2, D, bias=False)
        self.register_buffer("table", torch.randn(1, T, D // 2))

    def forward(self, x: Tensor) -> Tensor:  # (B, T, 3)
        b = x.shape[0]
        h = self.fc(x)  # (B, T, D)
        states = h.view(b, T, 2, D // 2).permute(2, 0, 3, 1)  # (heads, B, in, T)
        projected = self.x_proj[:, None] @ states  # (heads, B, out, T)
        rows = h.reshape(b * T, 2, D // 2).permute(1, 0, 2)  # (heads, B*T, w)
        gates = torch.baddbmm(self.gate_b[:, None, :], rows, self.gate_w).sigmoid()
        gates = gates.transpose(0, 1).reshape(b, T, D)
        proj = self.pos(self.table).view(1, T, 2, D // 2).permute(0, 2, 3, 1)  # (1, 2, D/2, T)
        rel = h.view(b, T, 2, D // 2).transpose(1, 2) @ proj  # (B, heads, T, T)
        return projected.sum((0, 2)) + (gates * h).sum(-1) + rel.sum((1, 3))


class MaskedBias(nn.Module):
    """LongT5's local attention: a relative bias (1, heads, T, T) plus a mask made in the forward
    from the batch's shape (no example's), a (B, heads, T, T) tensor computed from the
    parameter, added to the scores in place; and a router cast to its own dtype first (Switch
    Transformers': ``Module.to`` sets ``p.data = p``)."""

    def __init__(self):
        super().__init__()
        self.fc, self.router = nn.Linear(3, D), nn.Linear(D, 2)
        self.bias = nn.Parameter(torch.randn(1, 2, T, T))

    def forward(self, x: Tensor) -> Tensor:  # (B, T, 3)
        h = self.fc(x)
        mask = torch.ones(x.shape[0], T, dtype=torch.bool, device=x.device)
        mask = torch.where(mask[:, None, None, :], 0.0, -1e10).to(h.dtype)  # (B, 1, 1, T)
        position_bias = self.bias + mask
        scores = (h @ h.transpose(1, 2)).unsqueeze(1).expand(-1, 2, -1, -1).clone()
        scores += position_bias
        h = scores.softmax(-1).mean(1) @ h
        self.router.to(h.dtype)
        return h.sum(1) * self.router(h).softmax(-1).sum((1, 2))[:, None]


class RelativeWindow(nn.Module):
    """VITS's relative positions: a (1, 2w + 1, d) table padded and sliced to (1, 2T - 1, d),
    one matrix for every (example, head), multiplied by the queries (``q @ rel.mT``, a matmul
    of 3-D tensors that is no experts' ``bmm``) and by the weights skewed to relative positions
    (``w @ rel``)."""

    def __init__(self):
        super().__init__()
        self.q = nn.Linear(3, D)
        self.emb_rel_k = nn.Parameter(torch.randn(1, 5, D // 2))
        self.emb_rel_v = nn.Parameter(torch.randn(1, 5, D // 2))

    def relative(self, table: Tensor) -> Tensor:
        pad = max(T - 3, 0)
        return F.pad(table, [0, 0, pad, pad])[:, max(3 - T, 0) : max(3 - T, 0) + 2 * T - 1]

    def forward(self, x: Tensor) -> Tensor:  # (B, T, 3)
        b = x.shape[0]
        q = self.q(x).view(b, T, 2, D // 2).transpose(1, 2).reshape(b * 2, T, D // 2)
        logits = q @ self.relative(self.emb_rel_k).mT  # (2B, T, 2T - 1)
        w = torch.softmax(logits[..., :T], -1)  # (2B, T, T)
        w = F.pad(F.pad(w, [0, T - 1]).view(b * 2, -1), [T, 0]).view(b * 2, T, 2 * T)[..., 1:]
        out = torch.matmul(w, self.relative(self.emb_rel_v))  # (2B, T, D/2)
        return out.reshape(b, 2, T, -1).sum((1, 2))
