"""A program replays only at the state its batch began with: a forward that reads a module's own
attributes or the tensors it keeps may make other ops at the same calls, shapes and autograd
node counts (a mean over the batch where it was over the features, rows gathered by an offset
the model keeps), which no count of calls or nodes sees."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable

import pytest
import torch
from oracle import (
    assert_fresh_norms_exact_or_refused,
    assert_rel_close,
    reference_norms,
)
from project import cli_norms
from torch import Tensor, nn

from gradscope.engine import Engine, total
from gradscope.engine.record import Findings
from gradscope.engine.state import State
from gradscope.errors import ModelError
from gradscope.losses import resolve_loss

D, CLASSES, BATCH = 6, 3, 5


class Rolled(nn.Module):
    """Each example's hidden units moved to the example ``offset`` (a buffer, or a tensor in a
    list the module keeps: ``listed``) places on: its own where 0, another's (the examples
    mixed) elsewhere, by the same ops either way."""

    def __init__(self, listed: bool = False):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D, D), nn.Linear(D, CLASSES)
        self.register_buffer("offset", torch.tensor(0))
        self.kept = [self.offset.clone()] if listed else []

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.fc1(x))
        offset = self.kept[0] if self.kept else self.offset
        rows = (torch.arange(h.shape[0]) + offset) % h.shape[0]
        return self.fc2(h[rows])

    @property
    def shift(self) -> Tensor:
        """The tensor the forward takes its offset from."""
        return self.kept[0] if self.kept else self.offset


class Over(enum.Enum):
    FEATURES = 1
    BATCH = 0


def _over_features(h: Tensor) -> Tensor:
    return h - h.mean(1, keepdim=True)


def _over_batch(h: Tensor) -> Tensor:
    return h - h.mean(0, keepdim=True)


class Config:
    """An object of settings a module holds and its forward reads, as a model's config, with
    one of its own, as a vision-language model's text config."""

    def __init__(self, over: int, sub: Config | None = None):
        self.over, self.sub = over, sub


@dataclasses.dataclass(slots=True)
class Slotted:
    """Settings in slots, not a ``__dict__``."""

    over: int


class Centred(nn.Module):
    """Hidden units centred over the dimension its state names, by an attribute of the kind
    ``state`` says: the features (each example on its own) or the batch (the examples mixed), by
    the same ops either way."""

    def __init__(self, state: str):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D, D), nn.Linear(D, CLASSES)
        self.state, self.over, self.mode = state, 1, Over.FEATURES
        self.dims, self.listed = (1,), [1]
        self.config = Config(1, Config(1, Config(1, Config(1))))  # four levels down
        self.slotted, self.configs = Slotted(1), {"text": Config(1)}
        self.centre = _over_features

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.fc1(x))
        if self.state == "rows":  # examples kept apart either way, by ops of other values
            return self.fc2(h.flip(1) if self.over else h.roll(1, 1))
        if self.state == "function":
            return self.fc2(self.centre(h))
        over = {
            "int": self.over,
            "enum": self.mode.value,
            "tuple": self.dims,
            "list": self.listed,
            "held": self.config.over,
            "nested": self.config.sub.over,
            "deep": self.config.sub.sub.sub.over,
            "slotted": self.slotted.over,
            "in a dict": self.configs["text"].over,
        }[self.state]
        return self.fc2(h - h.mean(over, keepdim=True))

    def set(self, k: int) -> None:
        """Its state on batch k: over the features on even batches, else over the batch."""
        over = k % 2 ^ 1
        if self.state == "enum":
            self.mode = (Over.FEATURES, Over.BATCH)[k % 2]
        elif self.state == "tuple":
            self.dims = (over,)
        elif self.state == "list":
            self.listed[0] = over  # written in place
        elif self.state == "held":
            self.config.over = over
        elif self.state == "nested":
            self.config.sub.over = over
        elif self.state == "deep":
            self.config.sub.sub.sub.over = over
        elif self.state == "slotted":
            self.slotted.over = over
        elif self.state == "in a dict":
            self.configs["text"].over = over
        elif self.state == "function":
            self.centre = (_over_batch, _over_features)[over]
        else:
            self.over = over


def _batch(k: int) -> tuple[tuple[Tensor], Tensor]:
    g = torch.Generator().manual_seed(k)
    x = torch.randn(BATCH, D, generator=g, dtype=torch.float64)
    return (x,), torch.randint(0, CLASSES, (BATCH,), generator=g)


def _refused_on_odd_batches(model: nn.Module, state: Callable[[int], object]) -> Findings:
    """Four batches through one Engine, ``state(k)`` set before batch k: the odd ones, whose
    state mixes the examples, refused; the even ones exact against the float64 loop."""
    engine = Engine(model, resolve_loss("cross_entropy"))
    with engine:
        for k in range(4):
            state(k)
            inputs, targets = _batch(k)
            if k % 2:
                with pytest.raises(ModelError, match="mixes the examples of a batch"):
                    engine.norms(inputs, targets)
                continue
            norms = total(engine.norms(inputs, targets).norm_sq).sqrt()
            expected = reference_norms(model, inputs, targets, "cross_entropy")[1]
            assert_rel_close(norms, expected, 1e-9)
    return engine.record.at(*_batch(0))


WATCHED = {
    "int": "over",
    "enum": "mode",
    "tuple": "dims",
    "list": "listed",
    "held": "config.over",
    "nested": "config.sub.over",
    "deep": "config.sub.sub.sub.over",
    "slotted": "slotted.over",
    "in a dict": "configs.text.over",
    "function": "centre",
}


