"""Numbers of the batch's values read on the host and given back to torch through Python:
derived (``k + 1``, ``-k``, ``k % n``), made into tensors (``torch.tensor(k)``,
``torch.full``, ``new_tensor``, ``arange``), or used as an operand (``h * s``, a float the
whole batch gave). Every form here scored without a word before (0.05–0.41 off the float64
loop): the batch's value picks or scales for each example, where alone each example reads its
own. ``.item()``'s and ``.tolist()``'s numbers carry their owners through Python's arithmetic
(``analysis/tags.py``), so what they touch is MIXED and the batch is refused or exact on the
fallback; ``int(t)``'s and ``float(t)``'s are plain, and ``math.sqrt`` makes a float plain, so
every batch that reads one, or a float, has its every example checked alone. One example's own number, used for its own rows, stays
served with nothing on the fallback."""

from __future__ import annotations

import math

import pytest
import torch
from oracle import assert_fallback, assert_rel_close, reference_norms
from torch import Tensor, nn

import gradscope
from gradscope.engine import Engine, total
from gradscope.errors import ConfigError, ModelError
from gradscope.losses import resolve_loss
from tests.engine.analysis.test_crossed_indices import H, Model, batch, put, scored


def item(h: Tensor) -> int:
    """The feature the whole batch sums highest, read by ``.item()`` (tagged)."""
    return h.detach().sum((0, 1)).argmax().item()


def plain(h: Tensor) -> int:
    """The same, read by ``int()`` (a plain integer)."""
    return int(h.detach().sum((0, 1)).argmax())


DERIVED = {
    "item-plus-one": lambda h, m: h * m.w[(item(h) + 1) % H],
    "item-negated": lambda h, m: h * m.w[-item(h) - 1],
    "item-feature": lambda h, m: h * h[..., (item(h) + 1) % H, None],
    "item-setitem": lambda h, m: put(h, (..., (item(h) + 1) % H), h[..., 0]),
    "tolist-plus-one": lambda h, m: h * m.w[h.detach().sum((0, 1)).argsort().tolist()[0] + 0],
    "first-example-plus-one": lambda h, m: h * m.w[(h.detach()[0].sum(0).argmax().item() + 1) % H],
    "tensor-of-item": lambda h, m: h * m.w[torch.tensor(item(h))],
    "tensor-of-items": lambda h, m: h * m.w[torch.tensor([item(h), 0])].sum(),
    "full": lambda h, m: h * m.w[torch.full((1,), item(h))],
    "new_tensor": lambda h, m: h * m.w[h.new_tensor(item(h), dtype=torch.long)],
    "arange": lambda h, m: h * m.w[torch.arange(item(h), item(h) + 1)],
    "float-scale": lambda h, m: h * h.detach().abs().sum().item(),
    "float-scale-derived": lambda h, m: (2.0 * h.detach().abs().max().item() + 1) * h,
    "float-fill": lambda h, m: h + torch.full_like(h, h.detach().mean().item()),
    "float-clamp": lambda h, m: h.clamp(max=h.detach().median().item()),
    "int-of-item": lambda h, m: h * m.w[int(item(h))],
    "int-plus-one": lambda h, m: h * m.w[(plain(h) + 1) % H],
    "tensor-of-int": lambda h, m: h * m.w[torch.tensor(plain(h))],
    "float-of-tensor": lambda h, m: h * float(h.detach().abs().sum()),
    "math-of-float": lambda h, m: h * math.sqrt(h.detach().abs().sum().item()),
    # a size: each example alone pads or repeats by its own count
    "zeros-sized": lambda h, m: (
        h * torch.cat([h, h.new_zeros(*h.shape[:2], item(h) + 1)], -1).mean(-1, keepdim=True)
    ),
    "expand-sized": lambda h, m: (
        h * h[..., :1].expand(*h.shape[:2], item(h) + 1).sum(-1)[..., None]
    ),
    "repeat-sized": lambda h, m: h * h[..., :1].repeat(1, 1, item(h) + 1).sum(-1, keepdim=True),
    "pad-sized": lambda h, m: h * nn.functional.pad(h, (0, item(h) + 1)).mean(-1, keepdim=True),
}
# each example's own number, read and used for its own rows alone
OWN = {
    "item-plus-one": lambda h, m: torch.stack(
        [h[i] * m.w[(h.detach()[i].sum(0).argmax().item() + 1) % H] for i in range(len(h))]
    ),
    "float-scale": lambda h, m: torch.stack(
        [h[i] * (1 + h.detach()[i].abs().mean().item()) for i in range(len(h))]
    ),
}


