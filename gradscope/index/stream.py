"""Scores of every indexed example against projected references, the shards streamed through
matrix products: memory holds one chunk of rows and a few numbers per example, never the index."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
from torch import Tensor

from ..errors import DataError
from .reader import Shards

CHUNK_ELEMENTS = 1 << 24  # floats in one chunk of rows, and in its (rows, references) scores


class Scores:
    """``score[i, r] = phi_i . psi_r``, or the cosine with ``normalize``; NaN where the indexed
    example's loss or gradient was not finite and, for the cosine, where a gradient is zero
    (as ``influence`` has it: ranked last)."""

    def __init__(self, shards: Shards, psi: Tensor, normalize: bool = False):
        self.shards, self.normalize = shards, normalize
        ids = shards.ids(["norm", "finite"])
        norm, finite = ids["norm"].to_numpy(), ids["finite"].to_numpy()
        if not (norm[finite] >= 0).all():  # NaN too: a row the index marks finite
            name = shards.manifest["ids"]
            raise DataError(
                f"{name} holds a negative or NaN norm for a finite row: not what an index writes",
                str(shards.path / name),
            )
        scale = np.where(norm > 0, 1.0, np.nan) if normalize else norm
        scale = np.where(finite, scale, np.nan)
        self.scale = torch.from_numpy(scale).to(psi.device, torch.float32)  # (N,)
        psi = psi.float()
        if normalize:  # unit rows against unit references: the cosine (0 / 0 for a zero one)
            psi = psi / torch.linalg.vector_norm(psi, dim=1, keepdim=True)
        self.psi_t = psi.T.contiguous()  # (width, R)
        self.rows = max(1, CHUNK_ELEMENTS // max(shards.width, psi.shape[0]))

    def chunks(self) -> Iterator[tuple[int, Tensor]]:
        """(first row, (n, R) float32 scores), in index order."""
        device = self.psi_t.device
        for start, rows in self.shards.chunks(self.rows):
            x = torch.from_numpy(rows).to(device, torch.float32)  # (n, width)
            yield start, (x @ self.psi_t) * self.scale[start : start + len(x), None]

    def every(self) -> np.ndarray:
        """(N,) float64 scores against the one reference."""
        return torch.cat([s[:, 0].double().cpu() for _, s in self.chunks()]).numpy()

    def top(self, k: int) -> tuple[Tensor, Tensor]:
        """(k', R) the highest scores per reference, highest first, and their index rows
        (k' = min(k, N)); a NaN score ranks below every number."""
        values = rows = None
        for start, s in self.chunks():
            s = torch.nan_to_num(s, nan=-torch.inf)
            at = torch.arange(start, start + len(s), device=s.device)[:, None].expand_as(s)
            if values is not None:
                s, at = torch.cat([values, s]), torch.cat([rows, at])
            values, picked = torch.topk(s, min(k, len(s)), dim=0)  # (k, R)
            rows = at.gather(0, picked)
        return values, rows
