"""The fallback (torch.func vmap, else a per-example loop) against the float64 per-example loop."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from oracle import Case, assert_case_matches_loop, assert_rel_close, reference_norms
from torch import nn

import gradscope
from gradscope.engine import FALLBACK, FALLBACK_LOOP, Engine, Forward, naive_grads
from gradscope.losses import resolve_loss


class Functional(nn.Module):
    """Reads a Linear's weight and bias outside its calls, never calling the Linear: no hook fires.
    ``addmm`` (``b + x @ W.T``, served as the two); scaled by ``beta``, by an op the tap does not
    serve."""

    def __init__(self, op: str = "linear"):
        super().__init__()
        self.fc, self.head = nn.Linear(4, 5), nn.Linear(5, 3)
        self.op = op

    def forward(self, x):
        w, b = self.fc.weight, self.fc.bias
        if self.op == "linear":
            h = F.linear(x, w, b)
        else:
            h = torch.addmm(b, x, w.t(), beta=2.0 if self.op == "scaled" else 1.0)
        return self.head(torch.tanh(h))


class Recurrent(nn.Module):
    """A classifier on the last output of a batch_first LSTM, GRU or RNN."""

    def __init__(self, cell: type[nn.RNNBase]):
        super().__init__()
        self.rnn = cell(4, 6, num_layers=2, batch_first=True)
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        out, _ = self.rnn(x)
        return self.head(out[:, -1])


class Scale(nn.Module):
    """A learned per-feature scale: a raw nn.Parameter no rule knows."""

    def __init__(self, n: int):
        super().__init__()
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, n))

    def forward(self, x):
        return x * self.gain


class Positional(nn.Module):
    """A learned positional table held directly by the top-level model, then rule-served layers."""

    def __init__(self):
        super().__init__()
        self.pos = nn.Parameter(torch.randn(5, 4))
        self.fc = nn.Linear(4, 4)
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        return self.out(torch.tanh(self.fc(x + self.pos))).mean(1)  # (B, 2)


class SharedTable(nn.Module):
    """A Linear layer run once on a table shared by the batch, its output broadcast over it."""

    def __init__(self, t: int):
        super().__init__()
        self.register_buffer("table", torch.randn(t, 4))
        self.proj, self.out = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        return self.out(torch.tanh(x + self.proj(self.table))).mean(1)  # (B, T, 4) -> (B, 2)


class SeqFirst(nn.Module):
    """A Linear layer on (T, B, in), as batch_first=False models run it: rows are positions."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(x.transpose(0, 1)).transpose(0, 1)  # (B, T, 3)


class DiagScale(nn.Module):
    """A learned per-feature scale read through ``torch.mm``, an op the tap does not serve."""

    def __init__(self, n: int):
        super().__init__()
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, n))

    def forward(self, x):
        return torch.mm(x, torch.diag(self.gain))


class ItemGate(nn.Module):
    """Data-dependent control flow on a Python bool: vmap cannot run it, the loop can. The branch
    is the one each example alone takes too (a sign of the batch's sum would not be: examples of
    another batch took the other branch alone, and the loop then answered another question)."""

    def __init__(self):
        super().__init__()
        self.fc, self.scale = nn.Linear(4, 3), DiagScale(3)

    def forward(self, x):
        h = self.scale(self.fc(x))
        return h * 2 if torch.isfinite(h).all().item() else h - 1


def labels(out: torch.Tensor) -> torch.Tensor:
    return torch.randint(0, out.shape[-1], out.shape[:-1])


