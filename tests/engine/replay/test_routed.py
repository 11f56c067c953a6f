"""Routed regions (``engine/replay/routed.py``): experts whose rows the batch's values pick,
replayed by following each row's example on the device, exact against the per-example loop on
every batch; a batch whose rows land otherwise than the analysed batch's is analysed in full;
a region whose rows cannot be followed goes back to the trace for good."""

from __future__ import annotations

import pytest
import torch
from moe_models import Block, Experts, H, LoopExperts
from oracle import assert_rel_close
from syncs import counted
from torch import Tensor, nn

from gradscope.engine import Engine, Forward, Want, naive_grads, total
from gradscope.errors import ModelError
from gradscope.losses import resolve_loss

B, T, CLASSES = 3, 5, 3


class Model(nn.Module):
    def __init__(self, experts: Experts):
        super().__init__()
        self.inp, self.block, self.head = nn.Linear(H, H), Block(experts), nn.Linear(H, CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.block(self.inp(x)).mean(1))


def _batch(seed: int) -> tuple[tuple[Tensor], Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, T, H, generator=g),), torch.randint(0, CLASSES, (B,), generator=g)


LOSS = resolve_loss("cross_entropy")


def _check(model: nn.Module, engine: Engine, seed: int, refs: dict[str, Tensor]) -> None:
    (x,), y = _batch(seed)
    scores = engine.scores((x,), y, Want(norms=True, refs=refs))
    names = [p.name for p in engine.plan.included]
    _, grads = naive_grads(model, (x,), y, LOSS, names, Forward())
    norms = torch.stack([g.flatten(1).double().pow(2).sum(1) for g in grads.values()]).sum(0)
    assert_rel_close(total(scores.norm_sq), norms, 1e-5)
    for name, ref in refs.items():
        expected = grads[name].flatten(1).double() @ ref.flatten().double()
        assert_rel_close(scores.inner[name][:, 0].double(), expected, 1e-5)


def _refs(model: nn.Module) -> dict[str, Tensor]:
    torch.manual_seed(1)
    return {n: torch.randn(1, *p.shape) for n, p in model.named_parameters()}


def _exact_over(model: nn.Module, batches: int = 3) -> Engine:
    """One Engine over ``batches`` batches, each checked against the loop with references;
    the Engine, for what its record kept."""
    refs = _refs(model)
    with Engine(model, LOSS) as engine:
        for seed in range(batches):
            _check(model, engine, seed, refs)
    return engine


@pytest.mark.parametrize("transposed", [False, True], ids=["W^T", "W"])
def test_routed_experts_replay_exact(transposed: bool):
    torch.manual_seed(0)
    model = Model(Experts(transposed)).eval()
    engine = _exact_over(model, 4)
    findings = engine.record.at(*_batch(0))
    (program,) = findings.programs
    assert findings.replays == 3, findings.why
    assert [s.routed for s in program.steps if hasattr(s, "routed")] == [True]  # the experts
    assert not program.varies and not engine.plan.fallback


def test_layers_of_experts_answered_together_are_exact():
    """Two blocks of experts of one shape: their reads' norms are answered by one batched
    product at the backward's end (``Batched``), each exact, with references too."""

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.first, self.second = Block(Experts()), Block(Experts())
            self.head = nn.Linear(H, CLASSES)

        def forward(self, x: Tensor) -> Tensor:
            return self.head(self.second(self.first(x)).mean(1))

    torch.manual_seed(0)
    model = Two().eval()
    refs = _refs(model)
    with Engine(model, LOSS) as engine:
        for seed in range(3):
            _check(model, engine, seed, refs)
            (x,), y = _batch(seed)
            norms = engine.norms((x,), y).norm_sq  # norms alone: the batched route
            names = [p.name for p in engine.plan.included]
            _, grads = naive_grads(model, (x,), y, LOSS, names, Forward())
            for name in ("first.experts.gate_up", "second.experts.down"):
                expected = grads[name].flatten(1).double().pow(2).sum(1)
                assert_rel_close(norms[name].double(), expected, 1e-5)


def test_calls_after_the_experts_read_their_rows_as_they_are():
    """The experts' output, put back and reshaped to (B, T, H), and the residual added to it:
    each row is its example's by values, not by the trace's own tensor; the norm and the head
    after it read (B, T, H) as it is, with no layout to apply on every batch, exact."""

    class After(nn.Module):
        def __init__(self):
            super().__init__()
            self.block, self.norm = Block(Experts()), nn.LayerNorm(H)
            self.head = nn.Linear(H, CLASSES)

        def forward(self, x: Tensor) -> Tensor:
            return self.head(self.norm(self.block(x))).mean(1)

    torch.manual_seed(0)
    model = After().eval()
    (program,) = _exact_over(model).record.at(*_batch(0)).programs
    after = [s for s in program.steps if s.module in (id(model.norm), id(model.head))]
    assert len(after) == 2 and all(s.rows is None for s in after)


@pytest.mark.parametrize(
    ("transposed", "biased"),
    [(False, False), (True, False), (True, True)],
    ids=["linear", "x @ W[e]", "x @ W[e] + b[e]"],
)
def test_experts_the_batch_picks_replay_as_many_reads_as_it_makes(transposed: bool, biased: bool):
    """Eager experts: which experts run, and so how many reads, the batch's values say; an open
    routed region serves every read of the kinds analysed, exact; a read of another parameter
    fails its witness."""
    torch.manual_seed(0)
    experts = LoopExperts(transposed=transposed, biased=biased)
    model = Model(experts).eval()
    refs = _refs(model)
    with Engine(model, LOSS) as engine:
        for seed in range(4):
            _check(model, engine, seed, refs)
        findings = engine.record.at(*_batch(0))
        assert findings.replays == 3, findings.why
        (call,) = [s for s in findings.programs[-1].steps if hasattr(s, "routed")]
        assert call.routed and call.open
        experts.extra = True
        _check(model, engine, 4, refs)
    assert findings.replays == 3 and "another read" in findings.why, findings.why


