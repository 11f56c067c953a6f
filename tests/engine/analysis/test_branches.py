"""Python's branches on the batch's values (``analysis/branches.py``): the batch's forward took
one way for every example, where each example alone takes the way its own values say. Before,
a batch whose examples would have taken the other way alone scored without a word (0.27–0.28
off the float64 loop here), on the analysed batch and on every later batch that replayed it.
Now each example is run alone up to the branch; one that reads another value there is run
whole and must give its loss in the batch, or the batch is refused in one line. A truth the
batch's value implies for each example (``all()`` true, ``any()`` false, ``fast_all``) runs
no example alone."""

from __future__ import annotations

import pytest
import torch
from oracle import assert_rel_close, reference_norms
from torch import Tensor, nn

import gradscope
from gradscope.engine import Engine, total
from gradscope.errors import ModelError
from gradscope.losses import resolve_loss

B, F_IN, D, C = 4, 3, 5, 3


# the forwards of every Gated, and those that got past the gate (not the model's state, which
# a program replays only as analysed)
RUNS = {"forwards": 0, "past": 0}


class Gated(nn.Module):
    """Doubles its hidden units where ``gate`` (of the hidden units, the batch's) says so."""

    def __init__(self, gate):
        super().__init__()
        self.gate, self.a, self.b = gate, nn.Linear(F_IN, D), nn.Linear(D, C)

    def forward(self, x: Tensor) -> Tensor:
        RUNS["forwards"] += 1
        h = self.a(x)
        if self.gate(h.detach(), x):
            h = h * 2
        RUNS["past"] += 1
        return self.b(torch.tanh(h))


def positive_sum(h: Tensor, x: Tensor) -> bool:
    return bool(h.sum() > 0)


def all_positive(h: Tensor, x: Tensor) -> bool:
    return bool((x[:, 0] > 0).all())


def fast_all(h: Tensor, x: Tensor) -> bool:  # transformers' ``fast_all`` of a mask
    m = x[:, 0] > 0
    return bool(m.sum() == m.numel())


def most_positive(h: Tensor, x: Tensor) -> bool:  # Python compares the integer read
    return (x[:, 0] > 0).sum().item() * 2 > len(x)


def batch(signs: list[int], seed: int = 0) -> tuple[Tensor, Tensor]:
    """Examples whose first feature has each of ``signs``, the rest random."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(len(signs), F_IN, generator=g, dtype=torch.float64)
    x[:, 0] = torch.tensor(signs, dtype=torch.float64) * (x[:, 0].abs() + 1)
    return x, torch.randint(0, C, (len(signs),), generator=g)


def alone_ways(model: Gated, x: Tensor) -> list[bool]:
    """Each example's way alone."""
    with torch.no_grad():
        return [model.gate(model.a(x[i : i + 1]), x[i : i + 1]) for i in range(len(x))]


def model_of(gate) -> Gated:
    torch.manual_seed(0)
    return Gated(gate).double()


def test_a_batch_whose_example_branches_otherwise_alone_is_refused():
    """The batch's sum of hidden units is one sign, an example's own the other: refused, and
    the example named."""
    model = model_of(positive_sum)
    x, y = batch([1, -1, 1, -1, 1, -1], seed=3)
    with torch.no_grad():
        batch_way = positive_sum(model.a(x), x)
    apart = [i for i, way in enumerate(alone_ways(model, x)) if way != batch_way]
    assert apart
    with pytest.raises(ModelError, match=f"example {apart[0]}'s loss .* branches on a value"):
        gradscope.per_example_norms(model, x, y)


def counted_all(h: Tensor, x: Tensor) -> bool:  # Python's equality of the integer read
    return (x[:, 0] > 0).sum().item() == len(x)


def listed_all(h: Tensor, x: Tensor) -> bool:  # a boolean handed over by ``tolist``
    return (x[:, 0] > 0).all().tolist()


@pytest.mark.parametrize("gate", [most_positive, counted_all, listed_all])
def test_a_number_read_and_compared_in_python_is_checked_whole(gate):
    """``if (x[:, 0] > 0).sum().item() * 2 > len(x):``, a majority: Python compares the integer
    read, where torch sees nothing (``analysis/tags.py``); or tests it for equality (``==
    len(x)``); or ``tolist()`` hands a boolean over: every example is run whole, and the batch
    refused where one's loss differs alone; alike, exact (the first two scored without a word
    before, 0.30 off)."""
    model = model_of(gate)
    x, y = batch([1, -1, 1, 1, 1, -1] if gate is most_positive else [1, 1, -1, 1], seed=3)
    with pytest.raises(ModelError, match=r"example \d's loss .* \(after a number of the batch's"):
        gradscope.per_example_norms(model, x, y)
    x, y = batch([1, 1, 1, 1], seed=1)
    got = gradscope.per_example_norms(model, x, y)
    assert_rel_close(got, reference_norms(model, (x,), y, "cross_entropy")[1], 1e-9)