@pytest.mark.parametrize("state", list(WATCHED))
def test_a_state_that_mixes_the_examples_is_refused_on_every_batch_of_it(state: str):
    """Batches 0 and 2 centre over the features (exact, the second replayed), 1 and 3 over
    the batch: refused each time, never replayed by the features' program, whether the
    dimension is an attribute's value, a tuple's, a list's written in place, a held object's,
    one of its own objects' or the function's an attribute holds."""
    torch.manual_seed(0)
    model = Centred(state).double()
    findings = _refused_on_odd_batches(model, model.set)
    assert findings.replays == 1
    assert (
        f"the model's state differs from the analysed batch's (Centred.{WATCHED[state]})"
        in findings.why
    )


@pytest.mark.parametrize("listed", [False, True], ids=["buffer", "in a list"])
def test_a_tensor_written_between_batches_sends_the_batch_to_the_analysis(listed: bool):
    """The offset written in place (its version counts the write) on batches 1 and 3: those
    refused, as the examples mix there; batch 2, written back to 0, analysed again and exact;
    whether the offset is a buffer or a tensor in a list the module keeps."""
    torch.manual_seed(0)
    model = Rolled(listed).double()
    findings = _refused_on_odd_batches(model, lambda k: model.shift.fill_(k % 2))
    where = "kept.0" if listed else "offset"
    assert findings.replays == 0 and f"(Rolled.{where})" in findings.why


@pytest.mark.parametrize(
    "model", ["int", "enum", "list", "held", "nested", "deep", "slotted", "in a dict", "rolled"]
)
def test_fresh_api_calls_at_each_state_are_exact_or_refused(model: str):
    """``per_example_norms`` called afresh on each batch, the state set between them (the
    model's record, and its programs, kept between the calls): the batches whose state mixes
    the examples refused, the others exact; the model left as it was either way."""
    torch.manual_seed(0)
    built = Rolled().double() if model == "rolled" else Centred(model).double()
    for k in range(4):
        if model == "rolled":
            built.offset.fill_(k % 2)
        else:
            built.set(k)
        assert_fresh_norms_exact_or_refused(built, *_batch(k), refused=bool(k % 2))


class Counting(Centred):
    """Centred over the features, counting its forwards in a plain attribute: its state
    differs at every batch."""

    def __init__(self):
        super().__init__("int")
        self.calls = 0

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        return super().forward(x)


def test_a_cli_run_over_a_model_whose_forward_changes_its_state_is_exact(tmp_path):
    """Each batch of one CLI run begins at another state (a count of forwards): each is
    analysed, none replayed by another's program, and every one exact."""
    torch.manual_seed(0)
    model, batches = Counting().double(), [_batch(k) for k in range(3)]
    scores = cli_norms(tmp_path, model, "test_state:Counting", batches)
    for got, (inputs, targets) in zip(scores, batches, strict=True):
        expected = reference_norms(model, inputs, targets, "cross_entropy")[1]
        assert_rel_close(got, expected, 1e-9)


def test_each_state_replays_its_own_program():
    """Two states whose ops keep the examples apart, in turn: each analysed once, then replayed
    by its own program; every batch exact."""
    torch.manual_seed(0)
    model = Centred("rows").double()
    engine = Engine(model, resolve_loss("cross_entropy"))
    with engine:
        for k in range(6):
            model.set(k)
            inputs, targets = _batch(k)
            norms = total(engine.norms(inputs, targets).norm_sq).sqrt()
            expected = reference_norms(model, inputs, targets, "cross_entropy")[1]
            assert_rel_close(norms, expected, 1e-9)
    findings = engine.record.at(*_batch(0))
    assert (findings.analyses, findings.replays) == (2, 4)


def test_a_state_tells_the_first_attribute_that_differs():
    model = Centred("int")
    state = State(tuple(model.modules()))
    assert state.differs() is None
    model.fc2.train(False)
    assert state.differs() == "Linear.training"
    model.fc2.train(True)
    model.extra = 1.5  # an attribute the state had not
    assert state.differs() == "Centred.extra"
    del model.extra
    model.over = "batch"  # another type
    assert state.differs() == "Centred.over"
    model.over = 1
    model.kept = torch.ones(2)  # a tensor the module keeps, new: a plain attribute count's
    assert state.differs() == "Centred.kept"
    del model.kept
    model.listed.append(0)  # a list written in place
    assert state.differs() == "Centred.listed"
    model.listed.pop()
    model.config.scale = 2.0  # an attribute of an object it holds, new
    assert state.differs() == "Centred.config.scale"
    del model.config.scale
    model.hook = object()  # an attribute of no plain value, new
    assert state.differs() == "Centred.hook"
    del model.hook
    model.centre = _over_batch  # another function
    assert state.differs() == "Centred.centre"
    model.centre = _over_features
    model.slotted.over = 0  # a slot
    assert state.differs() == "Centred.slotted.over"
    model.slotted.over = 1
    model.configs["vision"] = Config(1)  # an entry of a dict of objects, new
    assert state.differs() == "Centred.configs.vision"
    del model.configs["vision"]
    assert state.differs() is None
    rolled = Rolled()
    state = State(tuple(rolled.modules()))
    rolled.offset.add_(0)  # written in place, whatever the value
    assert state.differs() == "Rolled.offset"
    rolled.offset = torch.tensor(0)  # another tensor
    assert state.differs() == "Rolled.offset"
    listed = Rolled(listed=True)
    state = State(tuple(listed.modules()))
    listed.kept[0] = torch.tensor(0)  # another tensor in the list
    assert state.differs() == "Rolled.kept.0"