class Positions(nn.Module):
    """A learned position added to the tokens: a read outside its module's calls whose
    gradient nothing below it waits for (the backward requests it)."""

    def __init__(self, tokens: int):
        super().__init__()
        self.pos, self.fc = nn.Parameter(torch.randn(tokens, H) / 3), nn.Linear(H, H)

    def forward(self, h: Tensor) -> Tensor:
        return self.fc(h + self.pos)


def test_reads_after_an_open_region_are_requested_as_each_batch_makes_them():
    """Which experts run, and so how many reads the open region makes, differs batch to batch
    (two examples of one token): the reads after it move in the list of reads, and which the
    backward requests is read off each batch's graph, not taken by place from the analysed
    one (that zeroed an expert's output gradient, silently)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(H, H), Block(LoopExperts()), Positions(1), nn.Flatten())
    model.append(nn.Linear(H, CLASSES)).eval()
    refs = _refs(model)
    batches = []
    for seed in range(8):
        g = torch.Generator().manual_seed(seed)
        x, y = torch.randn(2, 1, H, generator=g), torch.randint(0, CLASSES, (2,), generator=g)
        batches.append(((x,), y))
    with Engine(model, LOSS) as engine:
        for inputs, y in batches:
            scores = engine.scores(inputs, y, Want(norms=True, refs=refs))
            names = [p.name for p in engine.plan.included]
            _, grads = naive_grads(model, inputs, y, LOSS, names, Forward())
            norms = torch.stack([g.flatten(1).double().pow(2).sum(1) for g in grads.values()])
            assert_rel_close(total(scores.norm_sq), norms.sum(0), 1e-5)
        findings = engine.record.at(*batches[0])
    assert findings.replays == 7, findings.why


def test_experts_cast_to_float32_in_a_float64_model_replay_exact():
    """``x.float() @ W[e].float()`` in a float64 model: the cast of an expert's matrix is
    followed to its read; exact on every batch against the float64 loop."""
    torch.manual_seed(0)
    model = Model(LoopExperts(transposed=True, cast=True)).double().eval()
    with Engine(model, LOSS) as engine:
        for seed in range(3):
            (x,), y = _batch(seed)
            x = x.double()
            scores = engine.scores((x,), y, Want(norms=True))
            names = [p.name for p in engine.plan.included]
            _, grads = naive_grads(model, (x,), y, LOSS, names, Forward())
            norms = torch.stack([g.flatten(1).pow(2).sum(1) for g in grads.values()]).sum(0)
            assert_rel_close(total(scores.norm_sq), norms, 1e-5)
        findings = engine.record.at((x,), y)
        (call,) = [s for s in findings.programs[-1].steps if hasattr(s, "routed")]
    assert findings.replays == 2 and call.routed, findings.why


def test_rows_put_in_another_example_are_analysed():
    """A replayed batch whose experts put rows back where another example's were (the same ops
    on the same shapes) fails the witness on the device: the batch is analysed in full, which
    finds the examples mixed and says so."""
    torch.manual_seed(0)
    experts = Experts()
    model = Model(experts).eval()
    with Engine(model, LOSS) as engine:
        engine.norms(*_batch(0))
        experts.shift = T * 2  # the next example's tokens, top 2 each
        with pytest.raises(ModelError, match="mixes the examples"):
            engine.norms(*_batch(1))
        findings = engine.record.at(*_batch(0))
    assert findings.replays == 0 and "rows" in findings.why, findings.why


def test_rows_the_replay_cannot_follow_go_back_to_the_trace():
    """An op the rows cannot be followed through (a flip of the tokens, flipped back) inside the
    experts: the batch is analysed, and the module's later regions run under the trace, exact."""
    torch.manual_seed(0)
    model = Model(Experts(then=lambda x: x.flip(0).flip(0))).eval()
    refs = _refs(model)
    with Engine(model, LOSS) as engine:
        for seed in range(4):
            _check(model, engine, seed, refs)
        findings = engine.record.at(*_batch(0))
        assert Experts in engine.record.traced
        assert findings.replays >= 2 and findings.programs[-1].varies


@pytest.mark.parametrize("shift", [0, B * T * 2], ids=["settled", "by values"])
def test_a_routed_replay_reads_a_flag_only_where_the_values_decide(shift: int):
    """Rows put back by the inverse of the permutation that gathered them are their tokens'
    whatever the values (``replay/forms.py``): no flag, no sync more than a plain step. Put
    back a whole turn on (``(back + S) % S``: the same rows, by values the replay does not
    follow), what the values decide is read back once, at the forward's end: one sync more,
    however many experts and layers."""
    torch.manual_seed(0)
    experts = Experts()
    experts.shift = shift
    model = Model(experts).eval()
    params = list(model.parameters())
    with Engine(model, LOSS) as engine:
        for seed in range(2):
            engine.norms(*_batch(seed))
        inputs, targets = _batch(2)
        with counted() as plain:
            torch.autograd.grad(LOSS(model(*inputs), targets).sum(), params)
        with counted() as ours:
            engine.norms(inputs, targets)
        assert engine.record.at(inputs, targets).replays == 2
    assert sorted(ours) == sorted([*plain, *(["__bool__"] if shift else [])]), (ours, plain)
