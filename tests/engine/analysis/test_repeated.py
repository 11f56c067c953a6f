"""A batch analysed again because the model's state changed (a recurrent state it keeps, a
counter) is self-checked only where its program's structure is not one already checked, at
the hooked modules' state that check began with: a state that changes between batches and
leaves the forward's ops alone costs the analysis, not the self-check too; one that changes
the ops (a branch on a counter), or a hooked module's own state, is checked again. Every
batch's norms are the float64 loop's, checked or not."""

from __future__ import annotations

import dataclasses

import torch
from oracle import assert_rel_close
from torch import Tensor, nn

from gradscope.engine import Engine, Forward, engine, naive_grads
from gradscope.engine.analysis.program import alike, structure
from gradscope.engine.recipes import Recipe
from gradscope.losses import resolve_loss

D, CLASSES = 6, 3


class Recurrent(nn.Module):
    """Keeps the state its last call ended in (RecurrentGemma's blocks do), and counts its
    calls; ``doubled``: its input doubled first, another op."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.calls, self.state, self.doubled = 0, None, False

    def forward(self, h: Tensor) -> Tensor:  # (B, T, D)
        self.calls += 1
        if self.doubled:
            h = h * 2
        out = torch.tanh(self.fc(h))
        self.state = out[:, -1].detach()  # a new tensor every batch
        return out


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Linear(4, D)
        self.block = Recurrent()
        self.scale = nn.Parameter(torch.ones(D))  # read at the top level: a recipe's
        self.head = nn.Linear(D, CLASSES)

    def forward(self, x: Tensor) -> Tensor:  # (B, T, 4)
        return self.head((self.block(self.emb(x)) * self.scale).mean(1))


def _batches(n: int, b: int = 3) -> list:
    return [
        ((torch.randn(b, 5, 4, dtype=torch.float64),), torch.arange(b) % CLASSES) for _ in range(n)
    ]


def _scored(model: nn.Module, batches: list, monkeypatch, between=None) -> tuple[Engine, list]:
    """Each batch through one Engine against the float64 loop; whether each was self-checked
    (the two single examples' backward run)."""
    checks: list[int] = []
    singles = engine.Singles

    def counted(*args, **kwargs):
        checks[-1] += 1
        return singles(*args, **kwargs)

    monkeypatch.setattr(engine, "Singles", counted)
    eng = Engine(model, resolve_loss("cross_entropy"))
    names = [n for n, _ in model.named_parameters()]
    with eng:
        for k, (inputs, targets) in enumerate(batches):
            if between is not None:
                between(k)
            checks.append(0)
            got = eng.norms(inputs, targets).norm_sq
            state = (model.block.calls, model.block.state)
            _, grads = naive_grads(
                model, inputs, targets, resolve_loss("cross_entropy"), names, Forward()
            )
            model.block.calls, model.block.state = state  # the loop's forwards undone
            for name, g in grads.items():
                assert_rel_close(got[name], g.reshape(len(g), -1).pow(2).sum(1), 1e-9)
    return eng, checks


def test_a_state_changed_batch_of_a_checked_structure_is_not_checked_again(monkeypatch):
    torch.manual_seed(0)
    model = Model().double()
    batches = _batches(4)
    eng, checks = _scored(model, batches, monkeypatch)
    findings = eng.record.at(*batches[0])
    assert (findings.replays, findings.analyses) == (0, 4)  # the state differs every batch
    assert checks == [1, 0, 0, 0]
    assert findings.repeated == 3


def test_a_batch_of_other_ops_is_checked_again(monkeypatch):
    """A flag the forward branches on, set on every other batch: two structures, each
    checked once, then each batch of either skips its check."""
    torch.manual_seed(0)
    model = Model().double()
    batches = _batches(5)

    def between(k: int) -> None:
        model.block.doubled = bool(k % 2)

    eng, checks = _scored(model, batches, monkeypatch, between)
    assert checks == [1, 1, 0, 0, 0]
    assert eng.record.at(*batches[0]).repeated == 3


def test_a_hooked_module_of_another_state_is_checked_again(monkeypatch):
    """An attribute of a hooked module (the Linear whose rule serves the block) changed
    between batches: its rule may read it, so the batch is checked again, though its
    program's structure is one checked."""
    torch.manual_seed(0)
    model = Model().double()

    def between(k: int) -> None:
        model.block.fc.mark = k // 2  # the hooked module's state: new at batches 0, 2

    eng, checks = _scored(model, _batches(4), monkeypatch, between)
    assert checks == [1, 0, 1, 0]


def test_structures_compare_every_field_tensors_by_value():
    """``alike``: two batches' programs, of two states, one structure, whatever a replay kept
    of them; a step's node count another structure; a recipe's tensors (left out of its own ``==``) compared by value."""
    torch.manual_seed(0)
    model = Model().double()
    eng = Engine(model, resolve_loss("cross_entropy"))
    with eng:
        for inputs, targets in _batches(2):
            eng.norms(inputs, targets)
    first, second = eng.record.at(*_batches(1)[0]).programs[-2:]
    assert first.state is not second.state
    assert alike(structure(first), structure(second))
    # what a replay keeps of a program (its training step's requests) is not its structure
    kept = dataclasses.replace(second, trained={0: None})
    assert alike(structure(first), structure(kept))
    step = dataclasses.replace(first.steps[0], before=first.steps[0].before + 1)
    moved = dataclasses.replace(first, steps=(step, *first.steps[1:]))
    assert not alike(structure(moved), structure(second))
    elements = (torch.tensor([0, 3]), torch.tensor([1, 2]), torch.tensor([0, 1]))
    recipe = Recipe("mul", (("arg1", "scale"),), (2, 2), None, elements=elements)
    other = dataclasses.replace(recipe, elements=(*elements[:2], torch.tensor([1, 0])))
    assert recipe == other and not alike(recipe, other)
    assert alike(recipe, dataclasses.replace(recipe, elements=tuple(t.clone() for t in elements)))
