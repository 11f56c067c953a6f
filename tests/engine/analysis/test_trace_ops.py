"""The owners the trace gives an op's result, against the obvious oracle: the Jacobian of the
result with respect to the batch says which examples each element depends on. Each case is an op
whose owner rule once was wrong or too coarse (the op or the family it came from in its id), and
most have a twin where the examples really do mix, which must still say MIXED."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from oracle import Case, assert_case_matches_loop
from torch import Tensor, nn

from gradscope.engine.analysis.owners import MIXED, NONE
from gradscope.engine.analysis.trace import RowTrace

B, T, D = 3, 4, 5
G = torch.Generator().manual_seed(0)
PERM = torch.randperm(B * T, generator=G)  # rows of every example, shuffled
MASK = torch.rand(B, T, 1, generator=G) > 0.4  # fixed: no example's values decide it
ALIBI = torch.arange(T * T, dtype=torch.float64).view(1, T, T)  # a bias the batch shares


def jacobian_owners(fn: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    """For each element of ``fn(x)``: the one example whose row of ``x`` it depends on, NONE
    for none, MIXED for several."""
    out = fn(x)
    jac = torch.autograd.functional.jacobian(fn, x)  # (*out, B, *rest)
    dep = jac.reshape(out.numel(), x.shape[0], -1).ne(0).any(-1)  # (numel, B)
    count, first = dep.sum(1), dep.long().argmax(1)
    owners = torch.where(count == 0, NONE, torch.where(count == 1, first, MIXED))
    return owners.reshape(out.shape)


def traced_owners(fn: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    trace = RowTrace(x.shape[0], (x,))
    with trace:
        out = fn(x)
    owners = trace.owner(out)
    assert owners.dim() == out.dim()
    return owners.expand(out.shape)


def _alibi_from_others(x: Tensor) -> Tensor:
    return x.flip(0).sum(-1, keepdim=True)  # (B, T, 1): row i from example B-1-i


def _index_added(x: Tensor, index: Tensor) -> Tensor:
    h = x.reshape(-1, D)  # (B*T, D)
    return torch.zeros_like(h).index_add(0, index, 2 * h)


def _scattered(x: Tensor) -> Tensor:
    source = x.reshape(-1, D)[PERM]  # (B*T, D): any example's row anywhere
    return x.masked_scatter(MASK, source)  # masked rows take source's rows in order


def _filled(x: Tensor) -> Tensor:
    h = x.clone()
    h.masked_fill_(MASK, x.sum())  # the fill value is computed from every example
    return h


# id -> (shape of the batch, fn, whether some element depends on several examples)
CASES: dict[str, tuple[tuple[int, ...], Callable[[Tensor], Tensor], bool]] = {
    # tril/triu write zeros: constants, not example 0 (Longformer and LED's masks)
    "tril-of-new-ones": ((B, T, T), lambda x: x + x.new_ones(T, T).tril(), False),
    # the tensor itself, flagged (transformers' enable_input_require_grads, under checkpoints)
    "requires-grad-flag": ((B, T, D), lambda x: (2 * x).requires_grad_().tanh(), False),
    "triu-of-new-ones": ((B, T, T), lambda x: x + x.new_ones(T, T).triu(1).flip(0), False),
    "tril-of-a-gram": ((B, D), lambda x: (x @ x.T).tril(-1), True),
    # numpy's axis= names the dimension (I-BERT, ImageGPT)
    "mean-axis": ((B, T, D), lambda x: x - x.mean(axis=2, keepdim=True), False),
    "mean-axis-0": ((B, T, D), lambda x: x - x.mean(axis=0, keepdim=True), True),
    "std-dim": ((B, T, D), lambda x: x * x.std(1, keepdim=True), False),
    # torch.min(x, y) is elementwise, not a reduction (Apertus's xIELU)
    "min-with-a-tensor": ((B, T), lambda x: torch.min(x, torch.tensor(1e3).double()), False),
    "min-of-two-examples": ((B, T), lambda x: torch.min(x + 1e3, x.flip(0)) * x, True),
    # the factors by keyword, the bias shared (Bloom's alibi.baddbmm(batch1=, batch2=))
    "baddbmm-keywords": (
        (B, T, D),
        lambda x: ALIBI.baddbmm(batch1=x, batch2=x.transpose(1, 2), alpha=0.5),
        False,
    ),
    "baddbmm-bias-of-others": (
        (B, T, D),
        lambda x: _alibi_from_others(x).baddbmm(x, x.transpose(1, 2)),
        True,
    ),
    "addbmm-sums-the-batch": (
        (B, B, D),
        lambda x: torch.addbmm(torch.ones(B, B).double(), x, x.transpose(1, 2)),
        True,
    ),
    "mv-of-every-example": ((B, D), lambda x: torch.mv(x[:, :B], x[:, 0]), True),
    "mv-shared-vector": ((B, D), lambda x: torch.mv(x, torch.arange(D).double()), False),
    "outer": ((B, D), lambda x: torch.outer(x[:, 0], x[1]), True),
    # the other tensor of type_as / to gives only a dtype (Funnel's mask, PEGASUS-X's arange)
    "type-as": ((B, T, D), lambda x: x + torch.arange(D).type_as(x), False),
    "to-other": ((B, T, D), lambda x: x.sum(-1).to(x) * 2, False),
    "type-as-of-the-batch-mean": ((B, T, D), lambda x: x.mean(0).type_as(x) + x, True),
    # an ellipsis in einsum (LongT5's local attention)
    "einsum-ellipsis": (
        (B, 1, T, 2, 3),
        lambda x: torch.einsum("...qhd,...khd->...hqk", x, 2 * x),
        False,
    ),
    "einsum-ellipsis-broadcast": (
        (B, T, D),
        lambda x: torch.einsum("...d,d->...", x, torch.arange(D).double()),
        False,
    ),
    "einsum-ellipsis-of-others": (
        (B, 1, T, 2, 3),
        lambda x: torch.einsum("...qhd,...khd->...hqk", x, x.flip(0)),
        True,
    ),
    # F.unfold is im2col, not Tensor.unfold's window view (ConvBERT)
    "im2col": ((B, 2, T, T), lambda x: F.unfold(x, kernel_size=(2, 1)), False),
    "im2col-of-others": ((B, 2, T, T), lambda x: F.unfold(x + x.flip(0), (2, 1)), True),
    "window-view": ((B, T, D), lambda x: x.unfold(1, 2, 1).sum(-1), False),
    # masked_scatter puts source's elements where the mask holds (Higgs Audio)
    "masked-scatter": ((B, T, D), _scattered, False),
    "masked-scatter-summed": ((B, T, D), lambda x: _scattered(x).sum(1), True),
    "masked-fill-with-a-batch-value": ((B, T, D), _filled, True),
    # index_add and gather move rows to where their index says
    "index-add": ((B, T, D), lambda x: _index_added(x, PERM), False),
    "index-add-onto-one-row": ((B, T, D), lambda x: _index_added(x, PERM % 2), True),
    "gather-rows": ((B, T), lambda x: x.gather(0, PERM[: B * T].view(B, T) % B), False),
    # as_strided: overlapping windows within each example (Longformer's chunks), or rows that
    # straddle two examples (the old default gave row i to example i whole)
    "as-strided-windows": (
        (B, T, D),
        lambda x: x.as_strided((B, T - 1, 2, D), (T * D, D, D, 1)),
        False,
    ),
    "as-strided-of-a-transpose": (
        (B, T, D),
        lambda x: (
            x.transpose(0, 1).contiguous().transpose(0, 1).as_strided((B, 2, D), (D, B * D, 1))
        ),
        False,
    ),
    "as-strided-straddling": ((B, T, D), lambda x: x.as_strided((B, T * D), (T * D - 1, 1)), False),
    "as-strided-straddling-summed": (
        (B, T, D),
        lambda x: x.as_strided((B, T * D), (T * D - 1, 1)).sum(1),
        True,
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_owners_are_the_jacobians(case: str):
    shape, fn, mixes = CASES[case]
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    expected = jacobian_owners(fn, x)
    assert bool((expected == MIXED).any()) == mixes  # the case is what its id says
    got = traced_owners(fn, x)
    assert torch.equal(got, expected), f"\n{got}\n!=\n{expected}"


def test_an_unknown_op_on_rows_of_another_length_mixes():
    """The default for an op the trace does not know: dimension 0's owners only where every
    tracked input has the output's length there."""
    x = torch.randn(B, D, dtype=torch.float64)
    trace = RowTrace(B, (x,))
    with trace:
        out = torch.kron(x, torch.ones(2, 1, dtype=torch.float64))  # (2B, D)
    assert bool((trace.owner(out) == MIXED).all())
    assert "kron" in trace.unknown