@pytest.mark.parametrize("case", list(DERIVED))
def test_a_number_of_the_batch_s_values_refused_or_exact(case: str):
    _, refused = scored(DERIVED[case], (3, 3, 3))
    assert refused  # the examples checked alone differ on some batch
    assert all("mixes the examples of a batch" in why for why in refused), refused


@pytest.mark.parametrize("case", list(OWN))
def test_an_example_s_own_number_serves_its_rows_exactly(case: str):
    engine, refused = scored(OWN[case], (3, 3, 1))
    assert not refused, refused[0]
    assert_fallback(engine)


@pytest.mark.parametrize("case", ["item-plus-one", "int-plus-one", "float-of-tensor"])
def test_alone_an_example_reads_its_own_number(case: str):
    engine, refused = scored(DERIVED[case], (1, 1))
    assert not refused, refused[0]


class Reads(nn.Module):
    """Scales its input by the entry of ``w`` after the feature the whole batch sums highest,
    read by ``read``."""

    def __init__(self, read):
        super().__init__()
        self.lin, self.w, self.read = nn.Linear(4, 3), nn.Parameter(torch.randn(4)), read

    def forward(self, x: Tensor) -> Tensor:
        return self.lin(x * self.w[(self.read(x.detach().sum(0).argmax()) + 1) % 4])


def agreeing() -> Tensor:
    """Every example's highest feature is the batch's (0): alone, each reads what the batch
    reads."""
    x = torch.randn(3, 4, dtype=torch.float64)
    x[:, 0] += 10
    return x


def apart() -> Tensor:
    """The batch's highest feature is still 0, but alone the last two examples read 1."""
    x = torch.randn(3, 4, dtype=torch.float64) * 0.1
    x[0, 0], x[1:, 1] = 10, 3
    return x


@pytest.mark.parametrize(
    "read", [int, lambda t: int(float(t)), lambda t: t.item()], ids=["int", "float", "item"]
)
def test_a_later_batch_reading_the_same_number_is_checked_again(read):
    """The number a later batch reads is the one the analysed batch read: the program that
    batch left must not serve one whose examples alone read another (silently wrong before
    for ``int()`` and ``float()``: 6.6 off the loop)."""
    torch.manual_seed(0)
    model, loss, y = Reads(read).double(), resolve_loss("cross_entropy"), torch.tensor([0, 1, 2])
    with Engine(model, loss) as engine:
        for x in (agreeing(), agreeing()):
            norms = reference_norms(model, (x,), y, "cross_entropy")[1].square()
            assert_rel_close(total(engine.norms((x,), y).norm_sq), norms, 1e-9)
        with pytest.raises(ModelError, match="mixes the examples of a batch"):
            engine.norms((apart(),), y)


def test_sharded_a_batch_that_needs_its_examples_alone_is_refused():
    """Under ``distributed.shard: fsdp`` (``fsdp.decide`` marks the analysis sharded) no
    example runs alone: one run on one rank would meet another rank's other pass in the
    all-gathers. A batch whose every example must be checked alone (a plain number read) is
    refused in one line naming the setting, before any example runs alone."""
    torch.manual_seed(0)
    model, y = Reads(int).double(), torch.tensor([0, 1, 2])
    forwards = []
    model.register_forward_hook(lambda m, args, out: forwards.append(len(args[0])))
    with Engine(model, resolve_loss("cross_entropy")) as engine:
        engine.analysis.sharded = True
        with pytest.raises(ConfigError, match=r"^distributed.shard: fsdp: .* run it unsharded"):
            engine.norms((agreeing(),), y)
    assert 1 not in forwards  # no example ran alone


