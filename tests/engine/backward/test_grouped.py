"""Calls of modules a rule treats alike (``Rule.alike``) answered together: where a pass asks for
norms alone, small calls of alike modules on inputs of one shape are answered by one run of
their rule over the stacked examples (``backward/grouped.Grouped``). Exact against the float64 loop
on a model that mixes what may go together with what may not: tied and twice-called modules
(merged), a Linear without bias beside ones with, inputs of two lengths, a library norm."""

from __future__ import annotations

import families
import pytest
import torch
from oracle import Case, assert_case_matches_loop, assert_rel_close, reference_norms
from torch import Tensor, nn

import gradscope
from gradscope.engine import Engine, naive_grads
from gradscope.engine.backward import grouped, serve
from gradscope.engine.backward.grouped import Grouped
from gradscope.losses import resolve_loss


class Alike(nn.Module):
    """Blocks of alike Linears and norms, a tied pair, a module called twice, a bias-free
    Linear, and a second sequence of another length through Linears alike to the blocks."""

    def __init__(self, d: int = 6):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(d, d) for _ in range(4))
        self.others = nn.ModuleList(nn.Linear(d, d) for _ in range(4))
        self.norms = nn.ModuleList(nn.LayerNorm(d) for _ in range(3))
        self.rms = nn.ModuleList(families.LlamaRMSNorm(d) for _ in range(2))
        self.tied = nn.Linear(d, d)
        self.tied.weight = self.blocks[0].weight  # merged with blocks[0]
        self.twice = nn.Linear(d, d)
        self.bare = nn.Linear(d, d, bias=False)
        self.head = nn.Linear(d, 1)

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        norms = [*self.norms, self.norms[0]]  # the first norm called twice
        for block, other, norm in zip(self.blocks, self.others, norms, strict=True):
            x = torch.tanh(block(norm(x)))
            y = torch.tanh(other(y))  # alike Linears on a sequence of another length
        x = self.rms[1](self.tied(self.rms[0](x)))
        x = self.twice(self.twice(x)) + self.bare(x)
        return self.head(x.mean(1) + y.mean(1)).squeeze(1)


CASE = Case(
    "alike",
    Alike,
    lambda b: (torch.randn(b, 5, 6), torch.randn(b, 3, 6)),
    lambda out: torch.randn_like(out),
)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_alike_calls_answered_together_match_the_loop(tmp_path, monkeypatch, dtype):
    together: list[int] = []
    answer = Grouped._run

    def counting(self, reducer, batch, calls, inputs, grad):
        done = answer(self, reducer, batch, calls, inputs, grad)
        together.append(0 if done is None else len(calls))
        return done

    monkeypatch.setattr(Grouped, "_run", counting)
    assert_case_matches_loop(CASE, dtype, 1e-5 if dtype == torch.float64 else 1e-4, tmp_path)
    assert together and all(together), together  # groups of two or more, each answered


def test_a_group_whose_rule_fails_is_answered_call_by_call(monkeypatch):
    model, inputs, targets = CASE.build()
    monkeypatch.setattr(Grouped, "_run", lambda *args: None)
    got = gradscope.per_example_norms(model, inputs, targets, "mse")
    assert_rel_close(got, reference_norms(model, inputs, targets)[1], 1e-9)


def test_each_parameter_gets_its_own_calls_norms():
    model, inputs, targets = CASE.build()
    loss = resolve_loss("mse")
    with Engine(model, loss) as engine:
        names = [p.name for p in engine.plan.included]
        for seed in range(3):  # analysed, then replayed
            x, y = CASE.build(seed=seed)[1:] if seed else (inputs, targets)
            got = engine.norms(x, y).norm_sq
            _, grads = naive_grads(model, x, y, loss, names)
            for name, g in grads.items():
                assert_rel_close(got[name], g.flatten(1).pow(2).sum(1), 1e-9)


@pytest.mark.parametrize("exclude", [(), ("blocks.2.weight",)])
def test_inner_products_of_alike_calls_match_the_loop(monkeypatch, exclude):
    # three references a parameter; with blocks.2's weight left out, its group has no
    # references to stack and is answered call by call
    together: list[bool] = []
    answer = Grouped._run

    def noting(*args):
        done = answer(*args)
        together.append(done is not None)
        return done

    monkeypatch.setattr(Grouped, "_run", noting)
    model, inputs, targets = CASE.build()
    loss = resolve_loss("mse")
    with Engine(model, loss, exclude=exclude) as engine:
        names = [p.name for p in engine.plan.included]
        g = torch.Generator().manual_seed(5)
        refs = {p.name: torch.randn(3, *p.param.shape, generator=g).double()
                for p in engine.plan.included}  # fmt: skip
        for seed in range(3):  # analysed, then replayed
            x, y = CASE.build(seed=seed)[1:] if seed else (inputs, targets)
            got = engine.norms(x, y, refs=refs)
            _, grads = naive_grads(model, x, y, loss, names)
            for name, per in grads.items():
                want = per.flatten(1) @ refs[name].flatten(1).T  # (B, 3)
                assert_rel_close(got.inner[name], want, 1e-9)
                assert_rel_close(got.norm_sq[name], per.flatten(1).pow(2).sum(1), 1e-9)
    assert any(together) and (not exclude or not all(together))