CASES = [
    Case("functional-linear", Functional, lambda b: (torch.randn(b, 4),), labels, "cross_entropy"),
    *(
        Case(cell.__name__.lower(), lambda c=cell: Recurrent(c), lambda b: (torch.randn(b, 5, 4),), labels, "cross_entropy")
        for cell in (nn.LSTM, nn.GRU, nn.RNN)
    ),
    Case("raw-parameter", lambda: nn.Sequential(nn.Linear(4, 5), Scale(5), nn.Tanh(), nn.Linear(5, 2)),
         lambda b: (torch.randn(b, 4),), torch.randn_like),
    Case("matmul-parameter", lambda: nn.Sequential(nn.Linear(4, 5), DiagScale(5), nn.Tanh(), nn.Linear(5, 2)),
         lambda b: (torch.randn(b, 4),), torch.randn_like, fallback=("1.gain",)),
    Case("top-level-parameter", Positional, lambda b: (torch.randn(b, 5, 4),), labels, "cross_entropy"),
    # T == B: the shapes alone cannot tell the table's rows from the examples
    Case("shared-call-t-equals-b", lambda: SharedTable(5), lambda b: (torch.randn(b, 5, 4),), labels, "cross_entropy"),
    Case("shared-call", lambda: SharedTable(3), lambda b: (torch.randn(b, 3, 4),), labels, "cross_entropy"),
    Case("seq-first-t-equals-b", SeqFirst, lambda b: (torch.randn(b, 5, 4),), labels, "cross_entropy"),
    Case("vmap-fails", ItemGate, lambda b: (torch.randn(b, 4),), torch.randn_like, fallback=("scale.gain",)),
    Case("lstm-batch-1", lambda: Recurrent(nn.LSTM), lambda b: (torch.randn(b, 5, 4),), labels, "cross_entropy", batch=1),
]  # fmt: skip


BY_ID = {case.id: case for case in CASES}


@pytest.mark.parametrize("case", CASES, ids=repr)
def test_fallback_matches_loop_float64(case: Case, tmp_path):
    assert_case_matches_loop(case, torch.float64, 1e-5, cli=tmp_path)


def _run(case: Case, batch: int | None = None):
    model, inputs, targets = case.build(torch.float64, batch)
    engine = Engine(model, resolve_loss(case.loss), forward=Forward(output=case.output))
    with engine:
        scores = engine.norms(inputs, targets)
    return model, inputs, targets, engine.plan, scores


def test_per_parameter_norms_add_up():
    """Rule-served and fallback parameters land in one result; each one is exact on its own."""
    model, inputs, targets, plan, scores = _run(BY_ID["matmul-parameter"])
    assert {p.name: p.rule for p in plan.params} == {
        "0.weight": "linear", "0.bias": "linear", "1.gain": FALLBACK,
        "3.weight": "linear", "3.bias": "linear",
    }  # fmt: skip
    assert plan.params[2].note == "no rule for DiagScale; read by mm"
    for name, norm_sq in scores.norm_sq.items():
        _, expected = reference_norms(model, inputs, targets, include=[name])
        assert_rel_close(norm_sq.sqrt(), expected, 1e-5)


@pytest.mark.parametrize("op", ["linear", "addmm", "scaled"])
def test_weight_read_outside_its_module_calls(op: str):
    """fc's hook never fires, yet its parameters reach the loss: F.linear and addmm on them are
    served where they run; an op the tap does not serve sends them to the fallback, named."""
    case = Case("functional", lambda: Functional(op), lambda b: (torch.randn(b, 4),), labels,
                "cross_entropy")  # fmt: skip
    model, inputs, targets, plan, scores = _run(case)
    rules = {p.name: p for p in plan.params}
    for name in ("fc.weight", "fc.bias"):
        assert rules[name].is_fallback == (op == "scaled"), rules[name].note
        if op == "scaled":
            assert "read by addmm" in rules[name].note
        _, expected = reference_norms(model, inputs, targets, "cross_entropy", include=[name])
        assert expected.min() > 0
        assert_rel_close(scores.norm_sq[name].sqrt(), expected, 1e-5)
    assert rules["head.weight"].rule == "linear"


