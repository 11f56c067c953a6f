"""Toys of last round's engine paths for the CLI's tests (``test_cli_engine_paths.py``), each
taking (B, T, 8) features to 3 classes: BiT's weight-standardised convolutions beside a group
and a batch norm (``engine/backs.py``), LongT5's position bias added to each example's mask
(elements each one example's), and Ergo's rows repeated per route and experts looped over by
``unique`` (the row flow)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

H, HEADS, E, K, CLASSES = 8, 2, 3, 2, 3


class StdConv(nn.Conv2d):
    """BiT's ``WeightStandardizedConv2d``: each output channel of the weight standardised by
    ``F.batch_norm`` of its reshape, read by the convolution."""

    def forward(self, x: Tensor) -> Tensor:
        w = self.weight.reshape(1, self.out_channels, -1)  # (1, out, in * k * k)
        w = F.batch_norm(w, None, None, training=True, momentum=0.0, eps=1e-8)
        return F.conv2d(x, w.reshape_as(self.weight), self.bias, self.stride, self.padding)


class BiT(nn.Module):
    """Standardised convolutions, a GroupNorm and a BatchNorm2d of running statistics."""

    def __init__(self):
        super().__init__()
        self.stem, self.gn = StdConv(1, 4, 3, padding=1, bias=False), nn.GroupNorm(2, 4)
        self.conv, self.bn = StdConv(4, 4, 3, stride=2, padding=1), nn.BatchNorm2d(4)
        self.head = nn.Linear(4, CLASSES)
        self.bn.running_mean.uniform_(-0.5, 0.5)  # statistics a pass must leave as they are
        self.bn.running_var.uniform_(0.5, 1.5)

    def forward(self, x: Tensor) -> Tensor:  # (B, T, 8): one channel of T x 8
        h = torch.relu(self.gn(self.stem(x.unsqueeze(1))))  # (B, 4, T, 8)
        h = torch.relu(self.bn(self.conv(h)))  # (B, 4, ceil(T / 2), 4)
        return self.head(h.mean((2, 3)))


class LocalBias(nn.Module):
    """LongT5's local attention: a relative position bias looked up for the batch (1, heads,
    T, T) and added to each example's mask (B, 1, 1, T), every element of the sum one
    example's, then to the scores."""

    def __init__(self):
        super().__init__()
        self.qkv, self.bias = nn.Linear(H, 3 * H), nn.Embedding(15, HEADS)
        self.head = nn.Linear(H, CLASSES)

    def forward(self, x: Tensor) -> Tensor:  # (B, T, 8)
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, HEADS, -1).permute(2, 0, 3, 1, 4)  # (B, heads, T, d)
        at = torch.arange(t)
        position = self.bias(at[None] - at[:, None] + 7).permute(2, 0, 1)[None]  # (1, h, T, T)
        mask = -(x[..., 0] > 1).to(x.dtype)[:, None, None]  # (B, 1, 1, T)
        scores = q @ k.transpose(-1, -2) + (position + mask)  # (B, heads, T, T)
        h = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, H)
        return self.head(h.mean(1))


class Routed(nn.Module):
    """Ergo's experts: each token's row repeated once per route (``repeat_interleave``), the
    experts routed to looped over by ``unique``, each one's rows picked by ``where``."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList(nn.Linear(H, H) for _ in range(E))

    def forward(self, flat: Tensor) -> Tensor:  # (N, H)
        weights, index = self.gate(flat).softmax(-1).topk(K, dim=-1)  # (N, K) each
        rows, routes, weights = flat.repeat_interleave(K, dim=0), index.flatten(), weights.flatten()
        out = torch.zeros_like(rows)  # (N K, H)
        for e in routes.unique():
            (picked,) = torch.where(routes == e)
            out = out.index_add(
                0, picked, self.experts[int(e)](rows[picked]) * weights[picked, None]
            )
        return out.view(-1, K, H).sum(1)  # (N, H)


class Ergo(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.moe, self.head = nn.Linear(H, H), Routed(), nn.Linear(H, CLASSES)

    def forward(self, x: Tensor) -> Tensor:  # (B, T, 8)
        h = self.inp(x)
        return self.head((h + self.moe(h.reshape(-1, H)).view_as(h)).mean(1))
