"""The reference every engine number is tested against: a float64 per-example backward loop."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch
from project import run_cli
from torch import Tensor, nn

import gradscope
from gradscope.engine import Engine, Forward, Plan, Want, naive_grads, select_output, total
from gradscope.errors import ModelError
from gradscope.losses import resolve_loss
from gradscope.rules.projection import Projection


@dataclass
class Case:
    """A test problem as data: a module, inputs and targets for a batch, and a loss."""

    id: str
    module: Callable[[], nn.Module]
    inputs: Callable[[int], tuple[Tensor, ...]]  # batch size -> model inputs
    targets: Callable[[Tensor], Tensor]  # model output -> targets of the right shape
    loss: str = "mse"
    loss_kwargs: dict = field(default_factory=dict)
    batch: int = 5
    output: str | int | None = None
    # the parameters the passes send to the fallback, by design (none where the rules serve all)
    fallback: tuple[str, ...] = ()

    def build(self, dtype: torch.dtype = torch.float64, batch: int | None = None, seed: int = 0):
        torch.manual_seed(seed)
        model = self.module().to(dtype)
        inputs = tuple(
            t.to(dtype) if t.is_floating_point() else t for t in self.inputs(batch or self.batch)
        )
        with torch.no_grad():
            model.eval()
            targets = self.targets(select_output(model(*inputs), self.output))
        return model, inputs, targets

    def __repr__(self) -> str:
        return self.id


def reference_norms(
    model: nn.Module,
    inputs: tuple[Tensor, ...],
    targets: Tensor,
    loss: str = "mse",
    include: Sequence[str] | None = None,
    exclude: Sequence[str] = (),
    output: str | int | None = None,
    loss_kwargs: dict | None = None,
) -> tuple[Tensor, Tensor]:
    """Per-example (loss, grad norm) from the loop, on a float64 copy of the model."""
    model = copy.deepcopy(model).double()
    inputs = tuple(t.double() if t.is_floating_point() else t for t in inputs)
    targets = targets.double() if targets.is_floating_point() else targets
    fn = resolve_loss(loss, loss_kwargs)
    with Engine(model, fn, include, exclude) as engine:
        losses, grads = naive_grads(
            model,
            inputs,
            targets,
            fn,
            [p.name for p in engine.plan.included],
            Forward(output=output),
        )
    norm = torch.stack([g.reshape(len(g), -1).pow(2).sum(1) for g in grads.values()]).sum(0).sqrt()
    return losses, norm


def alone(module: nn.Module, x: Tensor, g: Tensor) -> dict[str, Tensor]:
    """{name: (B, *shape)} each example's gradient of ``sum(module(x_i) * g_i)``, the example
    run alone, in float64: the loop a rule called directly is compared with."""
    m = copy.deepcopy(module).double()
    names = [n for n, _ in m.named_parameters()]
    params = [p for _, p in m.named_parameters()]
    x = x.double() if x.is_floating_point() else x
    per = [
        torch.autograd.grad((m(x[i : i + 1]) * g[i : i + 1].double()).sum(), params)
        for i in range(x.shape[0])
    ]
    return {n: torch.stack([grads[k] for grads in per]) for k, n in enumerate(names)}


def on_the_fallback(
    of: nn.Module | Engine | Plan, include: Sequence[str] | None = None, exclude: Sequence[str] = ()
) -> dict[str, str]:
    """{name: why} of the parameters the passes moved to the fallback: in a plan, an Engine's,
    or for a model what a fresh Engine of the selection adopts from the model's record."""
    if isinstance(of, nn.Module):
        of = Engine(of, resolve_loss("mse"), include, exclude)
    plan = of.plan if isinstance(of, Engine) else of
    return {p.name: p.note for p in plan.fallback}


def assert_fallback(
    of: nn.Module | Engine | Plan,
    expected: Sequence[str] = (),
    include: Sequence[str] | None = None,
    exclude: Sequence[str] = (),
) -> None:
    """The parameters on the fallback are ``expected``, none by default. A rule's test must ask
    this: the self-check moves a wrong rule's parameters to the fallback, whose numbers still
    match the loop, so norms alone cannot fail on a wrong rule."""
    fell = on_the_fallback(of, include, exclude)
    assert set(fell) == set(expected), f"on the fallback: {fell}, expected {sorted(expected)}"


