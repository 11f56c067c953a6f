"""Indices whose VALUES are another example's, where the rows they pick are not the question:
along the features or positions, which every example has alike (``h.gather(2, idx)``,
``h[:, :, idx]``, ``index_select``, ``take``, a table's or a parameter's entries picked by
them), writes placed by them (``scatter_`` and its kin, ``x[idx] = y``, ``index_put``, a -inf
mask's zeros put at another example's top k), and zeros filled in place by another example's
mask. Example i's output then depends on example j's inputs: no per-example gradient exists,
and the float64 loop (each example alone) disagrees with the batch. The trace makes the
elements MIXED (``analysis/selectors.py``), so each batch is refused as mixing the examples,
naming the op, or is exact (the examples checked alone agree: every parameter on the
fallback); norms and the hooks engine's inner products alike. The same ops by each example's
own values, or a fixed index, stay exact with no parameter on the fallback, and so does every
crossed op at batch 1, where another example's values are the example's own."""

from __future__ import annotations

import pytest
import torch
from oracle import assert_fallback, assert_rel_close, reference_influence, reference_norms
from torch import Tensor, nn

from gradscope.engine import Engine, naive_grads, total
from gradscope.errors import ModelError
from gradscope.losses import resolve_loss

F_IN, H, T, C = 5, 4, 3, 3
LOSS = "cross_entropy"
FIXED = torch.tensor([2, 0, 1, 3])


def other(h: Tensor) -> Tensor:
    """Each example's previous one's values (the last's, for the first)."""
    return h.detach().roll(1, 0)


def tokens(h: Tensor, order: Tensor) -> Tensor:
    """(B, T, H) with each example's tokens put where ``order`` (B, T) says, flattened."""
    at = (order + torch.arange(h.shape[0])[:, None] * T).reshape(-1)  # (B*T,)
    flat = h.reshape(-1, H)
    return torch.zeros_like(flat).index_copy_(0, at, flat).view(h.shape)


def flat_rows(h: Tensor) -> Tensor:
    """(B, T, 1): where each (example, token)'s features start in ``h`` flattened."""
    return torch.arange(h.shape[0] * T).view(-1, T, 1) * H


def put(h: Tensor, key: tuple, value: Tensor) -> Tensor:
    out = torch.zeros_like(h)
    out[key] = value
    return out


