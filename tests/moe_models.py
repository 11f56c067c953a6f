"""Mixtures of experts as transformers writes them, for the tests of routed regions
(``engine/passes/routed.py``): the grouped form (``grouped_mm``) and the eager loop."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from switches import Switched
from torch import Tensor, nn

H, E, INNER = 8, 4, 12  # grouped_mm: rows of 16 bytes


class Experts(Switched):
    """transformers' grouped experts: tokens sorted by expert, gathered, run by ``grouped_mm``
    on a fused 3-D weight (its transpose, or itself where ``transposed``), put back in order
    and summed over each token's top-k."""

    switches = ("shift", "extra")

    def __init__(self, transposed: bool = False, then=None, width: int = H):
        super().__init__()
        self.transposed, self.then, self.width = transposed, then or (lambda x: x), width
        self.shift = 0  # rows put back this many places on: another example's, where not 0
        up, down = (E, width, 2 * INNER), (E, INNER, width)
        if not transposed:
            up, down = (E, 2 * INNER, width), (E, width, INNER)
        self.gate_up = nn.Parameter(torch.randn(up) / width**0.5)
        self.down = nn.Parameter(torch.randn(down) / INNER**0.5)

    def _mm(self, x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
        return F.grouped_mm(x, w if self.transposed else w.transpose(-2, -1), offs=offs)

    def forward(self, x: Tensor, index: Tensor, weights: Tensor) -> Tensor:
        k = index.shape[-1]
        expert, perm = torch.sort(index.reshape(-1))
        picked = self.then(x[perm // k])
        counts = torch.histc(expert.float(), bins=E, min=0, max=E - 1)
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        gate, up = self._mm(picked, self.gate_up, offs).chunk(2, dim=-1)
        out = self._mm(F.silu(gate) * up, self.down, offs) * weights.reshape(-1)[perm, None]
        back = torch.empty_like(perm)
        back[perm] = torch.arange(perm.shape[0])
        if self.shift:  # each row put back this many places on, modulo all of them
            back = (back + self.shift) % back.shape[0]
        return out[back].view(x.shape[0], k, -1).sum(1)


class LoopExperts(Experts):
    """transformers' eager experts: a loop over the experts the batch's routing hit (read on
    the host), each ``F.linear`` of its own matrix ``W[e]`` on the tokens routed to it (or,
    ``transposed``, ``x @ W[e]`` of a W of (E, in, out): Aria's; ``biased``, plus the expert's
    row of a 2-D bias, ``b[e]``: GPT-OSS's; ``cast``, in float32 whatever the model's dtype:
    the OpenAI privacy filter's), added back in place; with ``extra``, expert 0 also reads the
    bias it holds (another parameter)."""

    def __init__(
        self, width: int = H, transposed: bool = False, biased: bool = False, cast: bool = False
    ):
        super().__init__(transposed, width=width)
        self.biased, self.cast = biased, cast
        if biased:
            self.up_bias = nn.Parameter(torch.randn(E, 2 * INNER) / 3)
        self.extra = False
        self.bias = nn.Parameter(torch.zeros(width))

    def forward(self, x: Tensor, index: Tensor, weights: Tensor) -> Tensor:
        out = torch.zeros_like(x)
        mask = F.one_hot(index, E).permute(2, 1, 0)  # (E, k, N)
        for e in (mask.sum((1, 2)) > 0).nonzero():
            e = e[0]
            pos, token = torch.where(mask[e])
            gate_up = self._by(x[token], self.gate_up[e])
            gate, up = (gate_up + self.up_bias[e] if self.biased else gate_up).chunk(2, dim=-1)
            y = self._by(F.silu(gate) * up, self.down[e]) * weights[token, pos, None]
            if self.extra and e == 0:
                y = y + self.bias
            out.index_add_(0, token, y)
        return out

    def _by(self, x: Tensor, w: Tensor) -> Tensor:
        if self.cast:
            return (x.float() @ w.float()).to(x.dtype)
        return x @ w if self.transposed else F.linear(x, w)


class Block(nn.Module):
    """A router (a Linear), its top 2 experts per token, added to the tokens."""

    def __init__(self, experts: Experts):
        super().__init__()
        self.router, self.experts = nn.Linear(experts.width, E, bias=False), experts

    def forward(self, h: Tensor) -> Tensor:
        flat = h.reshape(-1, self.experts.width)
        weights, index = torch.topk(self.router(flat).softmax(-1), 2, dim=-1)
        return h + self.experts(flat, index, weights).view(h.shape)