def test_positions_and_counts_belong_to_no_example():
    """nonzero(as_tuple=True) and where(cond) give one index tensor per dimension, arange(n) a
    range of a count: integers through which no gradient flows (Longformer's global attention)."""
    x = torch.randn(B, T, dtype=torch.float64)
    trace = RowTrace(B, (x,))
    with trace:
        rows, cols = (x > 0).nonzero(as_tuple=True)
        where = torch.where(x > 0)
        ranged = torch.arange((x > 0).sum(1).max())
    for t in (rows, cols, *where, ranged):
        assert bool((trace.owner(t) == NONE).all()), t


class Flagged(nn.Module):
    """Token embeddings flagged ``requires_grad_`` before the layers that read them, as
    transformers' ``enable_input_require_grads`` does for checkpointed layers."""

    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Embedding(8, 3), nn.Linear(3, 2)

    def forward(self, ids: Tensor) -> Tensor:
        return self.head(torch.tanh(self.embed(ids).requires_grad_(True))).mean(1)


def test_a_flagged_tensor_is_its_rows_through_the_api_and_the_cli(tmp_path):
    """Every parameter was sent to the fallback (the flag read as an op mixing the examples):
    now served by its rule, two batches of a shape through fresh calls and ``gradscope norms``
    against the float64 loop, the model left as it was."""
    case = Case("flagged", Flagged, lambda b: (torch.randint(0, 8, (b, 6)),), torch.randn_like)
    assert_case_matches_loop(case, torch.float64, 1e-9, cli=tmp_path)