def assert_rel_close(actual: Tensor, expected: Tensor, rtol: float) -> None:
    """max |a - e| / max(|e|) below rtol: relative to the scale of the answer, as check reports it."""
    actual, expected = actual.double(), expected.double()
    scale = expected.abs().max().clamp_min(1e-30)
    err = ((actual - expected).abs().max() / scale).item()
    assert err < rtol, (
        f"relative error {err:.3g} >= {rtol:g}\nactual   {actual}\nexpected {expected}"
    )


def reference_influence(
    model: nn.Module,
    inputs: tuple[Tensor, ...],
    targets: Tensor,
    refs: tuple[tuple[Tensor, ...], Tensor],
    loss: str,
    per_ref: bool = False,
    exclude: tuple[str, ...] = (),
    denominators: dict[str, Tensor] | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(B, K) influence, (B,) ||g_i||, (K,) ||r_k|| on a float64 copy of the model: every
    gradient formed, one example at a time; the reference is the mean of the reference examples'
    gradients (or each of them with ``per_ref``), divided by ``denominators`` per parameter."""
    model = copy.deepcopy(model).double()

    def f64(ts: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        return tuple(t.double() if t.is_floating_point() else t for t in ts)

    inputs, targets = f64(inputs), f64((targets,))[0]
    refs = (f64(refs[0]), f64((refs[1],))[0])
    fn = resolve_loss(loss)
    with Engine(model, fn, exclude=exclude) as engine:
        names = [p.name for p in engine.plan.included]
        _, grads = naive_grads(model, inputs, targets, fn, names)
        _, ref_grads = naive_grads(model, *refs, fn, names)
    flat = torch.cat([grads[n].reshape(len(grads[n]), -1) for n in names], 1)  # (B, P)
    ref = torch.cat(
        [
            (ref_grads[n] / (denominators or {}).get(n, 1)).reshape(len(ref_grads[n]), -1)
            for n in names
        ],
        1,
    )  # (N, P)
    ref = ref if per_ref else ref.mean(0, keepdim=True)  # (K, P)
    return flat @ ref.T, flat.norm(dim=1), ref.norm(dim=1)


def assert_norms_through_one_engine(
    model: nn.Module, batches: Sequence[tuple[tuple[Tensor, ...], Tensor]], loss: str
) -> Engine:
    """Each batch's norms through one Engine (the later ones replayed where they may) against
    the float64 loop, and no parameter on the fallback; the Engine, for its record."""
    with Engine(model, resolve_loss(loss)) as engine:
        for inputs, targets in batches:
            expected = reference_norms(model, inputs, targets, loss)[1].square()
            assert_rel_close(total(engine.norms(inputs, targets).norm_sq), expected, 1e-9)
    assert_fallback(engine)
    return engine


def findings_by_shape(
    engine: Engine,
    batch: Callable[..., tuple[tuple[Tensor, ...], Tensor]],
    shapes: Sequence[tuple],
    replayed: bool = True,
) -> dict[tuple, object]:
    """What ``engine``'s record holds of each shape in ``shapes`` (a shape's batch made by
    ``batch(seed, *shape)``); with ``replayed``, each asserted analysed once and replayed on
    every later batch of its shape."""
    found = {shape: engine.record.at(*batch(0, *shape)) for shape in set(shapes)}
    for shape, findings in found.items() if replayed else ():
        assert findings.analyses == 1 and findings.replays == shapes.count(shape) - 1, shape
    return found


def assert_influence_through_one_engine(
    model: nn.Module, batches: Sequence[tuple[tuple[Tensor, ...], Tensor]], loss: str
) -> Engine:
    """Inner products with the mean gradient of the first batch, every batch through one
    Engine (the later ones replayed where they may), each against the float64 loop; the Engine,
    for its record."""
    fn = resolve_loss(loss)
    ref = batches[0]
    engine = Engine(model, fn)
    with engine:
        names = [p.name for p in engine.plan.included]
        _, ref_grads = naive_grads(model, *ref, fn, names)
        refs = {n: g.mean(0, keepdim=True) for n, g in ref_grads.items()}
        for inputs, targets in batches:
            got = total(engine.norms(inputs, targets, refs=refs).inner)[:, 0]
            expected, _, _ = reference_influence(model, inputs, targets, ref, loss)
            assert_rel_close(got, expected[:, 0], 1e-9)
    return engine


@dataclass
class ModelState:
    """What every engine path must leave of a model as it found it."""

    params: list[tuple[str, nn.Parameter, bool, Tensor]]  # name, object, requires_grad, value
    buffers: dict[str, Tensor]
    modes: list[bool]
    hooks: list[int]  # each module's forward hooks and pre-hooks

    def assert_kept(self, model: nn.Module) -> None:
        """The same Parameter objects under every name (each path of a module registered at
        two), the same ``requires_grad``, values, buffers, modes and module hooks, and no
        ``.grad``."""
        now = model_state(model)
        assert now.hooks == self.hooks, "a module hook was left on the model"
        assert [(n, id(p), r) for n, p, r, _ in now.params] == [
            (n, id(p), r) for n, p, r, _ in self.params
        ], "a parameter was replaced, or its requires_grad changed"
        assert all(isinstance(p, nn.Parameter) for _, p, _, _ in now.params)
        assert all(torch.equal(a[3], b[3]) for a, b in zip(self.params, now.params, strict=True))
        assert now.buffers.keys() == self.buffers.keys()
        assert all(torch.equal(now.buffers[k], b) for k, b in self.buffers.items())
        assert now.modes == self.modes
        assert all(p.grad is None for _, p, _, _ in now.params)


def model_state(model: nn.Module) -> ModelState:
    named = model.named_parameters(remove_duplicate=False)
    return ModelState(
        [(name, p, p.requires_grad, p.detach().clone()) for name, p in named],
        {name: b.clone() for name, b in model.named_buffers()},
        [m.training for m in model.modules()],
        [len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()],
    )


def assert_fresh_norms_exact_or_refused(
    model: nn.Module, inputs: tuple[Tensor, ...], targets: Tensor, refused: bool
) -> None:
    """One fresh ``per_example_norms`` call (the model's record, and its programs, kept from the
    calls before): refused as mixing the examples where ``refused``, else exact against the
    float64 loop; the model left as it was either way."""
    before = model_state(model)
    if refused:
        with pytest.raises(ModelError, match="mixes the examples of a batch"):
            gradscope.per_example_norms(model, inputs, targets, loss="cross_entropy")
    else:
        norms = gradscope.per_example_norms(model, inputs, targets, loss="cross_entropy")
        expected = reference_norms(model, inputs, targets, "cross_entropy")[1]
        assert_rel_close(norms, expected, 1e-9)
    before.assert_kept(model)


def assert_case_matches_loop(
    case: Case, dtype: torch.dtype = torch.float64, rtol: float = 1e-5, cli: Path | None = None
) -> None:
    """A case as the test strategy asks (docs/development/testing.md): its model built in
    ``dtype``; two batches of one shape with different values, each through a fresh
    ``per_example_norms`` call against the float64 loop, the model left as its own forward
    leaves it after each, and on the fallback only ``case.fallback``; with ``cli`` (an empty folder), both batches again through
    ``gradscope norms``, the model from a file and each batch one batch of the run, its losses
    against the loop's too."""
    model, *first = case.build(dtype)
    _, *second = case.build(dtype, seed=1)  # another batch of the same shape
    loss = resolve_loss(case.loss, case.loss_kwargs)
    expected = []
    for inputs, targets in (first, second):
        with torch.no_grad():
            model(*inputs)  # what a forward itself changes (Embedding's max_norm renorms rows)
        kept = model_state(model)
        got = gradscope.per_example_norms(model, inputs, targets, loss, output=case.output)
        kept.assert_kept(model)
        expected.append(
            reference_norms(
                model, inputs, targets, case.loss, output=case.output, loss_kwargs=case.loss_kwargs
            )
        )
        assert got.shape == (targets.shape[0],)
        assert_rel_close(got, expected[-1][1], rtol)
    assert_fallback(model, case.fallback)
    if cli is None:
        return
    torch.save(model, cli / "model.pt")
    (cli / "model.py").write_text(
        f"import torch\n\n\ndef saved():\n"
        f"    return torch.load({str(cli / 'model.pt')!r}, weights_only=False)\n"
    )
    names = [f"x{i}" for i in range(len(first[0]))]
    columns = zip(first[0], second[0], strict=True)
    data = {name: torch.cat(pair) for name, pair in zip(names, columns, strict=True)}
    torch.save(data | {"y": torch.cat([first[1], second[1]])}, cli / "data.pt")
    frame = run_cli(
        cli,
        {"factory": "model.py:saved", "output": case.output},
        {"path": "data.pt", "inputs": names, "targets": "y", "batch_size": case.batch},
        {"name": case.loss, "kwargs": case.loss_kwargs},
        dtype=str(dtype).removeprefix("torch."),
    )
    for column, k in (("loss", 0), ("grad_norm", 1)):
        want = torch.cat([e[k] for e in expected])
        assert_rel_close(torch.tensor(frame[column].to_numpy()), want, rtol)


