"""The children of a traced region (``engine/analysis/children.py``): the module calls inside a
region analysed on every batch that replay with module hooks alone, the region's trace taking
their outputs as owned as they were. Every batch exact against the float64 loop; a child that
differs from the analysed one sends its batch to the analysis; one that fails leaves the model
as it was."""

from __future__ import annotations

import pytest
import torch
from oracle import (
    assert_influence_through_one_engine,
    assert_rel_close,
    model_state,
    reference_norms,
)
from project import run_cli
from switches import Switched
from torch import Tensor, nn

import gradscope
from gradscope.engine import Engine, total
from gradscope.errors import ModelError
from gradscope.losses import resolve_loss

D, CLASSES, BATCH, T, EOS = 6, 3, 4, 5, 10


class Layer(Switched):
    """A residual block: a child wherever it runs inside a traced region. ``extra`` adds an
    op; ``fail`` raises half way."""

    switches = ("extra", "fail")

    def __init__(self):
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(D), nn.Linear(D, D)
        self.extra = self.fail = False

    def forward(self, h: Tensor) -> Tensor:
        h = h + torch.tanh(self.fc(self.norm(h)))
        if self.fail:
            raise RuntimeError("a layer failed")
        return h * 2 if self.extra else h


class Scaled(Switched):
    """A residual block scaled by a parameter of its own read outside any hooked call (a
    LayerScale's): a light child, its read served by recipe. ``twice`` reads it again."""

    switches = ("twice",)

    def __init__(self):
        super().__init__()
        self.fc, self.gamma = nn.Linear(D, D), nn.Parameter(torch.randn(D))
        self.twice = False

    def forward(self, h: Tensor) -> Tensor:
        h = h + torch.tanh(self.fc(h)) * self.gamma
        return h * self.gamma if self.twice else h


class Marked(nn.Module):
    """Layers over the tokens, then each example's last marked token, as BART's and T5's
    sequence classifiers pick it: which rows it reads the ids say, and it reads their counts
    on the host. ``before``: a layer also called before the region's own work begins."""

    def __init__(self, second: type[nn.Module] = Layer):
        super().__init__()
        self.emb = nn.Embedding(11, D)
        self.layers = nn.ModuleList([Layer(), second()])
        self.head = nn.Linear(D, CLASSES)

    def forward(self, ids: Tensor, h: Tensor | None = None) -> Tensor:
        h = self.emb(ids) if h is None else h
        for layer in self.layers:
            h = layer(h)
        marked = ids.eq(EOS)
        if len(torch.unique_consecutive(marked.sum(1))) > 1:
            raise ValueError("every example needs as many marks")
        picked = h[marked, :].view(h.size(0), -1, h.size(-1))[:, -1, :]
        return self.head(picked)


class Wrapped(nn.Module):
    """``Marked`` inside a model: the region is its call."""

    def __init__(self, second: type[nn.Module] = Layer):
        super().__init__()
        self.inner = Marked(second)

    def forward(self, ids: Tensor) -> Tensor:
        return self.inner(ids)


class Outside(Wrapped):
    """``Wrapped`` calling its first layer at its own level too, on a row no example owns."""

    def forward(self, ids: Tensor) -> Tensor:
        shared = self.inner.layers[0](torch.ones(1, D, dtype=torch.float64))
        return self.inner(ids) + self.inner.head(shared)


class Leaky(nn.Module):
    """A layer whose result reaches its caller another way than by its output: kept on itself
    (``"kept"``), or written into a tensor its caller passed (``"wrote"``)."""

    def __init__(self, how: str):
        super().__init__()
        self.how, self.fc = how, nn.Linear(D, D)

    def forward(self, h: Tensor, out: Tensor) -> Tensor:
        h = torch.tanh(self.fc(h))
        if self.how == "kept":
            self.kept = h * 2
        else:
            out.copy_(h * 2)
        return h


class Leaking(Marked):
    """``Marked`` whose first rows reach the head by another way than a layer's output."""

    def __init__(self, how: str):
        super().__init__()
        self.leaky = Leaky(how)

    def forward(self, ids: Tensor) -> Tensor:
        h = self.emb(ids)
        out = torch.zeros_like(h)
        h = self.leaky(h, out)
        other = self.leaky.__dict__.pop("kept") if self.leaky.how == "kept" else out
        return super().forward(ids, h) + self.head(other[:, 0])