def test_groups_run_smallest_first_give_their_answers_in_the_order_they_came(monkeypatch):
    # the order the reducer receives answers in is the order a total over parameters adds in;
    # every call held to the end, so that the groups of several sizes answer at once
    monkeypatch.setattr(serve, "held_budget", lambda calls: 1 << 40)
    model, inputs, targets = CASE.build()
    refs = {n: torch.randn(2, *p.shape) for n, p in model.named_parameters()}

    def passes() -> list[tuple[list, list]]:
        with Engine(model, resolve_loss("mse")) as engine:
            got = [engine.norms(inputs, targets, refs) for _ in range(2)]  # analysed, replayed
        return [(list(s.norm_sq.items()), list(s.inner.items())) for s in got]

    ran: list[list] = []

    def smallest(keys, key):
        ran.append(sorted(keys, key=key))
        return ran[-1]

    def as_they_came(keys, key):
        ran.append(list(keys))
        return ran[-1]

    monkeypatch.setattr(grouped, "sorted", smallest, raising=False)
    smallest_first = passes()
    ran_smallest, ran[:] = list(ran), []
    monkeypatch.setattr(grouped, "sorted", as_they_came, raising=False)
    in_order = passes()
    assert ran_smallest != ran  # the groups did run in another order
    for (norms, inner), (norms_, inner_) in zip(smallest_first, in_order, strict=True):
        assert [n for n, _ in norms] == [n for n, _ in norms_]
        assert [n for n, _ in inner] == [n for n, _ in inner_]
        assert all(
            torch.equal(a, b) for (_, a), (_, b) in zip(norms + inner, norms_ + inner_, strict=True)
        )


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("budget", [0, 200])
def test_held_calls_past_the_budget_are_answered_mid_backward(monkeypatch, batch, budget):
    # a budget of 0 answers each call as it comes; of 200 elements, a few calls at a time:
    # both mid-backward, and with the tied, twice-called and odd-length calls alike exact
    answered: list[int] = []
    answer = Grouped.answer

    def counting(self):
        answered.append(len(self._held))
        answer(self)

    monkeypatch.setattr(Grouped, "answer", counting)
    monkeypatch.setattr(serve, "held_budget", lambda calls: budget)
    model, inputs, targets = CASE.build(batch=batch)
    loss = resolve_loss("mse")
    with Engine(model, loss) as engine:
        names = [p.name for p in engine.plan.included]
        g = torch.Generator().manual_seed(3)
        refs = {p.name: torch.randn(2, *p.param.shape, generator=g).double()
                for p in engine.plan.included}  # fmt: skip
        for seed in range(3):  # analysed, then replayed
            x, y = CASE.build(batch=batch, seed=seed)[1:] if seed else (inputs, targets)
            answered.clear()
            got = engine.norms(x, y, refs=refs)
            assert len(answered) > 2  # answered as the budget filled, not once at the end
            _, grads = naive_grads(model, x, y, loss, names)
            for name, per in grads.items():
                assert_rel_close(got.norm_sq[name], per.flatten(1).pow(2).sum(1), 1e-9)
                assert_rel_close(got.inner[name], per.flatten(1) @ refs[name].flatten(1).T, 1e-9)


def test_what_a_pass_holds_stays_within_its_budget(monkeypatch):
    # the budget, a quarter of what the served calls hold: the held calls never
    # hold more once a call is taken, and some are answered before the backward ends
    budgets, held, take = [], [], Grouped.take

    def taking(self, call, grad):
        take(self, call, grad)
        budgets.append(self.budget)
        held.append(self._size)

    monkeypatch.setattr(Grouped, "take", taking)
    model, inputs, targets = CASE.build(batch=3)
    with Engine(model, resolve_loss("mse")) as engine:
        engine.norms(inputs, targets)
    assert held and all(0 <= h <= b for h, b in zip(held, budgets, strict=True))
    assert 0 in held[:-1]  # emptied mid-backward


def test_a_plan_of_no_modules_alike_holds_no_call(monkeypatch):
    # Linears of three shapes: no two calls could be answered together, so none is held
    # back; the Alike model's are
    made: list[Grouped] = []
    monkeypatch.setattr(serve, "Grouped", lambda *args: made.append(Grouped(*args)) or made[-1])
    unalike = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 1))
    x, y = torch.randn(3, 4, dtype=torch.float64), torch.randn(3, dtype=torch.float64)
    loss = resolve_loss("mse")
    with Engine(unalike.double(), loss) as engine:
        assert not engine.plan.alike
        names = [p.name for p in engine.plan.included]
        for _ in range(2):  # analysed, then replayed
            got = engine.norms((x,), y).norm_sq
            _, grads = naive_grads(unalike, (x,), y, loss, names)
            for name, g in grads.items():
                assert_rel_close(got[name], g.flatten(1).pow(2).sum(1), 1e-9)
    assert not made
    model, inputs, targets = CASE.build()
    with Engine(model, loss) as engine:
        assert engine.plan.alike
        engine.norms(inputs, targets)
    assert made