def projected(grads: Tensor, split: int, out: Tensor | None, inn: Tensor | None) -> Tensor:
    """(B, *shape) formed gradients -> (B, k_out * k_in): ``P_out^T G_i P_in`` as written, the
    gradient read as (rows = the first ``split`` dimensions, cols = the rest), None = identity."""
    g = grads.reshape(grads.shape[0], math.prod(grads.shape[1 : split + 1]), -1)  # (B, R, C)
    p = torch.eye(g.shape[1], dtype=g.dtype) if out is None else out
    q = torch.eye(g.shape[2], dtype=g.dtype) if inn is None else inn
    return torch.einsum("rk,brc,cl->bkl", p, g, q).flatten(1)


# how random projections keep each side: compress both, keep the rows whole, keep the cols whole
SIDES = ("both", "rows whole", "cols whole")


def random_projections(
    shapes: dict[str, torch.Size], sides: str, last_split: bool, seed: int = 0
) -> dict[str, Projection]:
    """A random float64 projection per parameter, about half of each compressed side's size;
    a parameter of 3+ dims read as (its first dim, the rest), or with ``last_split`` as (all but
    its last dim, the last): a fused expert weight's rows."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in shapes.items():
        split = 0 if len(shape) < 2 else (len(shape) - 1 if last_split else 1)
        rows, cols = math.prod(shape[:split]), math.prod(shape[split:])

        def factor(n: int, keep: bool) -> Tensor | None:
            if keep or n == 1:
                return None
            return torch.randn(n, max(1, n // 2), generator=g, dtype=torch.float64)

        p_out = factor(rows, sides == "rows whole")
        p_in = factor(cols, sides == "cols whole")
        out[name] = Projection(torch.Size(shape), split, p_out, p_in)
    return out


def assert_projections_match_loop(case: Case, rtol: float = 1e-9) -> None:
    """Each parameter's ``phi_i = P_out^T G_i P_in``, from the pass (``Want.project``: parts
    of several calls merged) and from each contribution's own ``project``, against the
    definition on the loop's formed gradients, for every way of keeping the sides and of
    reading a 3-D weight; within ``rtol`` of the largest entry."""
    model, inputs, targets = case.build()
    loss, forward = resolve_loss(case.loss, case.loss_kwargs), Forward(output=case.output)
    with Engine(model, loss, forward=forward) as engine:
        names = [p.name for p in engine.plan.included]
        _, grads = naive_grads(model, inputs, targets, loss, names, forward)
        shapes = {n: g.shape[1:] for n, g in grads.items()}
        splits = [False, True] if any(len(s) > 2 for s in shapes.values()) else [False]
        for sides in SIDES:
            for last_split in splits:
                projections = random_projections(shapes, sides, last_split)
                want = Want(norms=False, project=projections)
                got = engine.scores(inputs, targets, want).inner
                _, parts = engine.contributions(inputs, targets)
                for name, p in projections.items():
                    expected = projected(grads[name], p.split, p.out, p.inn)
                    where = f"{name} ({sides}, split {p.split})"
                    assert got[name].shape == expected.shape, where
                    assert_rel_close(got[name], expected, rtol)
                    if parts[name] is not None:
                        assert_rel_close(parts[name].project(p), expected, rtol)
    assert_fallback(engine, case.fallback)


Losses = tuple[Callable[[int], Tensor], Callable[[], Tensor]]  # a step's: row i's, the batch's


def redrawn_norms(
    model: nn.Module, rows: int, steps: Sequence[Losses], seed: int = 3
) -> list[float]:
    """Each row's gradient norm (over the parameters that require grad) over watched steps
    begun at ``seed``, a forward that draws (dropout) drawing each step's masks again from the
    state the step began in: each step's ``(row_loss, batch_loss)``, row ``i``'s loss
    ``row_loss(i)``, then ``batch_loss()`` backward into ``.grad``, which leaves the generator
    where one forward leaves it, as the watched step does."""
    torch.manual_seed(seed)
    params, norms = [p for p in model.parameters() if p.requires_grad], []
    for row_loss, batch_loss in steps:
        began = torch.get_rng_state()
        for i in range(rows):
            torch.set_rng_state(began)
            grads = torch.autograd.grad(row_loss(i), params, allow_unused=True)
            norms.append(sum(g.square().sum() for g in grads if g is not None).sqrt().item())
        torch.set_rng_state(began)
        batch_loss().backward()
    return norms


def trained_alike(tmp_path: Path, train: Callable[[list], nn.Module]) -> dict[str, list]:
    """The plain run, a watched ``Trainer``'s oracle: ``train(callbacks)`` trains a fresh model
    and returns it; with the watch's callback (writing ``w.parquet`` in ``tmp_path``) its
    weights and buffers must be those the run reaches without it (to 1e-5: Adam's first steps
    move a weight whose gradient is zero but for rounding by its sign). The watch file's
    columns."""
    import pyarrow.parquet as pq

    from gradscope.training.watch_hf import WatchCallback

    out = tmp_path / "w.parquet"
    plain, watched = (train(callbacks) for callbacks in ([], [WatchCallback(out)]))
    mine = watched.state_dict()
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(mine[name], value, rtol=1e-5, atol=1e-6, msg=name)
    return pq.read_table(out).to_pydict()


Batch = tuple[tuple[Tensor, ...], Tensor]  # inputs, targets


def watched_as_looped(
    model: nn.Module,
    plain: nn.Module,
    out: Path,
    batches: tuple[Batch, Batch],
    losses: Callable[[tuple[Tensor, ...], Tensor], Losses],
    rtol: float = 1e-8,
    **watch: object,
) -> dict[str, list]:
    """Two watched steps of ``model`` on ``batches`` of one shape and other values, an
    analysed and a replayed one, begun at seed 3: nothing on the fallback, each row's norm the
    loop's on ``plain`` (``redrawn_norms`` of each batch's ``losses(inputs, targets)``, its
    rows' and its own, under the batch's masks drawn again) to ``rtol``, ``.grad`` of what
    trains the plain steps'. ``watch``: ``Watch``'s arguments. The watch file's columns."""
    import pyarrow.parquet as pq

    from gradscope.training.watch import Watch

    rows = len(batches[0][1])
    assert all(len(targets) == rows for _, targets in batches)
    torch.manual_seed(3)
    with Watch(model, out, **watch) as watched:
        for inputs, targets in batches:
            watched.step(inputs, targets, torch.arange(rows)).backward()
        assert not watched.engine.plan.fallback
    norms = redrawn_norms(plain, rows, [losses(*batch) for batch in batches])
    for p, q in zip(model.parameters(), plain.parameters(), strict=True):
        if p.requires_grad:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12)
    table = pq.read_table(out).to_pydict()
    np.testing.assert_allclose(table["grad_norm"], norms, rtol=rtol, atol=1e-12)
    return table