def _batches(n: int = 3, marks: tuple[int, ...] = (1, 1, 1)) -> list[tuple[Tensor, Tensor]]:
    """Tokens with ``marks[k]`` marks in each example of batch k, at places the seed picks."""
    out = []
    for k in range(n):
        g = torch.Generator().manual_seed(k)
        ids = torch.randint(0, EOS, (BATCH, T), generator=g)
        for i in range(BATCH):
            at = torch.randperm(T, generator=g)[: marks[k]]
            ids[i, at] = EOS
        out.append((ids, torch.randint(0, CLASSES, (BATCH,), generator=g)))
    return out


def _model(cls: type[Wrapped] = Wrapped, *args) -> Wrapped:
    torch.manual_seed(0)
    return cls(*args).double()


def _scored(model: nn.Module, batches, each=lambda k: None) -> Engine:
    """Every batch scored through one Engine, each exact against the loop."""
    engine = Engine(model, resolve_loss("cross_entropy"))
    with engine:
        for k, (ids, y) in enumerate(batches):
            each(k)
            norms = total(engine.norms((ids,), y).norm_sq).sqrt()
            assert_rel_close(norms, reference_norms(model, (ids,), y, "cross_entropy")[1], 1e-9)
    return engine


@pytest.mark.parametrize("marks", [(1, 1, 1), (1, 2, 3)])
def test_a_traced_region_replays_its_children(marks):
    """The region (the classifier's call) is traced on every batch, its layers replayed: every
    batch exact, the later two replayed, whatever number of rows each batch's marks pick."""
    model = _model()
    batches = _batches(marks=marks)
    findings = _scored(model, batches).record.at((batches[0][0],), batches[0][1])
    assert (findings.replays, findings.analyses) == (2, 1)
    (program,) = findings.programs
    assert program.regions == {id(model.inner)}
    assert program.children == {id(layer) for layer in model.inner.layers}
    children = [s for s in program.steps if type(s).__name__ == "ChildCall"]
    assert len(children) == 2 and len(program.steps) == 1 + 2 + 2 * 2  # region, layers, calls


def test_a_child_reading_a_parameter_by_recipe_replays_light():
    """A layer reading its scale outside any hooked call is a light child: its read by recipe,
    its Linear a step. Reading it twice on batch 2 fails the light witness there (analysed in
    full); batch 3 replays. Every batch exact."""
    model = _model(Wrapped, Scaled)
    scaled = model.inner.layers[1]

    def each(k: int) -> None:
        scaled.twice = k == 1

    batches = _batches()
    findings = _scored(model, batches, each).record.at((batches[0][0],), batches[0][1])
    assert (findings.replays, findings.analyses) == (1, 2)
    assert "read" in findings.why and "Scaled" in findings.why
    # each way's program: its scale read once, or twice
    lights = [s.light for p in findings.programs for s in p.steps if getattr(s, "light", None)]
    assert {c.module for c in lights} == {id(scaled)}
    assert sorted(len(c.light) for c in lights) == [1, 2]
    assert all(p.children == {id(m) for m in model.inner.layers} for p in findings.programs)


def test_the_models_own_call_is_a_region_where_it_has_children():
    """The classifier at the top, as a run loads it: its own call is the region (it had no
    program before: every batch analysed in full), its layers replayed."""
    model = _model().inner
    batches = _batches(marks=(1, 2, 1))
    findings = _scored(model, batches).record.at((batches[0][0],), batches[0][1])
    assert findings.replays == 2
    assert findings.programs[0].regions == {id(model)}


@pytest.mark.parametrize("how", ["extra", "fail"])
def test_a_child_that_differs_is_analysed_and_one_that_fails_leaves_the_model(how):
    """A layer with another op on batch 2 fails the witness at its end (the batch analysed in
    full, exact); one that raises on batch 2 raises to the caller, the trace's modes and every
    hook gone, and batch 3 replays."""
    model = _model()
    layer = model.inner.layers[1]
    batches = _batches()
    if how == "extra":

        def each(k: int) -> None:
            layer.extra = k == 1

        engine = _scored(model, batches, each)
        findings = engine.record.at((batches[0][0],), batches[0][1])
        assert (findings.replays, findings.analyses) == (1, 2)
        assert "operations" in findings.why and "Layer" in findings.why
        return
    engine = Engine(model, resolve_loss("cross_entropy"))
    before = model_state(model)
    with engine:
        engine.norms((batches[0][0],), batches[0][1])
        layer.fail = True
        with pytest.raises(ModelError, match="a layer failed"):
            engine.norms((batches[1][0],), batches[1][1])
        assert torch._C._len_torch_function_stack() == 0
        layer.fail = False
        ids, y = batches[2]
        norms = total(engine.norms((ids,), y).norm_sq).sqrt()
        assert_rel_close(norms, reference_norms(model, (ids,), y, "cross_entropy")[1], 1e-9)
    before.assert_kept(model)
    assert engine.record.at((ids,), y).replays == 1


