"""``nn.EmbeddingBag`` with offsets (bags cut from flat ids, empty ones among them) and in max
mode, through ``gradscope.per_example_norms`` and one Engine over several batches, against the
float64 per-example loop; bags that are not the examples go to the fallback, named. With
``scale_grad_by_freq``: the rule against the documented counts, served where torch's backward
counts each row's own, the fallback's where it does not (pytorch#190063), torch's refusals
the model's error."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from oracle import assert_rel_close, reference_norms
from torch import Tensor, nn

import gradscope
from gradscope.engine import Engine, total
from gradscope.engine.steps import RegionCall
from gradscope.errors import ModelError
from gradscope.losses import resolve_loss
from gradscope.rules import embedding_bag
from gradscope.rules.registry import find_rule

L, V = 5, 9


class Bags(nn.Module):
    """Example i's bag is its first ``lengths[i]`` ids, cut from the flat ids by offsets
    (``per`` bags an example: its ids in that many runs, the bags' outputs side by side)."""

    def __init__(self, bag: nn.EmbeddingBag, weighted: bool = False, per: int = 1):
        super().__init__()
        self.bag, self.weighted, self.per = bag, weighted, per

    def forward(self, ids: Tensor, lengths: Tensor, w: Tensor) -> Tensor:
        keep = torch.arange(ids.shape[1]) < lengths.unsqueeze(1)  # (B, L)
        sizes = lengths.repeat_interleave(self.per) // self.per  # a bag's size: its share
        sizes[self.per - 1 :: self.per] += lengths % self.per
        ends = sizes.cumsum(0)
        offsets = torch.cat(
            [ends.new_zeros(1), ends if self.bag.include_last_offset else ends[:-1]]
        )
        weights = w[keep] if self.weighted else None
        out = self.bag(ids[keep], offsets, per_sample_weights=weights)  # (B * per, D)
        return out.reshape(ids.shape[0], -1)


def lengths_of(kind: str, b: int, g: torch.Generator) -> Tensor:
    if kind == "equal":
        return torch.full((b,), L)
    lengths = torch.randint(0, L + 1, (b,), generator=g)
    lengths[0] = 1  # a bag of one
    if b > 2:
        lengths[2] = 0  # an empty bag
    return lengths


def batches(kind: str, b: int, n: int = 3) -> list:
    g = torch.Generator().manual_seed(b)
    out = []
    for _ in range(n):
        ids = torch.randint(0, V, (b, L), generator=g)
        w = torch.rand(b, L, generator=g, dtype=torch.float64)
        out.append(((ids, lengths_of(kind, b, g), w), None))
    return out


CASES = {
    "sum": lambda: nn.EmbeddingBag(V, 4, mode="sum"),
    "mean-padding": lambda: nn.EmbeddingBag(V, 4, mode="mean", padding_idx=0),
    "max": lambda: nn.EmbeddingBag(V, 4, mode="max"),
    "max-padding": lambda: nn.EmbeddingBag(V, 4, mode="max", padding_idx=1),
    "sum-last-offset": lambda: nn.EmbeddingBag(V, 4, mode="sum", include_last_offset=True),
    "sum-weighted": lambda: nn.EmbeddingBag(V, 4, mode="sum"),
}


def _check(model: nn.Module, data: list) -> Engine:
    """Each batch by a fresh call and by one Engine, against the loop: the Engine's, its plan."""
    fn = resolve_loss("mse")
    with torch.no_grad():
        data = [(x, torch.randn_like(model(*x))) for x, _ in data]
    expected = [reference_norms(model, x, y)[1] for x, y in data]
    for (x, y), norms in zip(data, expected, strict=True):
        assert_rel_close(gradscope.per_example_norms(model, x, y, "mse"), norms, 1e-9)
    with Engine(model, fn) as engine:
        for (x, y), norms in zip(data, expected, strict=True):
            assert_rel_close(total(engine.norms(x, y).norm_sq).sqrt(), norms, 1e-9)
    return engine


@pytest.mark.parametrize("kind", ["ragged", "equal"])
@pytest.mark.parametrize("b", [1, 4])
@pytest.mark.parametrize("name", list(CASES))
def test_bags_by_offsets_match_the_loop(name: str, b: int, kind: str) -> None:
    torch.manual_seed(0)
    model = Bags(CASES[name](), weighted=name.endswith("weighted")).double()
    engine = _check(model, batches(kind, b))
    assert [(p.name, p.rule) for p in engine.plan.params] == [("bag.weight", "embedding_bag")]


@pytest.mark.parametrize("b", [1, 4])
@pytest.mark.parametrize("padding", [None, 2])
def test_max_of_rows_matches_the_loop_and_replays(b: int, padding: int | None) -> None:
    """A (B, L) input in max mode, a row all padding among them (no member: no gradient)."""
    torch.manual_seed(0)
    model = nn.EmbeddingBag(V, 4, mode="max", padding_idx=padding).double()
    data = []
    for k, ((ids, _, _), _) in enumerate(batches("ragged", b)):
        if padding is not None and k:
            ids[-1] = padding
        data.append(((ids,), None))
    engine = _check(model, data)
    assert [p.rule for p in engine.plan.params] == ["embedding_bag"]
    # the fresh calls and the Engine share the model's record: each pass after the first
    findings = engine.record.at(data[0][0], torch.zeros(b, 4, dtype=torch.float64))
    assert findings.replays == 2 * len(data) - 1


@pytest.mark.parametrize("name", ["sum", "mean-padding", "max", "sum-weighted"])
def test_bags_of_other_lengths_replay(name: str) -> None:
    """The model's own call, whose top-level mask picks the flat ids, is the region: batches
    of other lengths (an empty bag, a bag of one, all full: its row no example's) replay it,
    each exact."""
    torch.manual_seed(0)
    b = 4
    model = Bags(CASES[name](), weighted=name.endswith("weighted")).double()
    data = [*batches("ragged", b, 2), *batches("equal", b, 1)]
    engine = _check(model, data)
    # the fresh calls and the Engine share the model's record: each pass after the first
    findings = engine.record.at(data[0][0], torch.zeros(b, 4, dtype=torch.float64))
    assert (findings.analyses, findings.replays) == (1, 2 * len(data) - 1)
    # its rows followed through the mask over (B, L) and the bags (a routed region), not traced
    (program,) = findings.programs
    regions = [s for s in program.steps if isinstance(s, RegionCall)]
    assert [(r.routed, r.open) for r in regions] == [(True, True)]


def test_bags_of_several_examples_go_to_the_fallback_named() -> None:
    model = Bags(nn.EmbeddingBag(V, 4, mode="sum"), per=2).double()
    engine = _check(model, batches("equal", 3))
    (p,) = engine.plan.params
    assert p.is_fallback and "its 6 bags are not the batch's 3 examples" in p.note


def _by_hand(module: nn.EmbeddingBag, bags: list, g: Tensor) -> tuple[Tensor, Tensor]:
    """``scale_grad_by_freq`` as documented, a loop: (B, V, D) each bag's gradient and (V, D)
    the batch's. A member (row r, weight w) of bag i adds w g_i (over the bag's size in mean
    mode) to row r, divided by r's count in the bag, or in the batch."""
    pad = module.padding_idx
    every = Counter(r for bag in bags for r, _ in bag)
    each = torch.zeros(len(bags), *module.weight.shape, dtype=g.dtype)
    whole = torch.zeros(module.weight.shape, dtype=g.dtype)
    for i, bag in enumerate(bags):
        own = Counter(r for r, _ in bag)
        size = sum(r != pad for r, _ in bag) if module.mode == "mean" else 1
        for r, w in bag:
            if r != pad:
                each[i, r] += w * g[i] / size / own[r]
                whole[r] += w * g[i] / size / every[r]
    return each, whole


FREQ = {
    "sum": dict(mode="sum"),
    "sum-weighted": dict(mode="sum"),
    "mean-padding": dict(mode="mean", padding_idx=0),
    "sum-last-offset": dict(mode="sum", include_last_offset=True),
    "mean-rows": dict(mode="mean"),
}


@pytest.mark.parametrize("name", list(FREQ))
def test_rows_scaled_by_frequency_are_the_documented_ones(name: str, monkeypatch) -> None:
    """The rule's bags (ragged, an empty one; or (B, L) rows) and their sum, rows repeated
    within and across bags, against the documented counts: each bag's own, and the batch's
    (torch 2.13's CPU backward divides by other rows' counts: pytorch#190063)."""
    monkeypatch.setattr(embedding_bag, "counts_own_rows", lambda device: True)
    torch.manual_seed(0)
    module = nn.EmbeddingBag(V, 4, scale_grad_by_freq=True, **FREQ[name]).double()
    lengths = [4, 4, 4] if name == "mean-rows" else [1, 4, 0, 5]
    flat = torch.randint(0, 4, (sum(lengths),))
    w = torch.rand(flat.shape[0], dtype=torch.float64)
    ends = torch.tensor(lengths).cumsum(0)
    starts = [0, *ends[:-1].tolist()]
    bags = [
        [(int(flat[t]), float(w[t]) if name == "sum-weighted" else 1.0) for t in range(a, z)]
        for a, z in zip(starts, ends.tolist(), strict=True)
    ]
    g = torch.randn(len(lengths), 4, dtype=torch.float64)
    if name == "mean-rows":
        inputs, kwargs = (flat.view(3, 4),), {}
    else:
        offsets = torch.tensor(starts + ([int(ends[-1])] if module.include_last_offset else []))
        inputs = (flat,)
        kwargs = {"offsets": offsets, "per_sample_weights": w if name == "sum-weighted" else None}
    part = find_rule(module).fn(module, inputs, g, **kwargs)["weight"]
    each, whole = _by_hand(module, bags, g)
    assert_rel_close(part.materialize(), each, 1e-12)
    assert_rel_close(part.norm_sq(), each.flatten(1).pow(2).sum(1), 1e-12)
    assert_rel_close(part.batch_sum(), whole, 1e-12)


def _uniform(b: int, seed: int) -> tuple[Tensor, Tensor, Tensor]:
    """(B, 6) ids, each example rows 0, 1, 2 twice in its own order: every row's count the same
    in each example and in the batch, where torch's CPU backward counts rightly too."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack(
        [torch.tensor([0, 0, 1, 1, 2, 2])[torch.randperm(6, generator=g)] for _ in range(b)]
    )
    return ids, torch.full((b,), 6), torch.rand(b, 6, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("b", [1, 3])
@pytest.mark.parametrize("name", list(FREQ))
def test_bags_scaled_by_frequency_served_by_the_rule(name: str, b: int, monkeypatch) -> None:
    """Where torch's backward counts each row's own (the probe says so: the counts here are
    all alike, where 2.13's CPU one does too), the rule serves ``scale_grad_by_freq``: the
    self-check holds, every batch the loop's."""
    monkeypatch.setattr(embedding_bag, "counts_own_rows", lambda device: True)
    torch.manual_seed(0)
    bag = nn.EmbeddingBag(V, 4, scale_grad_by_freq=True, **FREQ[name])
    if name == "mean-rows":
        model, data = bag.double(), [((_uniform(b, s)[0],), None) for s in range(3)]
    else:
        model, data = (
            Bags(bag, weighted=name == "sum-weighted").double(),
            [(_uniform(b, s), None) for s in range(3)],
        )
    engine = _check(model, data)
    assert [p.rule for p in engine.plan.params] == ["embedding_bag"]


def test_bags_scaled_by_frequency_where_torch_counts_wrongly_are_the_fallbacks() -> None:
    """On a backward the probe finds counting other rows (torch 2.13's CPU one), the loop's
    numbers are torch's: the fallback serves them, named; the probe is autograd's word."""
    w = torch.zeros(4, 1, requires_grad=True)
    F.embedding_bag(
        torch.tensor([1, 1, 3]), w, torch.tensor([0]), scale_grad_by_freq=True
    ).sum().backward()
    assert embedding_bag.counts_own_rows(torch.device("cpu")) == bool(w.grad[3, 0] == 1)
    torch.manual_seed(0)
    model = Bags(nn.EmbeddingBag(V, 4, mode="sum", scale_grad_by_freq=True)).double()
    engine = _check(model, batches("ragged", 4))
    (p,) = engine.plan.params
    if not embedding_bag.counts_own_rows(torch.device("cpu")):
        assert p.is_fallback and "pytorch#190063" in p.note, p.note
    else:
        assert p.rule == "embedding_bag"


@pytest.mark.parametrize(
    ("mode", "weighted", "message"),
    [("max", False, "max mode does not support scaling"), ("mean", True, "per_sample_weights")],
)
def test_bags_torch_refuses_are_the_models_error(mode: str, weighted: bool, message: str) -> None:
    model = Bags(nn.EmbeddingBag(V, 4, mode=mode, scale_grad_by_freq=True), weighted).double()
    x, _ = batches("equal", 3)[0]
    with pytest.raises(ModelError, match=message):
        gradscope.per_example_norms(model, x, torch.randn(3, 4, dtype=torch.float64), "mse")
