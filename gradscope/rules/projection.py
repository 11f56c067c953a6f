"""Kronecker-factored projections of per-example gradients: ``phi_i = P_out^T G_i P_in``.

A parameter's gradient is read as a (rows, cols) matrix: its first ``split`` dimensions are the
rows, the others the columns (a vector is one row). ``out`` (rows, k_out) and ``inn`` (cols, k_in)
are the two factors, None where a side is kept whole (the identity). ``phi_i`` is (k_out, k_in),
flattened row by row. Each Contribution answers ``project`` from its own factored form where it
can (an Outer projects ``s`` and ``a`` first); ``dense`` is the definition, for formed gradients.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


def as_matrix(shape: Sequence[int], split: int) -> tuple[int, int]:
    """(rows, cols) of a gradient of ``shape`` read as a matrix: its first ``split`` dimensions
    are the rows, the others the columns."""
    return math.prod(shape[:split]), math.prod(shape[split:])


@dataclass(frozen=True, eq=False)
class Projection:
    """``phi = P_out^T G P_in`` for the gradient G of a parameter of ``shape``."""

    shape: torch.Size
    split: int  # the leading dimensions that are the matrix's rows
    out: Tensor | None  # (rows, k_out); None: every row kept
    inn: Tensor | None  # (cols, k_in); None: every column kept

    @property
    def rows(self) -> int:
        return as_matrix(self.shape, self.split)[0]

    @property
    def cols(self) -> int:
        return as_matrix(self.shape, self.split)[1]

    @property
    def k_out(self) -> int:
        return self.rows if self.out is None else self.out.shape[1]

    @property
    def k_in(self) -> int:
        return self.cols if self.inn is None else self.inn.shape[1]

    @property
    def dim(self) -> int:
        return self.k_out * self.k_in

    def dense(self, grads: Tensor) -> Tensor:
        """(B, *shape) gradients, formed -> (B, dim): the definition, the cheaper side first."""
        g = grads.reshape(grads.shape[0], self.rows, self.cols)  # (B, R, C)
        out = None if self.out is None else self.out.to(g.dtype)
        inn = None if self.inn is None else self.inn.to(g.dtype)
        in_first = self.rows * self.k_in * (self.cols + self.k_out)
        if inn is not None and (
            out is None or in_first <= self.k_out * self.cols * (self.rows + self.k_in)
        ):
            g = g @ inn  # (B, R, C) @ (C, k_in)
            inn = None
        if out is not None:
            g = out.T @ g  # (k_out, R) @ (B, R, c)
        if inn is not None:
            g = g @ inn  # (B, k_out, C) @ (C, k_in)
        return g.reshape(g.shape[0], -1)

    def factored(self, s: Tensor, a: Tensor) -> Tensor:
        """(B, dim) of ``G_i = sum_t s_it a_it^T`` over G groups stacked as the rows, from ``s``
        (B, G, T, O) and ``a`` (B, G, T, I) with G*O rows and I columns: both sides projected,
        then one product over the positions; no G_i formed."""
        b, g, t, o = s.shape
        a = a if self.inn is None else a @ self.inn.to(a.dtype)  # (B, G, T, k_in)
        if self.out is None:  # every row kept: each group's rows are its own
            return _outer_sum(s, a).reshape(b, -1)  # (B, G, O, k_in)
        p = self.out.to(s.dtype)
        s = s @ (p.view(g, o, -1) if g > 1 else p)  # (B, G, T, k_out)
        return _outer_sum(s.reshape(b, g * t, -1), a.reshape(b, g * t, -1)).reshape(b, -1)

    def of_view(self, index: tuple, transposed: bool) -> tuple[Projection, View] | None:
        """The projection of the view ``G[index]`` (then transposed) of this parameter, and how
        its answer goes back into this one's: where ``index`` holds ints and slices of step 1
        among the row dimensions only, and a transposed view is a matrix; else None."""
        index = tuple(index)
        while index and _whole(index[-1], self.shape[len(index) - 1]):
            index = index[:-1]  # W[e, :, :] is W[e]
        if len(index) > self.split or not all(_plain(k) for k in index):
            return None
        row_dims = self.shape[: self.split]
        picked = torch.arange(self.rows).view(row_dims)[index].flatten()  # the view's rows
        kept = sum(isinstance(k, slice) for k in index) + self.split - len(index)
        sliced = [len(range(*k.indices(n))) for n, k in zip(row_dims, index, strict=False)
                  if isinstance(k, slice)]  # fmt: skip
        shape = torch.Size(sliced) + row_dims[len(index) :] + self.shape[self.split :]
        out = None if self.out is None else self.out[picked.to(self.out.device)]
        view = View(picked, self.rows, self.k_in, self.out is None, transposed)
        if not transposed:
            return Projection(shape, kept, out, self.inn), view
        if len(shape) != 2 or kept != 1:
            return None
        # G's block is V^T for the view's gradient V: P_out^T V^T P_in = (P_in^T V P_out)^T
        return Projection(shape[::-1], 1, self.inn, out), view


def _outer_sum(x: Tensor, y: Tensor) -> Tensor:
    """(..., k, l) the sum over N of the outer products of rows (..., N, k) and (..., N, l): a
    batched product, or for one row a broadcast one (a batch of (k, 1) @ (1, l) products is
    many times slower than the multiplications it does)."""
    if x.shape[-2] == 1:
        return x[..., 0, :, None] * y[..., 0, None, :]
    return x.transpose(-1, -2) @ y


def _plain(k: object) -> bool:
    return isinstance(k, int) or (isinstance(k, slice) and k.step in (None, 1))


def _whole(k: object, n: int) -> bool:
    return isinstance(k, slice) and k.indices(n) == (0, n, 1)


@dataclass(frozen=True, eq=False)
class View:
    """How a view's projected gradient goes back into its parameter's (``Projection.of_view``)."""

    rows: Tensor  # the parameter's rows the view covers
    total: int  # the parameter's rows
    k_in: int
    whole: bool  # every row kept: the view's rows are placed among the parameter's
    transposed: bool

    def __call__(self, phi: Tensor) -> Tensor:
        """(B, the view's dim) -> (B, the parameter's dim)."""
        b = phi.shape[0]
        if self.transposed:  # the view's answer is (k_in, k_out'): turn it back
            phi = phi.view(b, self.k_in, -1).transpose(1, 2).reshape(b, -1)
        if not self.whole:
            return phi
        out = phi.new_zeros(b, self.total, self.k_in)
        out[:, self.rows.to(phi.device)] = phi.view(b, -1, self.k_in)
        return out.view(b, -1)