def test_a_module_called_outside_a_region_too_is_no_child():
    """A layer also called at the model's level, outside the region: its calls there are steps,
    so none of its calls is a child; the other layer's are."""
    model = _model(Outside)
    batches = _batches()
    findings = _scored(model, batches).record.at((batches[0][0],), batches[0][1])
    assert findings.replays == 2
    assert findings.programs[0].children == {id(model.inner.layers[1])}


@pytest.mark.parametrize("how", ["kept", "wrote"])
def test_a_call_whose_rows_leave_it_another_way_is_no_child(how):
    """A layer whose rows reach the head by an attribute or a tensor it wrote in place: the
    region's trace must see them made, so it is no child (taken for one, the rows would be no
    example's, the head's read as shared by the batch); the plain layers are."""
    torch.manual_seed(0)
    model = Leaking(how).double()
    batches = _batches()
    findings = _scored(model, batches).record.at((batches[0][0],), batches[0][1])
    assert findings.replays == 2
    assert findings.programs[0].children == {id(layer) for layer in model.layers}


def test_replayed_influence_through_children_is_exact():
    """Inner products with a reference gradient, the later batches' layers replayed."""
    batches = [((ids,), y) for ids, y in _batches()]
    engine = assert_influence_through_one_engine(_model(), batches, "cross_entropy")
    assert engine.record.at(*batches[0]).replays == 2


# each kind of child: plain layers, a light one, and the model's own call as the region
BUILT = {
    "plain": lambda: _model(),
    "light": lambda: _model(Wrapped, Scaled),
    "top": lambda: _model().inner,
}


@pytest.mark.parametrize("case", BUILT)
def test_every_batch_is_exact_through_fresh_api_calls(case: str):
    """Batches of one shape, other values and other counts of marks, each scored by a fresh
    call (the later two replayed by the record the model keeps): each the loop's, the model
    left as it was."""
    model = BUILT[case]()
    for ids, y in _batches(marks=(1, 2, 1)):
        before = model_state(model)
        norms = gradscope.per_example_norms(model, (ids,), y, loss="cross_entropy")
        before.assert_kept(model)
        assert_rel_close(norms, reference_norms(model, (ids,), y, "cross_entropy")[1], 1e-9)
    findings = Engine(model, resolve_loss("cross_entropy")).record.at((ids,), y)
    assert (findings.replays, findings.analyses) == (2, 1)


@pytest.mark.parametrize("case", BUILT)
def test_every_batch_of_one_cli_run_is_exact(tmp_path, case: str):
    """The same batches in one CLI run: every example's norm the loop's."""
    model = BUILT[case]()
    batches = _batches(marks=(1, 2, 1))
    torch.save(
        {"ids": torch.cat([b[0] for b in batches]), "y": torch.cat([b[1] for b in batches])},
        tmp_path / "data.pt",
    )
    torch.save(model.state_dict(), tmp_path / "model.pt")
    (tmp_path / "models.py").write_text(
        f"from test_children import BUILT\n\ndef make():\n    return BUILT[{case!r}]()\n"
    )
    model_section = {"factory": "models.py:make", "checkpoint": "model.pt"}
    data = {"path": "data.pt", "inputs": ["ids"], "targets": "y", "batch_size": BATCH}
    scores = run_cli(tmp_path, model_section, data, "cross_entropy")
    for k, (ids, y) in enumerate(batches):
        _, expected = reference_norms(model, (ids,), y, "cross_entropy")
        got = torch.tensor(scores["grad_norm"].to_numpy()[k * BATCH : (k + 1) * BATCH])
        assert_rel_close(got, expected, 1e-9)