def lines(h: Tensor, last: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """An index key of every (example, token) with ``last`` (B, T, n) along the features."""
    return torch.arange(h.shape[0])[:, None, None], torch.arange(T)[None, :, None], last


# (the op a refusal at analysis names, h (B, T, H) and the model -> (B, T, H)): the pick; or,
# for entries of no example's an index picked, where one example's meet another's rows (mul,
# add) or where the batch's index was summed (sum); a batch replayed with every parameter on
# the fallback is refused naming none
CROSSED = {  # silently wrong before: each example's output picked or placed by another's
    "gather": ("gather", lambda h, m: h.gather(2, other(h).argmax(-1, keepdim=True))),
    "take_along_dim": ("take_along_dim", lambda h, m: h.take_along_dim(other(h).argsort(-1), 2)),
    "index_select": ("index_select", lambda h, m: h.index_select(2, h[-1, 0].argsort())),
    "getitem-features": ("__getitem__", lambda h, m: h[:, :, h[0, 0].argsort()]),
    "getitem-batch-sum": ("__getitem__", lambda h, m: h[..., h.sum((0, 1)).argsort()]),
    "getitem-positions": ("__getitem__", lambda h, m: h[:, h[0, :, 0].argsort()]),
    "table": ("mul", lambda h, m: h * m.table[other(h).argmax(-1)]),
    "table-batch-sum": ("sum", lambda h, m: h * m.table[h.detach().sum(0).argmax(-1)]),
    "table-gather": (
        "mul",
        lambda h, m: h * m.table.expand(len(h), H, H).gather(1, other(h).argsort(-1)),
    ),
    "scatter_": ("scatter_", lambda h, m: torch.zeros_like(h).scatter_(2, other(h).argsort(-1), h)),
    "scatter": ("scatter", lambda h, m: torch.zeros_like(h).scatter(2, other(h).argsort(-1), h)),
    "scatter_add_": (
        "scatter_add_",
        lambda h, m: h.clone().scatter_add_(2, other(h).argmax(-1, keepdim=True), h[..., :1]),
    ),
    "scatter_reduce": (
        "scatter_reduce",
        lambda h, m: torch.zeros_like(h).scatter_reduce(2, other(h).argsort(-1), h, "amax"),
    ),
    "topk-mask": (
        "add",
        lambda h, m: h + torch.full_like(h, -1e9).scatter(-1, other(h).topk(2, -1).indices, 0.0),
    ),
    "setitem": (
        "__setitem__",
        lambda h, m: put(h, (slice(None), slice(None), h[0, 0].argsort()), h),
    ),
    "index_put": (
        "index_put",
        lambda h, m: torch.zeros_like(h).index_put(lines(h, other(h).argsort(-1)), h),
    ),
    "index_copy_-tokens": ("index_copy_", lambda h, m: tokens(h, other(h)[..., 0].argsort(-1))),
    "take": ("take", lambda h, m: h.take(other(h).argsort(-1) + flat_rows(h))),
    "masked_fill_-none": (
        "add",
        lambda h, m: h + torch.zeros_like(h).masked_fill_(other(h) > 0, -3.0),
    ),
}
# a parameter's entry picked by values the whole batch mixed (silently wrong before: taken as an
# expert id the batch's routing hit, Mixtral's ``W[e]``); at batch 1 on the fallback, exact
BATCH = {"parameter-batch-sum": ("sum", lambda h, m: h * m.w[h.detach().sum((0, 1)).argmax()])}
REFUSED = {  # refused before too: kept as proof
    "index_add_": (
        "index_add_",
        lambda h, m: torch.zeros_like(h).index_add_(2, h[0, 0].argsort(), h),
    ),
    "index_copy_": (
        "index_copy_",
        lambda h, m: torch.zeros_like(h).index_copy_(2, h[0, 0].argsort(), h),
    ),
    "index_put_": (
        "index_put_",
        lambda h, m: torch.zeros_like(h).index_put_(lines(h, other(h).argsort(-1)), h),
    ),
    "masked_scatter_": (
        "masked_scatter_",
        lambda h, m: torch.zeros_like(h).masked_scatter_(other(h) > 0, h),
    ),
    "index_fill": ("index_fill", lambda h, m: h.index_fill(2, h[0, 0].argmax().reshape(1), 0.0)),
    "parameter": ("mul", lambda h, m: h * m.w[other(h).argmax(-1)][..., None]),
}
OWN = {  # by each example's own values, or a fixed index
    "gather": lambda h, m: h.gather(2, h.detach().argmax(-1, keepdim=True)),
    "getitem-fixed": lambda h, m: h[:, :, FIXED],
    "table": lambda h, m: h * m.table[h.detach().argmax(-1)],
    "scatter_": lambda h, m: torch.zeros_like(h).scatter_(2, h.detach().argsort(-1), h),
    "scatter-fixed": lambda h, m: torch.zeros_like(h).scatter(2, FIXED.expand(h.shape), h),
    "topk-mask": lambda h, m: (
        h + torch.full_like(h, -1e9).scatter(-1, h.detach().topk(2, -1).indices, 0.0)
    ),
    "setitem": lambda h, m: put(h, lines(h, h.detach().argsort(-1)), h),
    "index_put": lambda h, m: torch.zeros_like(h).index_put(lines(h, h.detach().argsort(-1)), h),
    "index_fill-fixed": lambda h, m: h.index_fill(2, FIXED[:1], 0.0),
    "take": lambda h, m: h.take(h.detach().argsort(-1) + flat_rows(h)),
    "masked_fill_-none": lambda h, m: h + torch.zeros_like(h).masked_fill_(h.detach() > 0, -3.0),
}


class Pick(nn.Module):
    """The op, in a module of its own (a refusal names it), with a parameter and a table."""

    def __init__(self, op):
        super().__init__()
        self.w = nn.Parameter(torch.randn(H))
        self.register_buffer("table", torch.randn(H, H))
        self.op = op

    def forward(self, h: Tensor) -> Tensor:
        return self.op(h, self) * self.w  # (B, T, H)


class Model(nn.Module):
    def __init__(self, op):
        super().__init__()
        self.inp, self.pick, self.head = nn.Linear(F_IN, H), Pick(op), nn.Linear(H, C)
        self.pos = nn.Parameter(torch.randn(T, 1))

    def forward(self, x: Tensor) -> Tensor:
        h = self.inp(x)  # (B, T, H)
        y = self.pick(h) * self.pos  # (B, T, H): each feature and position its own
        return self.head(torch.tanh(y).mean(1) + h.mean(1))


def batch(seed: int, b: int = 3) -> tuple[tuple[Tensor], Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, T, F_IN, generator=g, dtype=torch.float64)
    return (x,), torch.randint(0, C, (b,), generator=g)


def scored(op, sizes: tuple[int, ...]) -> tuple[Engine, list[str]]:
    """Norms and inner products with the loop's mean gradient of a reference batch, each batch
    (of ``sizes``) through one Engine: exact against the float64 loop, or refused (the why)."""
    torch.manual_seed(0)
    model, refused = Model(op).double().eval(), []
    with Engine(model, resolve_loss(LOSS)) as engine:
        names = [p.name for p in engine.plan.included]
        ref = batch(9, 2)
        refs = {
            n: g.mean(0, keepdim=True)
            for n, g in naive_grads(model, *ref, resolve_loss(LOSS), names)[1].items()
        }
        for seed, b in enumerate(sizes):
            inputs, y = batch(seed, b)
            try:
                scores = engine.norms(inputs, y, refs=refs)
            except ModelError as e:
                refused.append(str(e))
                continue
            norms = reference_norms(model, inputs, y, LOSS)[1].square()
            assert_rel_close(total(scores.norm_sq), norms, 1e-9)
            inner = reference_influence(model, inputs, y, ref, LOSS)[0][:, 0]
            assert_rel_close(total(scores.inner)[:, 0], inner, 1e-9)
    return engine, refused


@pytest.mark.parametrize("case", [*CROSSED, *BATCH, *(f"{k} (proof)" for k in REFUSED)])
def test_an_index_of_another_example_refused_or_exact(case: str):
    op, f = {**CROSSED, **BATCH, **{f"{k} (proof)": v for k, v in REFUSED.items()}}[case]
    _, refused = scored(f, (3, 3, 3))
    assert refused  # the examples checked alone differ on some batch
    assert all("mixes the examples of a batch" in why for why in refused), refused
    named = [why for why in refused if "(after" in why]
    assert all(f"(after {op}" in why for why in named), named
    picked = f"(after {op}, picked by another example's values in pick)"
    direct = op not in ("mul", "add", "sum") and not case.endswith("(proof)")
    assert not direct or all(picked in why for why in named), named
    assert named or case.endswith("(proof)"), refused  # refused at analysis, naming the op


@pytest.mark.parametrize("case", list(OWN))
def test_an_index_of_the_example_itself_stays_served(case: str):
    engine, refused = scored(OWN[case], (3, 3, 1))
    assert not refused, refused[0]
    assert_fallback(engine)


@pytest.mark.parametrize("case", list(CROSSED))
def test_alone_an_example_picks_by_its_own_values(case: str):
    """At batch 1, another example's values are the example's own: served, exact."""
    engine, refused = scored(CROSSED[case][1], (1, 1))
    assert not refused, refused[0]
    assert_fallback(engine)


def hits(h: Tensor) -> Tensor:
    """The features whose sum over the whole batch is positive (``nonzero``, (n, 1))."""
    return (h.detach().sum((0, 1)) > 0).nonzero()


def host_int(h: Tensor) -> int:
    """The feature the whole batch sums highest, read on the host as a Python integer."""
    return int(h.detach().sum((0, 1)).argmax())


# ids a mask of the whole batch hit, or its values read on the host, that pick for every example
# (silently wrong before: some of the hits taken as every one, a Python integer unseen)
HIT = {
    "first-hit": lambda h, m: h * m.w[(h.detach().sum((0, 1)) > 0).nonzero()[0]],
    "first-hit-sliced": lambda h, m: h * m.w[(h.detach().sum((0, 1)) > 0).nonzero()[:1, 0]],
    "first-unique-id": lambda h, m: h * m.w[h.detach().argmax(-1).unique()[0]],
    "host-int": lambda h, m: h * m.w[host_int(h)],
    "host-int-select": lambda h, m: h * m.w.select(0, host_int(h)),
    "host-int-feature": lambda h, m: h * h[..., host_int(h), None],
    "host-int-setitem": lambda h, m: put(h, (..., host_int(h)), h[..., 0]),
    "host-item": lambda h, m: h * m.w[h.detach().sum((0, 1)).argmax().item()],
    "host-tolist": lambda h, m: (
        h * m.w[h.detach().sum((0, 1)).argmax(-1, keepdim=True).tolist()[0]]
    ),
    "first-example-item": lambda h, m: h * m.w[h.detach()[0].sum(0).argmax().item()],
    "first-example-int": lambda h, m: h * m.w[int(h.detach()[0].sum(0).argmax())],
    # a slab of every id the batch hit on every row: which ids a loop visits is the batch's
    "sum-over-hits": lambda h, m: h * sum(m.w[e[0]] for e in hits(h)),
    "sum-over-hit-list": lambda h, m: h * sum(m.w[e[0]] for e in hits(h).tolist()),
    "sum-over-unique": lambda h, m: h * sum(m.w[e] for e in h.detach().argmax(-1).unique()),
}
# each example's own value read on the host, picking for that example alone: its own (by
# int(), matched by value: where two examples read the same, exact on the fallback)
OWN_READ = {
    "item": lambda h, m: torch.stack(
        [h[i] * m.w[h.detach()[i].sum(0).argmax().item()] for i in range(h.shape[0])]
    ),
    "int": lambda h, m: torch.stack(
        [h[i] * m.w[int(h.detach()[i, 0].argmax() * 0)] for i in range(h.shape[0])]
    ),
}


@pytest.mark.parametrize("case", list(HIT))
def test_ids_the_batch_picked_by_position_or_read_on_the_host_refused(case: str):
    _, refused = scored(HIT[case], (3, 3, 3))
    assert refused  # the examples checked alone differ on some batch
    assert all("mixes the examples of a batch" in why for why in refused), refused


@pytest.mark.parametrize("case", ["host-int", "host-int-feature"])
def test_alone_an_example_reads_its_own_values_on_the_host(case: str):
    engine, refused = scored(HIT[case], (1, 1))
    assert not refused, refused[0]
    assert_fallback(engine)


def test_a_slab_of_a_hit_id_on_rows_not_routed_to_it_is_named():
    """Refused at the analysis, the op named; every later batch refused or exact (its
    examples checked alone on the fallback: a slab on every row, whichever ids)."""
    _, refused = scored(HIT["sum-over-hits"], (4, 3, 3))
    assert refused, refused
    assert "(after mul: a slab of an id the batch hit, on rows not routed to it)" in refused[0]


@pytest.mark.parametrize("case", list(OWN_READ))
def test_an_example_s_own_value_read_on_the_host_picks_for_it_exactly(case: str):
    _, refused = scored(OWN_READ[case], (3, 3, 1))
    assert not refused, refused[0]
