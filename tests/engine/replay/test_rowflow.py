"""``RowFlow`` (``engine/replay/rowflow.py``): the example of each row, op by op, and the flag
raised where rows of two examples meet."""

from __future__ import annotations

import torch

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
