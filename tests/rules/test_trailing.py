"""Rows of zero output gradients at each example's end, cut from its products
(``rules/trailing.py``): a padded sequence's, and all but the first of a layer whose one row a
head reads. Every number the loop's, in norms, influence and a watched training step; nothing
cut where a cut row's input is not finite, where no example ends in zeros, or off the CPU."""

from __future__ import annotations

import pytest
import torch
from oracle import (
    Case,
    assert_case_matches_loop,
    assert_fallback,
    assert_rel_close,
    reference_influence,
    reference_norms,
)
from torch import nn

import gradscope
from gradscope.engine import Engine, total
from gradscope.losses import resolve_loss
from gradscope.rules import Outer, linear, trailing


class Padded(nn.Module):
    """Rows past each example's length masked out and pooled, beside a layer whose first row
    alone the head reads: ``a``'s and ``b``'s zero rows are the padding, ``first``'s all but
    one."""

    def __init__(self):
        super().__init__()
        # wide enough that no G of ``first``'s 7 rows is formed (``Outer.forms``)
        self.a, self.b = nn.Linear(6, 128), nn.Linear(128, 128)
        self.first, self.head = nn.Linear(128, 128), nn.Linear(128, 3)

    def forward(self, x, mask):
        h = torch.tanh(self.a(x)) * mask[..., None]
        h = h + torch.tanh(self.b(h)) * mask[..., None]
        pooled = (h * mask[..., None]).sum(1)
        return self.head(torch.tanh(self.first(h))[:, 0] + pooled)


def _batch(lengths: list[int], t: int = 7, seed: int = 0):
    torch.manual_seed(seed)
    mask = (torch.arange(t) < torch.tensor(lengths)[:, None]).double()
    x = torch.randn(len(lengths), t, 6, dtype=torch.float64)
    return (x, mask), torch.randint(0, 3, (len(lengths),))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return Padded().double()


@pytest.fixture(autouse=True)
def small(monkeypatch):
    """These tests' products, small, cut as large ones are."""
    monkeypatch.setattr(trailing, "SMALL", 0)


@pytest.fixture
def cuts(monkeypatch) -> list:
    """The lengths each cut Outer of the pass took."""
    seen, made = [], linear.Outer

    def spied(*args, **kwargs):
        outer = made(*args, **kwargs)
        if outer.trimmed:
            seen.append(outer.lengths)
        return outer

    monkeypatch.setattr(linear, "Outer", spied)
    return seen


@pytest.mark.parametrize("lengths", [[7, 3, 5, 2], [4], [7, 1, 0, 6, 7]])
def test_norms_with_rows_cut_are_the_loops(cuts, lengths):
    model = _model()
    with Engine(model, resolve_loss("cross_entropy")) as engine:
        for seed in range(2):  # analysed, then replayed
            inputs, targets = _batch(lengths, seed=seed)
            want = reference_norms(model, inputs, targets, "cross_entropy")[1].square()
            assert_rel_close(total(engine.norms(inputs, targets).norm_sq), want, 1e-10)
    assert_fallback(engine)
    assert tuple(lengths) in cuts or min(lengths) == max(lengths)  # the padding cut
    assert tuple([1] * len(lengths)) in cuts  # ``first``: the head reads row 0 alone


def test_two_batches_through_the_api_and_the_cli_with_rows_cut(tmp_path, cuts):
    """Each batch a fresh ``per_example_norms`` call and one run of ``gradscope norms``, the
    model left as it was (``assert_case_matches_loop``)."""
    lengths = torch.tensor([7, 3, 5, 2, 4])

    def inputs(n: int):
        mask = (torch.arange(7) < lengths[:n, None]).double()
        return torch.randn(n, 7, 6), mask

    case = Case("padded", Padded, inputs, lambda out: out.argmax(-1), "cross_entropy")
    assert_case_matches_loop(case, rtol=1e-10, cli=tmp_path)
    assert (7, 3, 5, 2, 4) in cuts and (1,) * 5 in cuts


def test_influence_with_rows_cut_is_the_loops(cuts):
    model = _model()
    inputs, targets = _batch([7, 3, 5, 2])
    refs = _batch([6, 2], seed=3)
    got = gradscope.per_example_influence(model, inputs, targets, *refs, "cross_entropy")
    want = reference_influence(model, inputs, targets, refs, "cross_entropy")[0].mean(1)
    assert_rel_close(got, want, 1e-10)
    assert cuts


