"""A digest of the data each watched step fed, so that a replay over other rows than the loop
fed is refused as such before it runs: each row's targets and inputs, each a weighted sum of its
values in float64 (weights fixed by position, so rows padded with zeros at their end digest as
the unpadded row), written in the run record by the watch and computed again at replay from the
config's rows as the replay batches them."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from ..errors import DataError

GOLDEN = 0.6180339887498949  # the weights frac(k * GOLDEN) + 0.5: spread, none zero, no seed
TOLERANCE = 1e-9  # of the sum of |value| * weight: a row computed otherwise, to rounding


@functools.lru_cache(maxsize=32)
def _weights(n: int, device: torch.device) -> Tensor:
    """(n,) float64 the weight of each position of a row's flattened values."""
    k = torch.arange(n, dtype=torch.float64, device=device)
    return torch.frac(k * GOLDEN) + 0.5


def digests(
    inputs: Sequence[Tensor], targets: Tensor, scale: bool = False
) -> Tensor | tuple[Tensor, Tensor]:
    """(B, 1 + len(inputs)) float64 on the CPU: each row's digest of its targets, then of each
    input; with ``scale``, also the same sums of the values' magnitudes, what a digest computed
    otherwise is within rounding of."""
    sums, sizes = [], []
    for t in (targets, *inputs):
        flat = t.detach().reshape(t.shape[0], -1).to(torch.float64)  # (B, n)
        w = _weights(flat.shape[1], flat.device)
        sums.append(flat @ w)
        if scale:
            sizes.append(flat.abs() @ w)
    got = torch.stack(sums, 1).cpu()  # (B, k)
    return (got, torch.stack(sizes, 1).cpu()) if scale else got


Batches = Callable[[Tensor], tuple[tuple[Tensor, ...], Tensor]]  # picked -> inputs, targets


def check_fed(fed: Tensor, steps: Sequence[Tensor], batch: Batches, where: str, data: str) -> None:
    """Each step's rows as ``batch(picked)`` gives them must digest as ``fed`` (the steps'
    digests end to end, (sum of B, k)) recorded: the targets and the inputs both feed, in
    order. Else one line naming the first step and row that differ."""
    start = 0
    for t, picked in enumerate(steps):
        inputs, targets = batch(picked)
        got, size = digests(inputs, targets, scale=True)  # (B, k') each
        k = min(got.shape[1], fed.shape[1])
        want = fed[start : start + len(picked), :k]
        start += len(picked)
        apart = (got[:, :k] - want).abs() > TOLERANCE * size[:, :k] + 1e-300  # (B, k)
        if bool(apart.any()):
            i, j = (int(v) for v in apart.nonzero()[0])
            what = "targets" if j == 0 else f"input {j - 1}"
            raise DataError(
                f"the watched loop's step {t} fed row {int(picked[i])} with other {what} than "
                f"{data} holds (the data changed since the run, or the loop changed it): the "
                "replay trains on the config's rows",
                where,
            )
