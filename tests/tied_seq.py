"""A tiny sequence model whose layers' rules form each example's gradient for its norm: a
tied table and head, attention's packed projection (read, not a module's), a norm and a Linear
over positions. The watch's and the engine's training-step tests train it."""

from __future__ import annotations

import torch
from torch import nn


class TiedSeq(nn.Module):
    """Its forward: token ids (B, T) -> logits (B, T, 11)."""

    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(11, 4)
        self.attn = nn.MultiheadAttention(4, 2, batch_first=True)
        self.norm, self.ff = nn.LayerNorm(4), nn.Linear(4, 4)
        self.head = nn.Linear(4, 11, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, ids):
        h = self.tok(ids)  # (B, T, 4)
        h = h + self.attn(h, h, h, need_weights=False)[0]
        return self.head(h + torch.tanh(self.ff(self.norm(h))))  # (B, T, 11)