@pytest.mark.parametrize("gate", [positive_sum, all_positive, fast_all])
def test_a_batch_whose_examples_all_branch_alike_is_exact(gate):
    """Every example alone takes the batch's way (both ways, a fresh call each): scored,
    exact, the model's state as it was."""
    model = model_of(gate)
    for signs in ([1, 1, 1, 1], [-1, -1, -1, -1]):
        x, y = batch(signs, seed=1)
        with torch.no_grad():
            assert alone_ways(model, x) == [gate(model.a(x), x)] * len(x)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        got = gradscope.per_example_norms(model, x, y)
        assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
        assert model.training and all(p.grad is None for p in model.parameters())
        assert_rel_close(got, reference_norms(model, (x,), y, "cross_entropy")[1], 1e-9)


def test_a_later_batch_whose_example_branches_otherwise_is_refused():
    """The analysed batch's examples all take its way; a later batch of the same shape reads
    the same value at the branch, and replays, but one of its examples reads the other
    alone: refused there too (it replayed the analysed program without a word before)."""
    model = model_of(all_positive)
    engine = Engine(model, resolve_loss("cross_entropy"))
    first, later = batch([-1, -1, -1, -1], seed=1), batch([-1, 1, -1, -1], seed=2)
    with engine:
        engine.norms((first[0],), first[1])
        with pytest.raises(ModelError, match="example 1's loss .* branches on a value"):
            engine.norms((later[0],), later[1])
        findings = engine.record.at((later[0],), later[1])
    assert findings.analyses == 1  # refused in the replay


def test_an_implied_truth_runs_no_example_alone():
    """``all()`` true, and ``fast_all`` true, are each example's too: replayed batches run the
    model once; false, each example's own value is its own elements' (``Branches.own``,
    ``replay/owned.py``), so none runs alone up to the branch either (it ran each before), and
    none runs whole, as each takes the batch's way."""
    for gate in (all_positive, fast_all):
        model = model_of(gate)
        with Engine(model, resolve_loss("cross_entropy")) as engine:
            for signs, runs, replays in (([1] * B, (1, 1), 2), ([-1] * B, (1, 1), 4)):
                for seed in range(3):
                    x, y = batch(signs, seed)
                    RUNS.update(forwards=0, past=0)
                    engine.norms((x,), y)
                assert engine.record.at((x,), y).replays == replays  # two more replayed
                assert (RUNS["forwards"], RUNS["past"]) == runs


class Shortcut(nn.Module):
    """transformers' way: a mask skipped where nothing is padded, the same numbers either way."""

    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(11, D), nn.Linear(D, C)

    def forward(self, ids: Tensor, mask: Tensor) -> Tensor:
        h = self.emb(ids)
        if not bool(mask.all()):
            h = h * mask[..., None]
        return self.head(h.sum(1))


def test_a_shortcut_some_examples_take_alone_is_exact():
    """A padded batch, two examples with nothing padded: alone they skip the mask, to the same
    loss, so the batch is scored, exact, analysed and replayed alike."""
    torch.manual_seed(0)
    model = Shortcut().double()
    with Engine(model, resolve_loss("cross_entropy")) as engine:
        for seed in range(3):
            g = torch.Generator().manual_seed(seed)
            ids, y = (
                torch.randint(0, 11, (B, 6), generator=g),
                torch.randint(0, C, (B,), generator=g),
            )
            mask = torch.ones(B, 6, dtype=torch.long)
            mask[1, 4:] = mask[3, 2:] = 0
            got = total(engine.norms((ids, mask), y).norm_sq).sqrt()
            want = reference_norms(model, (ids, mask), y, "cross_entropy")[1]
            assert_rel_close(got, want, 1e-9)
        assert engine.record.at((ids, mask), y).replays == 2


def test_examples_that_take_a_shortcut_alone_run_whole_together():
    """Four of six examples with nothing padded, which alone each skip the mask: they run
    whole once, as a batch of their own that reads what each reads alone (before, once each),
    exact on the analysed batch and on the replayed ones; each example's way is read off the
    mask, none runs alone to the branch."""
    torch.manual_seed(0)
    model, sizes = Shortcut().double(), []
    model.register_forward_pre_hook(lambda m, args: sizes.append(len(args[0])))
    with Engine(model, resolve_loss("cross_entropy")) as engine:
        for seed in range(3):
            g = torch.Generator().manual_seed(seed)
            ids, y = (
                torch.randint(0, 11, (6, 6), generator=g),
                torch.randint(0, C, (6,), generator=g),
            )
            mask = torch.ones(6, 6, dtype=torch.long)
            mask[1, 4:] = mask[4, 2:] = 0
            sizes.clear()
            got = total(engine.norms((ids, mask), y).norm_sq).sqrt()
            assert sizes.count(4) == 1 and 1 not in sizes  # the four together; none whole alone
            want = reference_norms(model, (ids, mask), y, "cross_entropy")[1]
            assert_rel_close(got, want, 1e-9)
        assert engine.record.at((ids, mask), y).replays == 2