class SortedSplit(nn.Module):
    """Rows sorted by expert (the sign of a router) and split at the counts ``.tolist()`` read,
    each expert's rows through its own Linear and put back: a cut along the rows, each row its
    own example's, served with no example run alone."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(4, 1)
        self.experts = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

    def forward(self, x: Tensor) -> Tensor:  # (B, T, 4)
        flat = x.reshape(-1, 4)
        pick = (self.router(flat)[:, 0] > 0).long()
        order = torch.argsort(pick, stable=True)
        parts = flat[order].split(torch.bincount(pick, minlength=2).tolist())
        out = torch.cat([e(p) for e, p in zip(self.experts, parts, strict=True)])
        return torch.empty_like(out).index_copy(0, order, out).view(x.shape)


class Split(nn.Module):
    def __init__(self):
        super().__init__()
        self.block, self.head = SortedSplit(), nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.block(x)).mean(1))


def test_rows_split_at_counts_read_are_served_without_running_examples_alone():
    torch.manual_seed(0)
    model, y = Split().double(), torch.tensor([0, 1, 2])
    with Engine(model, resolve_loss("cross_entropy")) as engine:
        for seed in range(3):
            g = torch.Generator().manual_seed(seed)
            x = torch.randn(3, 5, 4, dtype=torch.float64, generator=g)
            norms = reference_norms(model, (x,), y, "cross_entropy")[1].square()
            assert_rel_close(total(engine.norms((x,), y).norm_sq), norms, 1e-9)
        findings = engine.record.at((x,), y)
    assert_fallback(engine)
    assert findings.replays == 2 and not any(p.alone for p in findings.programs)


@pytest.mark.parametrize(
    "case", ["own-item-plus-one", "own-float-scale", "item-plus-one", "int-plus-one"]
)
def test_fresh_api_calls_on_two_batches_exact_or_refused_the_model_untouched(case: str):
    """``gradscope.per_example_norms``, a fresh call for each of two batches of one shape and
    other values: each exact against the float64 loop, or refused as mixing (the batch's own
    number picking for all); the model's parameters and buffers as they were."""
    op = OWN[case.removeprefix("own-")] if case.startswith("own-") else DERIVED[case]
    torch.manual_seed(0)
    model = Model(op).double().eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    refused = 0
    for seed in (1, 2):
        (x,), y = batch(seed)
        try:
            got = gradscope.per_example_norms(model, x, y, "cross_entropy")
        except ModelError as e:
            assert "mixes the examples of a batch" in str(e), e
            refused += 1
        else:
            assert_rel_close(got, reference_norms(model, (x,), y, "cross_entropy")[1], 1e-9)
        assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert (refused > 0) != case.startswith("own-"), refused


class _FloatBranch(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(6, 5), torch.nn.Linear(5, 3)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return self.b(h * 2 if h.max().item() > 0.9 else h)


def test_a_float_read_compared_with_a_number_runs_each_example_whole():
    """``if h.max().item() > 0.9:`` raised AttributeError ('ReadFloat' has no 'bound'), as the
    model's fault, on every batch."""
    torch.manual_seed(0)
    model = _FloatBranch().double()
    kept = {k: v.clone() for k, v in model.state_dict().items()}
    for _ in range(2):  # two batches of one shape, other values: a fresh call each
        x, y = torch.randn(8, 6, dtype=torch.float64), torch.randint(0, 3, (8,))
        got = gradscope.per_example_norms(model, x, y)
        want = []
        for i in range(8):
            loss = torch.nn.functional.cross_entropy(model(x[i : i + 1]), y[i : i + 1])
            grads = torch.autograd.grad(loss, list(model.parameters()))
            want.append(torch.sqrt(sum(g.square().sum() for g in grads)))
        torch.testing.assert_close(got, torch.stack(want), rtol=1e-12, atol=0)
        assert all(torch.equal(v, kept[k]) for k, v in model.state_dict().items())
