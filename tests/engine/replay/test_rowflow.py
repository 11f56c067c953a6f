"""``RowFlow`` (``engine/replay/rowflow.py``): the example of each row, op by op, and the flag
raised where rows of two examples meet."""

from __future__ import annotations

import pytest
import torch

from gradscope.engine.replay.moved import Along
from gradscope.engine.replay.rowflow import NO_ONE, RowFlow


def _flow(*rows: list[int]) -> tuple[RowFlow, list[torch.Tensor]]:
    flow, ts = RowFlow(batch=3), []
    for r in rows:
        t = torch.randn(len(r), 4)
        flow.keep(t, torch.tensor(r))
        ts.append(t)
    return flow, ts


def _after(flow: RowFlow, name: str, func, *args, **kwargs) -> torch.Tensor:
    out = func(*args, **kwargs)
    flow.follow(name, args, kwargs, out)
    return out


def test_rows_picked_sorted_and_put_back():
    flow, (x,) = _flow([0, 0, 1, 2])
    perm = torch.tensor([3, 1, 0, 2])
    picked = _after(flow, "__getitem__", torch.Tensor.__getitem__, x, perm)
    assert flow.of(picked).tolist() == [2, 0, 0, 1]
    out = torch.zeros(4, 4)
    _after(flow, "index_add_", torch.Tensor.index_add_, out, 0, perm, picked)
    assert flow.of(out).tolist() == [0, 0, 1, 2] and flow.bad is not None and not flow.bad


def test_rows_of_two_examples_meeting_raise_the_flag():
    flow, (x, y) = _flow([0, 1, 2], [0, 2, 2])
    _after(flow, "mul", torch.mul, x, y)
    assert bool(flow.bad)
    flow, (x,) = _flow([0, 0, 1, 2])
    _after(flow, "view", torch.Tensor.view, x, 2, 8)  # rows 2 and 3 merged: examples 1 and 2
    assert bool(flow.bad)


def test_joins_gathers_and_reductions_off_dimension_zero_keep_rows():
    flow, (x, y) = _flow([0, 1, 2], [2, 2])
    assert flow.of(_after(flow, "cat", torch.cat, [x, y], 0)).tolist() == [0, 1, 2, 2, 2]
    free = torch.randn(2, 4)
    assert flow.of(_after(flow, "cat", torch.cat, [y, free], 0)).tolist() == [2, 2, NO_ONE, NO_ONE]
    index = torch.zeros(3, 2, dtype=torch.long)
    assert flow.of(_after(flow, "gather", torch.gather, x, -1, index)).tolist() == [0, 1, 2]
    assert flow.of(_after(flow, "sum", torch.sum, x, 1)).tolist() == [0, 1, 2]
    assert flow.of(_after(flow, "square", torch.square, x)).tolist() == [0, 1, 2]  # relu^2
    assert flow.bad is None


def test_ops_that_mix_rows_or_write_through_views_are_not_followed():
    flow, (x,) = _flow([0, 1, 2])
    assert flow.of(_after(flow, "sum", torch.sum, x, 0)) is None  # over the examples
    assert flow.of(_after(flow, "cumsum", torch.cumsum, x, 0)) is None
    flow, (x, y) = _flow([0, 1, 2], [2, 1, 0])
    key = (slice(None), slice(0, 2))
    view = _after(flow, "__getitem__", torch.Tensor.__getitem__, x, key)
    _after(
        flow,
        "add_",
        torch.Tensor.add_,
        view,
        _after(flow, "__getitem__", torch.Tensor.__getitem__, y, key),
    )
    assert flow.of(view) is None  # its base would not see the rows written
    assert flow.of(x) is None  # nor the base the view's


def test_rows_moved_into_a_view_leave_its_base_unfollowed():
    flow, (x, y) = _flow([0, 1, 2], [2, 0, 1])
    view = _after(flow, "__getitem__", torch.Tensor.__getitem__, x, (slice(None), slice(0, 2)))
    perm, src = torch.tensor([1, 2, 0]), y[:, :2].clone()
    flow.keep(src, torch.tensor([2, 0, 1]))
    _after(flow, "index_copy_", torch.Tensor.index_copy_, view, 0, perm, src)
    # x's first two columns now hold rows of examples 1, 2, 0 under its rows 0, 1, 2
    assert flow.of(view) is None and flow.of(x) is None
    flow, (x, y) = _flow([0, 1, 2], [2, 0, 1])
    view = _after(flow, "__getitem__", torch.Tensor.__getitem__, x, (slice(None), 0))
    _after(flow, "index_copy_", torch.Tensor.index_copy_, x, 0, perm, y)
    assert flow.of(x) is None and flow.of(view) is None  # the view of the base written


