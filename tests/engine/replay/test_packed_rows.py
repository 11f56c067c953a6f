"""The rows a routed region follows through a packed sequence's ops and an ``embedding_bag`` cut
by offsets (``replay/packrows.py``): each slot's rows through the pack, the recurrent kernel and
the padding, batch-first or sequence-first; a slot or bag where two examples meet flagged; the
initial states met in their slots; a padded RNN's or a (B, L) EmbeddingBag's call in a routed
root read by rows, replayed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from oracle import assert_norms_through_one_engine
from torch import Tensor, nn

from gradscope.engine.replay.moved import Along
from gradscope.engine.replay.rowflow import RowFlow


def _after(flow: RowFlow, name: str, func, *args, **kwargs):
    out = func(*args, **kwargs)
    flow.follow(name, args, kwargs, out)
    return out


def _packed(first: bool, length_rows: list[int]) -> tuple[RowFlow, torch.Tensor, torch.Tensor]:
    """A batch of 3 packed as ``pack_padded_sequence`` packs it: (the flow, data, batch sizes),
    the lengths' rows ``length_rows``."""
    flow, lengths = RowFlow(batch=3), torch.tensor([2, 4, 1])
    x = torch.randn(3, 4, 2) if first else torch.randn(4, 3, 2)
    flow.keep(x, torch.tensor([0, 1, 2]) if first else Along(torch.tensor([0, 1, 2]), 1))
    flow.keep(lengths, torch.tensor(length_rows))
    ordered, order = _after(flow, "sort", torch.sort, lengths, descending=True)
    x = _after(flow, "index_select", torch.index_select, x, 0 if first else 1, order)
    data, sizes = _after(
        flow, "_pack_padded_sequence", torch._VF._pack_padded_sequence, x, ordered, first
    )
    return flow, data, sizes


def _gru(flow: RowFlow, data: torch.Tensor, sizes: torch.Tensor, hx: torch.Tensor) -> tuple:
    """``_VF.gru`` on packed data, as ``nn.GRU(2, 5)`` runs it."""
    weights = [torch.randn(15, 2), torch.randn(15, 5), torch.randn(15), torch.randn(15)]
    return _after(flow, "gru", torch._VF.gru, data, sizes, hx, weights, True, 1, 0.0, False, False)


def test_each_slot_its_example_through_the_pack_the_kernel_and_the_padding():
    for first in (True, False):
        flow, data, sizes = _packed(first, [0, 1, 2])
        assert flow.of(data).tolist() == [1, 0, 2, 1, 0, 1, 1]  # steps of 3, 2, 1, 1 rows
        out = _gru(flow, data, sizes, torch.zeros(1, 3, 5))
        assert flow.of(out[0]).tolist() == flow.of(data).tolist()
        assert flow.at(out[1]) is None  # the final state: unfollowed
        padded, _ = _after(
            flow, "_pad_packed_sequence", torch._VF._pad_packed_sequence, out[0], sizes,
            first, 0.0, 4,
        )  # fmt: skip
        rows, dim = flow.at(padded)
        assert (rows.tolist(), dim) == ([1, 0, 2], 0 if first else 1)
        assert not bool(flow.bad)


def test_a_slot_whose_length_is_another_examples_is_flagged():
    flow, data, _ = _packed(True, [1, 0, 2])
    assert flow.of(data) is not None and bool(flow.bad)


def test_initial_states_meet_their_slots_rows():
    """In slot order (the RNN sorts them as it sorts the rows): each slot's own example's, or
    another's (flagged); along another dimension than 1, unfollowed."""
    for rows, bad in (([1, 0, 2], False), ([0, 1, 2], True)):
        flow, data, sizes = _packed(True, [0, 1, 2])
        hx = torch.zeros(1, 3, 5)
        flow.keep(hx, Along(torch.tensor(rows), 1))
        out = _gru(flow, data, sizes, hx)
        assert bool(flow.bad) == bad
        if not bad:
            assert flow.of(out[0]).tolist() == [1, 0, 2, 1, 0, 1, 1]
    flow, data, sizes = _packed(True, [0, 1, 2])
    hx = torch.zeros(1, 3, 5)
    flow.keep(hx, torch.tensor([0]))  # along dimension 0, the layers'
    assert flow.of(_gru(flow, data, sizes, hx)[0]) is None


def test_bags_cut_by_offsets_and_a_bag_of_two_examples():
    weight = torch.randn(9, 4)
    for rows, bad in (([0, 0, 1, 2, 2], False), ([0, 1, 1, 2, 2], True)):  # bags [0, 2, 3]
        flow, ids = RowFlow(batch=3), torch.tensor([1, 2, 3, 4, 5])
        flow.keep(ids, torch.tensor(rows))
        out = _after(flow, "embedding_bag", F.embedding_bag, ids, weight, torch.tensor([0, 2, 3]))
        assert bool(flow.bad) == bad
        if not bad:
            assert flow.of(out).tolist() == [0, 1, 2]


class Routing(nn.Module):
    """A top-level sort of the rows for a Linear (the model's own call a routed region), beside
    a padded GRU's or a (B, L) EmbeddingBag's call: read by rows, not by bags."""

    def __init__(self, rnn: bool):
        super().__init__()
        self.lin, self.rnn = nn.Linear(3, 5), nn.GRU(3, 5, batch_first=True) if rnn else None
        self.bag = nn.EmbeddingBag(7, 5, mode="sum")

    def forward(self, x: Tensor, ids: Tensor) -> Tensor:
        perm = x[:, 0, 0].argsort()
        h = self.lin(x[perm])[perm.argsort()].sum(1)
        return h + (self.bag(ids) if self.rnn is None else self.rnn(x)[0].sum(1))


@pytest.mark.parametrize("rnn", [False, True], ids=["bag", "gru"])
def test_calls_read_by_rows_in_a_routed_root_replay(rnn: bool) -> None:
    """Each batch exact; every batch after the first replayed (on main each was analysed: the
    region let the call in as one read by bags, and its replay refused it as bags not the
    examples)."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    model = Routing(rnn).double()
    batches = [
        ((torch.randn(4, 4, 3, generator=g, dtype=torch.float64),
          torch.randint(0, 7, (4, 3), generator=g)),
         torch.randn(4, 5, generator=g, dtype=torch.float64))
        for _ in range(4)
    ]  # fmt: skip
    engine = assert_norms_through_one_engine(model, batches, "mse")
    findings = engine.record.at(*batches[0])
    assert (findings.analyses, findings.replays) == (1, 3), findings.why