def test_uncalled_module_that_never_reaches_the_loss_stays_on_its_rule():
    """An unused head gets zero gradient from its rule; nothing is moved to the fallback."""

    class Unused(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.spare = nn.Linear(4, 2), nn.Linear(4, 2)

        def forward(self, x):
            return self.fc(x)

    case = Case("unused", Unused, lambda b: (torch.randn(b, 4),), torch.randn_like)
    _, _, _, plan, scores = _run(case)
    assert all(p.rule == "linear" for p in plan.params)
    assert torch.equal(scores.norm_sq["spare.weight"], torch.zeros(5, dtype=torch.float64))


@pytest.mark.parametrize(
    ("case_id", "name"),
    [("shared-call-t-equals-b", "proj.weight"), ("shared-call", "proj.weight")],
)  # fmt: skip
def test_call_on_a_table_the_batch_shares_is_served_as_computed(case_id: str, name: str):
    """The Linear's output is the same for every example (computed from its parameters and a
    buffer): its per-example gradient goes back through the call (``engine/derived.py``)."""
    model, inputs, targets, plan, scores = _run(BY_ID[case_id])
    assert all(p.rule == "linear" for p in plan.params), [(p.name, p.note) for p in plan.params]
    _, expected = reference_norms(model, inputs, targets, "cross_entropy", include=[name])
    assert_rel_close(scores.norm_sq[name].sqrt(), expected, 1e-6)


def test_vmap_failure_is_remembered_and_the_loop_runs():
    *_, plan, _ = _run(BY_ID["vmap-fails"])
    rules = {p.name: p for p in plan.params}
    assert rules["scale.gain"].rule == FALLBACK_LOOP
    assert "vmap failed" in rules["scale.gain"].note
    assert rules["fc.weight"].rule == "linear"


def test_plan_notes_are_short_and_whole_under_debug(monkeypatch):
    """A fallback's note in the plan is one short line; ``GRADSCOPE_DEBUG`` gives it whole."""
    case = BY_ID["vmap-fails"]
    *_, plan, _ = _run(case)
    note = {p.name: p.note for p in plan.params}["scale.gain"]
    assert "vmap failed" in note and len(note) < 120, note
    monkeypatch.setenv("GRADSCOPE_DEBUG", "1")
    model, inputs, targets = case.build(torch.float64)  # a new model: a new fallback
    engine = Engine(model, resolve_loss(case.loss))
    with engine:
        engine.norms(inputs, targets)
    assert len(engine.plan.params[-1].note) > len(note)


def test_vmap_runs_in_chunks(monkeypatch):
    """A chunk smaller than the batch gives the same numbers: no example is dropped or repeated."""
    monkeypatch.setattr("gradscope.engine.backward.fallback.CHUNK_ELEMENTS", 1)
    model, inputs, targets = BY_ID["matmul-parameter"].build(torch.float64, batch=7)
    got = gradscope.per_example_norms(model, inputs, targets, "mse")
    _, expected = reference_norms(model, inputs, targets, "mse")
    assert_rel_close(got, expected, 1e-5)


def test_float32_fallback():
    assert_case_matches_loop(BY_ID["lstm"], torch.float32, 1e-4)


@pytest.mark.parametrize("case_id", ["lstm", "vmap-fails"])
def test_influence_through_the_fallback(case_id: str):
    """The hooks influence engine takes inner products of the fallback's gradients too."""
    case = BY_ID[case_id]
    model, inputs, targets = case.build(torch.float64, batch=6)
    train, ref = (
        (tuple(t[:4] for t in inputs), targets[:4]),
        (tuple(t[4:] for t in inputs), targets[4:]),
    )
    got = gradscope.per_example_influence(model, *train, *ref, case.loss, engine="hooks")
    with Engine(model, resolve_loss(case.loss)) as engine:
        names = [p.name for p in engine.plan.included]
        _, g = naive_grads(model, *train, resolve_loss(case.loss), names)
        _, r = naive_grads(model, *ref, resolve_loss(case.loss), names)
    expected = sum((g[n].flatten(1) * r[n].flatten(1).mean(0)).sum(1) for n in names)
    assert_rel_close(got, expected, 1e-5)
