"""Rows in another layout than one per example, gathered per example for a row-by-row rule.

The analysis finds which example each row of a call belongs to (owner tensors, ``analysis/``)
and keeps the answer as one of two layouts, which the pass then applies to the call's input and
output gradient with no further question about owners, and no host sync:

- ``Lanes``: the batch along one dimension (sequence-first, (T*B) rows, heads folded into the
  batch): a reshape, every example as many rows;
- ``Gather``: any other map of rows to examples (an expert's routed tokens): each example's rows
  gathered in order and padded with zeros to the longest, with each example's row count.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Lanes:
    """Row r of dimension ``dim`` (of ``rows`` leading row dimensions) is example (r // m) % B."""

    dim: int
    m: int
    rows: int

    def apply(self, batch: int, *tensors: Tensor) -> tuple[Tensor, ...]:
        """Each (*rows, *features) tensor as (B, L, *features): a view where it can be."""
        d, m = self.dim, self.m
        return tuple(
            t.unflatten(d, (t.shape[d] // (batch * m), batch, m))
            .movedim(d + 1, 0)
            .reshape(batch, -1, *t.shape[self.rows :])
            for t in tensors
        )


@dataclass(frozen=True)
class Gather:
    """Rows whose examples are ``own`` (N,): row j goes to slot ``slot[j]`` of its example."""

    own: Tensor  # (N,)
    slot: Tensor  # (N,)
    counts: list[int]  # rows per example
    rows: int  # leading row dimensions of the tensors gathered

    @classmethod
    def of(cls, owner: Tensor, batch: int) -> Gather:
        """The gather of rows owned by ``owner`` (*rows,), every entry an example's index."""
        own = owner.reshape(-1)  # (N,)
        order = torch.argsort(own, stable=True)
        counts = torch.bincount(own, minlength=batch)
        starts = torch.cumsum(counts, 0) - counts
        slot = torch.empty_like(own)
        slot[order] = torch.arange(own.shape[0], device=own.device) - starts[own[order]]
        return cls(own, slot, counts.tolist(), owner.dim())

    def apply(self, batch: int, *tensors: Tensor) -> tuple[Tensor, ...]:
        """Each (*rows, *features) tensor as (B, L, *features), L the most rows any example
        holds, padded with zeros."""
        longest = max(max(self.counts, default=0), 1)
        out = []
        for t in tensors:
            gathered = t.new_zeros(batch, longest, *t.shape[self.rows :])
            gathered[self.own, self.slot] = t.reshape(-1, *t.shape[self.rows :])  # (N, *feat)
            out.append(gathered)
        return tuple(out)


Layout = Lanes | Gather  # a call's rows, where not one row per example


def regroup(
    rows: Layout, batch: int, *tensors: Tensor
) -> tuple[tuple[Tensor, ...], list[int] | None]:
    """Each of ``tensors`` (*rows, *features) as (B, L, *features), each example's rows in order;
    and how many rows each example holds, None where every example holds as many (``Lanes``)."""
    counts = rows.counts if isinstance(rows, Gather) else None
    return rows.apply(batch, *tensors), counts