class TwoGates(nn.Module):
    """A mask skipped where nothing is padded, then a branch on the sign of the sum."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(F_IN, C)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        h = x if bool(mask.all()) else x * mask[..., None]
        if bool(h.sum() > 0):
            h = h * 2
        return self.head(h.sum(1))


def test_examples_apart_together_but_not_alone_are_refused():
    """Three examples skip the mask alone; together their sum is positive, as the batch's is,
    but example 2's alone is not: run together they would give the batch's losses, so where
    the together forward reads more than the shortcut each runs alone, and the batch is
    refused naming example 2."""
    torch.manual_seed(0)
    model = TwoGates().double()
    x = torch.rand(4, 3, F_IN, dtype=torch.float64)
    x[2] = -x[2] * 0.1  # its own sum negative, the batch's and the three's positive
    mask = torch.ones(4, 3, dtype=torch.long)
    mask[3, 2:] = 0
    y = torch.tensor([0, 1, 2, 0])
    with pytest.raises(ModelError, match="example 2's loss .* branches on a value"):
        gradscope.per_example_norms(model, (x, mask), y)


class Sorted(nn.Module):
    """Rows sorted by their values through a Linear and back (a region the replay traces on
    every batch), then a branch on whether any example's first feature is positive."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, h: Tensor, x: Tensor) -> Tensor:
        order = h.detach().sum(-1).argsort()
        h = self.lin(h[order])[order.argsort()]
        return h * 2 if bool((x[:, 0] > 0).any()) else h


class SortedModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.sorted, self.b = nn.Linear(F_IN, D), Sorted(), nn.Linear(D, C)

    def forward(self, x: Tensor) -> Tensor:
        return self.b(self.sorted(self.a(x), x))


def test_a_branch_the_witness_does_not_compare_checks_every_example_whole():
    """A branch read inside a region traced on every batch (its rows picked by their values),
    where a replayed batch's witness does not compare what it read: every replayed batch runs
    each example whole, and one whose example takes the other way alone is refused."""
    torch.manual_seed(0)
    model = SortedModel().double()
    with Engine(model, resolve_loss("cross_entropy")) as engine:
        for seed in range(2):
            x, y = batch([1] * B, seed)
            got = total(engine.norms((x,), y).norm_sq).sqrt()
            assert_rel_close(got, reference_norms(model, (x,), y, "cross_entropy")[1], 1e-9)
        findings = engine.record.at((x,), y)
        assert findings.replays == 1 and findings.programs[-1].alone
        x, y = batch([1, 1, -1, 1], 2)
        with pytest.raises(ModelError, match="example 2's loss"):
            engine.norms((x,), y)


class RootAndSorted(SortedModel):
    """A branch at the top level that each example's own values can say (an ``all()``), then
    ``Sorted``'s, read where the witness does not compare it."""

    def forward(self, x: Tensor) -> Tensor:
        h = self.a(x)
        if not bool((x[:, 1] > 0).all()):
            h = h + 0.0  # the same numbers either way
        return self.b(self.sorted(h, x))


def test_examples_run_whole_keep_no_own_values_of_the_branches():
    """Every replayed example runs whole (``Sorted``'s branch), so the top-level branch's own
    values are not kept: replayed, exact."""
    torch.manual_seed(0)
    model = RootAndSorted().double()
    with Engine(model, resolve_loss("cross_entropy")) as engine:
        for seed in range(3):
            x, y = batch([1] * B, seed)
            x[:, 1] = torch.tensor([1.0, -1.0, 1.0, 1.0])
            got = total(engine.norms((x,), y).norm_sq).sqrt()
            assert_rel_close(got, reference_norms(model, (x,), y, "cross_entropy")[1], 1e-9)
        findings = engine.record.at((x,), y)
        assert findings.replays == 2 and findings.programs[-1].alone


def test_a_maximum_within_a_bound_runs_no_example_alone():
    """XLM's ``assert lengths.max().item() <= slen``: true of the batch's maximum, true of each
    example's, so no example runs alone; a maximum above a number is not each example's, so
    every example runs whole (``analysis/tags.py``'s ``Read.bound``)."""
    gates = {
        lambda h, x: (x[:, 0] > 0).long().max().item() <= 1: (1, 1),
        lambda h, x: (x[:, 0] > 0).long().max().item() >= 1: (1 + B, 1 + B),
    }
    for gate, runs in gates.items():
        model = model_of(gate)
        with Engine(model, resolve_loss("cross_entropy")) as engine:
            for seed in range(3):
                x, y = batch([1] * B, seed)
                want = reference_norms(model, (x,), y, "cross_entropy")[1]
                RUNS.update(forwards=0, past=0)
                got = total(engine.norms((x,), y).norm_sq).sqrt()
                assert_rel_close(got, want, 1e-9)
            assert (RUNS["forwards"], RUNS["past"]) == runs
