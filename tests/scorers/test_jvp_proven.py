"""Forward mode scores only what the hooks' analysis proved: a signature analysed, its examples
found apart, its forward the same calls whatever the values (``engine.influence.proven``).
Forward mode runs the model as it is: on a model that mixes the examples of a batch it gave
each example the batch's derivative without a word, where the hooks' pass refuses."""

from __future__ import annotations

import pytest
import torch
from oracle import reference_influence
from torch import Tensor, nn

import gradscope
from gradscope.engine import Engine, Influence, reference_gradients
from gradscope.errors import GradscopeError
from gradscope.losses import resolve_loss


class Crossed(nn.Module):
    """Each example's features gathered in the order of the next example's values."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.a(x)
        return self.b(h.gather(1, h.detach().roll(1, 0).argsort(-1)) * torch.arange(1.0, 5.0))


class Masked(nn.Module):
    """Rows zeroed where the previous example's first feature is positive."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.a(x)
        return self.b(h.masked_fill(x.roll(1, 0)[:, :1] > 0, 0.0))


class Branches(nn.Module):
    """A branch taken by a value read on the host: the calls may differ batch to batch."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.a(x)
        return self.b(h.tanh() if bool(x[0, 0] > 100) else h)


def _data(seed: int, batch: int = 3) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 4, generator=g, dtype=torch.float64), torch.randint(
        0, 3, (batch,), generator=g
    )


@pytest.mark.parametrize("model", [Crossed, Masked], ids=lambda m: m.__name__)
@pytest.mark.parametrize("engine", ["auto", "jvp"])
def test_a_model_that_mixes_the_examples_is_refused(model, engine: str) -> None:
    torch.manual_seed(0)
    m = model().double()
    (x, y), (xr, yr) = _data(0), _data(1, batch=2)
    with pytest.raises(GradscopeError, match="mixes the examples"):
        gradscope.per_example_influence(m, x, y, xr, yr, loss="cross_entropy", engine=engine)


def _scored(model: nn.Module, batches: list[tuple[Tensor, Tensor]]) -> list[bool]:
    """Whether forward mode scored each batch, each batch's scores checked against the loop."""
    refs = _data(9, batch=2)
    core, used = Engine(model, resolve_loss("cross_entropy")), []
    with core:
        scorer = Influence(core, reference_gradients(core, [((refs[0],), refs[1])]), "jvp", False)
        for x, y in batches:
            scores = scorer((x,), y)
            used.append(scorer.forward_mode)
            expected, _, _ = reference_influence(
                model, (x,), y, ((refs[0],), refs[1]), "cross_entropy"
            )
            torch.testing.assert_close(scores.inner, expected, rtol=1e-9, atol=1e-12)
    return used


def test_forward_mode_scores_a_signature_once_the_hooks_analysed_it() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    batches = [_data(0), _data(1), _data(2, batch=1), _data(3, batch=1), _data(4)]
    assert _scored(model, batches) == [False, True, False, True, True]


def test_a_forward_that_reads_values_on_the_host_stays_on_the_hooks() -> None:
    torch.manual_seed(0)
    assert _scored(Branches().double(), [_data(0), _data(1), _data(2)]) == [False] * 3


class Centred(nn.Module):
    """Its hidden rows centred on the batch's mean once ``centred`` is set: a flag its forward
    reads, as a mode switch of the model's own."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.centred = nn.Linear(4, 4), nn.Linear(4, 3), False

    def forward(self, x: Tensor) -> Tensor:
        h = self.a(x).tanh()
        return self.b(h - h.mean(0) if self.centred else h)


def _rolled(model: Centred) -> None:
    model.a.register_forward_hook(lambda module, args, out: out.roll(1, 0))


def _centred(model: Centred) -> None:
    model.centred = True


@pytest.mark.parametrize("change", [_rolled, _centred], ids=["a hook added", "a flag set"])
def test_a_model_changed_since_the_proof_sends_the_batch_to_the_hooks(change) -> None:
    """Between two batches of one scorer, a hook added or a flag of the model's own set, either
    making the forward mix the examples: forward mode would score it silently (the flag's
    was, its proof kept while the hooks were the same); the hooks' pass refuses it."""
    torch.manual_seed(0)
    model = Centred().double()
    refs = _data(9, batch=2)
    with Engine(model, resolve_loss("cross_entropy")) as core:
        scorer = Influence(core, reference_gradients(core, [((refs[0],), refs[1])]), "jvp", False)
        for seed in (0, 1):
            x, y = _data(seed)
            scorer((x,), y)
        assert scorer.forward_mode
        change(model)
        x, y = _data(2)
        with pytest.raises(GradscopeError, match="mixes the examples"):
            scorer((x,), y)