def test_rows_moved_off_dimension_zero_and_back():
    flow, (x,) = _flow([0, 1, 2, 2])  # (4, 4)
    mask = _after(flow, "unsqueeze", torch.Tensor.unsqueeze, x, 1)  # (4, 1, 4)
    mask = _after(flow, "permute", torch.Tensor.permute, mask, 2, 1, 0)  # (4, 1, 4)
    assert flow.of(mask) is None and flow.at(mask)[1] == 2  # along dimension 2
    one = _after(flow, "__getitem__", torch.Tensor.__getitem__, mask, torch.tensor([1]))
    one = _after(flow, "squeeze", torch.Tensor.squeeze, one, 0)  # (1, 4)
    assert flow.at(one)[0].tolist() == [0, 1, 2, 2] and flow.at(one)[1] == 1
    picked = _after(flow, "__getitem__", torch.Tensor.__getitem__, x, (None, torch.tensor([3, 0])))
    back = _after(flow, "reshape", torch.Tensor.reshape, picked, -1, 4)  # (1, 2, 4) -> (2, 4)
    assert flow.of(back).tolist() == [2, 0]
    flow, (x,) = _flow([0, 1, 2])  # (3, 4): a sequence-first (T, B, H) read as (T * B, H)
    seq = _after(flow, "expand", torch.Tensor.expand, x, 2, 3, 4)
    seq = _after(flow, "sum", torch.sum, seq, 2, keepdim=True)  # along the features
    assert (
        flow.of(_after(flow, "reshape", torch.Tensor.reshape, seq, 6, 1)).tolist() == [0, 1, 2] * 2
    )
    assert flow.bad is None


def test_moves_that_mix_moved_rows_are_not_followed():
    flow, (x,) = _flow([0, 1, 2])  # (3, 4)
    t = _after(flow, "transpose", torch.transpose, x, 0, 1)  # (4, 3): rows along dimension 1
    assert flow.at(_after(flow, "reshape", torch.Tensor.reshape, t, 3, 4)) is None  # mixed
    assert flow.at(_after(flow, "sum", torch.sum, t, 1)) is None  # over the examples
    assert flow.at(_after(flow, "matmul", torch.matmul, t, torch.randn(3, 2))) is None
    assert flow.at(_after(flow, "flip", torch.flip, t, [1])) is None
    y = torch.randn(4, 3)
    flow.keep(y, torch.tensor([0, 1, 2, 2]))  # rows along dimension 0 meet rows along 1
    assert flow.at(_after(flow, "add", torch.add, t, y)) is None
    assert flow.bad is None


T, G = torch.Tensor, torch.Tensor.__getitem__
# (shape, the rows' dimension, op, its function, its arguments, the same on the owners)
MOVED = [
    ((4, 1, 3), 0, "permute", T.permute, (2, 1, 0), None),
    ((3, 4, 2), 1, "transpose", torch.transpose, (0, 2), None),
    ((3, 4, 2), 2, "movedim", torch.movedim, ((0, 2), (2, 0)), None),
    ((3, 4, 2), 1, "mT", T.mT.__get__, (), None),
    ((3, 4), 0, "unsqueeze", torch.unsqueeze, (1,), None),
    ((1, 4, 1), 1, "squeeze", torch.squeeze, (), None),
    ((4, 3), 0, "expand", T.expand, (2, 4, 3), None),
    ((2, 4, 3), 1, "__getitem__", G, ((0, slice(1, 3), None),), None),
    ((2, 4, 3), 1, "__getitem__", G, ((None, ..., torch.tensor([2, 0])),), None),
    ((2, 4, 3), 1, "__getitem__", G, ((1, torch.tensor([3, 0, 3])),), None),
    ((4, 3), 0, "__getitem__", G, ((slice(None), torch.tensor([2, 0])),), None),
    ((2, 4, 3), 1, "reshape", T.reshape, (8, 3), None),  # sequence-first: rows twice
    ((2, 4, 3), 1, "reshape", T.reshape, (2, 12), None),  # each row 3 times
    ((2, 4, 3), 1, "sum", torch.sum, (2,), lambda o, d: o.amax(d)),
    ((2, 4, 3), 1, "softmax", torch.softmax, (0,), lambda o, d: o),
    ((2, 4, 3), 1, "select", torch.select, (0, 1), None),
    ((2, 4, 3), 1, "unbind", torch.unbind, (2,), None),
    ((2, 4, 3), 1, "mul", torch.mul, (2.0,), lambda o, c: o),
]


@pytest.mark.parametrize("shape, dim, name, func, args, owned", MOVED, ids=[c[2] for c in MOVED])
def test_moved_rows_are_the_owners_the_op_moves(shape, dim, name, func, args, owned):
    """Each row's example where the flow says, against the op run on the owners themselves."""
    flow, x = RowFlow(batch=3), torch.randn(shape)
    rows = torch.tensor([2, 0, 1, 1])[: shape[dim]]
    flow.keep(x, Along(rows, dim) if dim else rows)
    out = _after(flow, name, func, x, *args)
    owners = rows.view([-1 if k == dim else 1 for k in range(len(shape))]).expand(shape)
    moved = (owned or func)(owners, *args)
    for o, m in zip(out, moved, strict=True) if isinstance(out, tuple) else [(out, moved)]:
        at = flow.at(o)
        assert isinstance(at, tuple), name
        view = [-1 if k == at[1] else 1 for k in range(o.dim())]
        assert torch.equal(m, at[0].view(view).expand(o.shape))