def test_a_watched_step_trains_as_the_plain_one_with_rows_cut(tmp_path, cuts):
    """The cut layers' batch gradient is the rules' sum over the rows left (``Outer.forms``
    with ``trimmed``), not autograd's product: ``.grad`` is still the plain step's."""
    from gradscope.training.watch import Watch

    model, plain = _model(), _model()
    batches = [_batch([7, 3, 5, 2], seed=k) for k in range(2)]
    with Watch(model, tmp_path / "w.parquet") as watch:
        for inputs, targets in batches:
            model.zero_grad()
            watch.step(inputs, targets, torch.arange(4)).backward()
        assert "first.weight" in watch.engine.record.at(*batches[1]).formed
    plain.zero_grad()
    nn.functional.cross_entropy(plain(*batches[1][0]), batches[1][1]).backward()
    for p, q in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-14)
    assert cuts


def _sides(lengths: list[int], t: int = 6, o: int = 4, i: int = 3) -> tuple[torch.Tensor, ...]:
    """(B, 1, T, O) output gradients, zeros past each example's length, and (B, 1, T, I)
    inputs."""
    torch.manual_seed(0)
    kept = torch.arange(t) < torch.tensor(lengths)[:, None]
    return torch.randn(len(lengths), 1, t, o) * kept[:, None, :, None], torch.randn(
        len(lengths), 1, t, i
    )


def test_the_lengths_end_at_each_examples_last_row_of_gradient():
    s, a = _sides([6, 2, 0, 3])
    s[0, 0, 4:] = 0  # a full example whose last rows happen to be zeros is cut there too
    s[1, 0, 0] = 0  # a zero row before the last is kept
    assert trailing.trailing(s, a) == [4, 2, 0, 3]


def test_nothing_cut_where_an_input_cut_is_not_finite():
    """The loop's term of a zero gradient and an infinite input is NaN, not zero."""
    s, a = _sides([6, 2, 3, 3])
    assert trailing.trailing(s, a) is not None
    a[1, 0, 5, 0] = float("inf")
    assert trailing.trailing(s, a) is None
    grads = Outer(s, a, torch.Size((4, 3))).materialize()
    assert grads[1].isnan().any()  # the answer the loop gives, from every row


def test_half_inputs_whose_sum_overflows_half_are_cut():
    """float16's largest is 65504: the inputs' sum, in float32, is finite."""
    s, a = _sides([6, 2, 3], i=4096)
    a = a.abs().half() + 1
    assert bool(a.sum().isinf()) and trailing.trailing(s.half(), a) == [6, 2, 3]


@pytest.mark.parametrize("lengths", [[6, 6, 5], [6, 6, 6]])
def test_nothing_cut_where_few_rows_are(lengths):
    s, a = _sides(lengths)
    assert trailing.trailing(s, a) is None


def test_nothing_read_for_a_small_product(monkeypatch):
    s, a = _sides([6, 2, 3])
    monkeypatch.setattr(trailing, "SMALL", s.shape[0] * s.shape[2] * 4 * 3)
    assert trailing.trailing(s, a) is None
    monkeypatch.setattr(trailing, "SMALL", s.shape[0] * s.shape[2] * 4 * 3 - 1)
    assert trailing.trailing(s, a) == [6, 2, 3]
    assert trailing.trailing(s[:, :, :, :0], a) is None  # no product at all


def test_nothing_cut_where_the_read_would_wait_for_a_device(monkeypatch):
    s, a = _sides([6, 2, 3])
    monkeypatch.setattr(trailing, "FREE", frozenset())
    assert trailing.trailing(s, a) is None


def test_a_cut_outer_sums_its_rows_left_for_a_training_step():
    s, a = _sides([1, 1, 1, 1], o=128, i=128)  # no G formed: (128, 128) of few rows
    shape = torch.Size((128, 128))
    full, cut = Outer(s, a, shape), Outer(s, a, shape, [1] * 4, None, True)
    assert not full.forms(train=True) and cut.forms(train=True)
    for x, y in zip(full.norm_sq_and_sum(), cut.norm_sq_and_sum(), strict=True):
        torch.testing.assert_close(x, y)
    assert cut.examples(1, 3).trimmed and cut.merge(cut).trimmed