def test_rows_repeated_in_place_and_the_ids_a_batch_routes_to():
    flow, (x,) = _flow([0, 1, 2])
    twice = _after(flow, "repeat_interleave", torch.Tensor.repeat_interleave, x, 2, dim=0)
    assert flow.of(twice).tolist() == [0, 0, 1, 1, 2, 2]  # Ergo's one row per route
    counts = torch.tensor([1, 0, 2])  # of no example
    some = _after(flow, "repeat_interleave", torch.repeat_interleave, x, counts, dim=0)
    assert flow.of(some).tolist() == [0, 2, 2]
    wide = _after(flow, "repeat_interleave", torch.Tensor.repeat_interleave, x, 3, dim=1)
    assert flow.of(wide).tolist() == [0, 1, 2]
    routes = torch.tensor([[1, 3], [1, 0], [2, 2]])
    flow.keep(routes, torch.tensor([0, 1, 2]))
    by_rows = routes[:, 0].clone()
    flow.keep(by_rows, torch.tensor([0, 1, 2]))
    per_row = _after(flow, "repeat_interleave", torch.repeat_interleave, x, by_rows, dim=0)
    assert flow.of(per_row) is None  # counts an example's values decide
    ids = _after(flow, "unique", torch.unique, routes)
    assert flow.of(ids) is False  # the experts routed to: ids, no example's rows
    _, inverse = torch.unique(routes, return_inverse=True)
    flow.follow("unique", (routes,), {"return_inverse": True}, (ids, inverse))
    assert flow.of(inverse) is None  # each route's own, not followed
    assert flow.bad is None


def _set(flow: RowFlow, x: torch.Tensor, key: object, y: object) -> None:
    x[key] = y
    flow.follow("__setitem__", (x, key, y), {}, None)


def test_rows_picked_and_written_by_a_mask():
    flow, (x, y) = _flow([0, 0, 1, 2, 2], [2, 0])
    mask = torch.tensor([False, True, False, True, False])
    flow.keep(mask, torch.tensor([0, 0, 1, 2, 2]))  # made from each row's own values
    picked = _after(flow, "__getitem__", G, x, mask)
    assert flow.of(picked).tolist() == [0, 2]
    wide = _after(flow, "__getitem__", G, x, (mask, slice(None)))
    assert flow.of(wide).tolist() == [0, 2]
    out = torch.zeros(5, 4)  # no example's
    _set(flow, out, mask, _after(flow, "mul", torch.mul, picked, 2))
    assert flow.of(out).tolist() == [0, 0, 1, 2, 2]  # each row kept or not by its own mask
    positions = mask.clone()  # a mask of no example
    out = torch.zeros(5, 4)
    _set(flow, out, positions, picked)
    assert flow.of(out).tolist() == [NO_ONE, 0, NO_ONE, 2, NO_ONE]
    assert not flow.bad
    kept = x.clone()
    flow.keep(kept, torch.tensor([0, 0, 1, 2, 2]))
    _set(flow, kept, mask, 0.0)  # a constant written: the mask's rows there
    assert flow.of(kept).tolist() == [0, 0, 1, 2, 2] and not flow.bad
    _set(flow, kept, mask, y)  # y's rows in the rows of examples 0 and 2
    assert flow.of(kept).tolist() == [0, 2, 1, 2, 2] and bool(flow.bad)  # 2 meets 0
    flow, (x,) = _flow([0, 1, 2])
    other = torch.tensor([True, True, False])
    flow.keep(other, torch.tensor([1, 1, 2]))  # a mask of another example's values
    _after(flow, "__getitem__", G, x, other)
    assert bool(flow.bad)


def test_masks_the_flow_cannot_follow_and_rows_normalised_alone():
    flow, (x,) = _flow([0, 1, 2])
    grid = torch.tensor([[True, False, True, True]] * 3)  # over every element: each its row's
    assert flow.of(_after(flow, "__getitem__", G, x, grid)).tolist() == [0] * 3 + [1] * 3 + [2] * 3
    assert flow.of(_after(flow, "__getitem__", G, x, (slice(None), grid[0]))) is None
    mask = torch.tensor([True, False, True])
    assert flow.of(_after(flow, "__getitem__", G, x, (mask, ...))).tolist() == [0, 2]
    assert flow.of(_after(flow, "__getitem__", G, x, (mask, torch.tensor([1, 3])))) is None
    out = x.clone()
    flow.keep(out, torch.tensor([0, 1, 2]))
    y = torch.randn(4)
    flow.keep(y, torch.tensor([0, 1, 2, 2]))  # an example's, broadcast along x's rows
    _set(flow, out, torch.tensor([True, False, True]), y)
    assert flow.of(out) is None
    flow, (x,) = _flow([0, 1, 2])
    normed = _after(flow, "rms_norm", torch.nn.functional.rms_norm, x, (4,))
    assert flow.of(normed).tolist() == [0, 1, 2]
    assert flow.of(_after(flow, "layer_norm", torch.nn.functional.layer_norm, x, (3, 4))) is None
    assert flow.bad is None
