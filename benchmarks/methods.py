"""The methods bench.py times, each a setup (untimed) that returns the step that is timed.

Tasks: ``floor`` (one plain forward+backward of the summed loss; ``floor:linear hooks``, the
cheapest hooks a pass could add to it, for scale), ``norms`` (per-example gradient
norms), ``reference`` (the gradient of the mean loss over the 8-example reference batch),
``influence`` (each example's gradient against that reference gradient, which every influence
method computes once in its setup: its step is the scoring pass alone), ``per-ref`` (each
example's gradient against each reference example's own, ``influence --per-ref``: (B, 8), the
8 reference gradients computed in the setup) and ``index`` (each
example's projected gradient at ``gradscope index``'s default dimension, the projections drawn
in the setup). Every method of a task is checked against that task's ``loop``.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import layer_hooks
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from workloads import Problem

from gradscope.engine import Engine, Influence, Want, reference_gradients, total
from gradscope.index.projection import DEFAULT_DIM, Projector, blocks
from gradscope.index.scorer import reused
from gradscope.losses import resolve_loss

# An answer further than this from the loop's (max |a - e| / max |e|) is reported as wrong: in
# float32 and float64, and in half precision, where the loop's own gradients are rounded to it.
WRONG_REL_ERR = 1e-3
WRONG_REL_ERR_HALF = 5e-2


def wrong_rel_err(dtype: torch.dtype | None) -> float:
    """The relative error past which an answer in ``dtype`` (None: float32) is wrong."""
    return WRONG_REL_ERR_HALF if dtype in (torch.bfloat16, torch.float16) else WRONG_REL_ERR


class Skip(Exception):
    """A method that cannot be timed here: ``status`` (missing, wrong...), a ``note`` saying why,
    and ``why``, the few words of it a table cell shows."""

    def __init__(self, status: str, note: str = "", why: str = ""):
        super().__init__(status)
        self.status, self.note, self.why = status, note, why


# Peers' own failures on these workloads, each traced into the peer's code (some are in
# PEERS.md): (method name part, piece of the error message, the few words a table cell shows).
# Any other error is shown as it is.
KNOWN_FAILURES = [
    ("opacus", "do not support causal mask", "causal mask"),
    ("opacus ghost", "Parameter tying is not supported", "tied weights"),
    # its embedding norm .view()s the index tensor; HF's position ids are expanded, not copied
    ("opacus ghost", "view size is not compatible", "expanded position ids"),
    # the functorch fallback calls a module with its first input only; MoE experts take three
    ("opacus", "missing 2 required positional arguments", "experts' 3 inputs"),
    # the activation hook .detach()es every input; BART's positions module also takes an int
    ("opacus", "'int' object has no attribute 'detach'", "non-tensor input"),
    # BackPACK stores each module's output as module.output; BertLayer has a child of that name
    ("backpack", "as child module 'output'", "BERT's .output"),
    # transformers' mask code branches on padding_mask.all()
    ("torch.func", "vmap: It looks like", "vmap: mask code"),
]


def known_failure(method: str, note: str) -> str:
    """The few words for a peer's own known failure (``KNOWN_FAILURES``); "" for any other."""
    return next(
        (why for name, piece, why in KNOWN_FAILURES if name in method and piece in note), ""
    )


Step = Callable[[], Tensor | None]


@dataclass(frozen=True)
class Method:
    name: str
    task: str  # "floor", "norms", "reference", "influence", "per-ref" or "index"
    setup: Callable[[Problem], Step]  # done once, untimed; the step is what is timed

    @property
    def key(self) -> str:
        """ "floor", "floor:linear hooks", "norms:loop", "influence:gradscope hooks", ..."""
        return "floor" if self.name == "floor" else f"{self.task}:{self.name}"


def trainable(model: nn.Module) -> dict[str, nn.Parameter]:
    """The parameters that require grad, by name (a tied parameter once)."""
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def _plain_summed_loss(pb: Problem) -> Callable[[Tensor], Tensor]:
    """The summed loss as a training script computes it: the sum of the per-example losses.

    Token-level cross entropy runs on (B*T, C) logits, as language-model code does: the same
    number as the per-example mean over T summed over B, but about half the time on W4 of the
    (B, C, T) layout that per-example losses with ``class_dim`` use.
    """
    per_example = resolve_loss(pb.loss)

    def summed(out: Tensor) -> Tensor:
        if pb.loss == "cross_entropy" and out.dim() == 3:
            flat = F.cross_entropy(out.flatten(0, 1), pb.targets.flatten(), reduction="sum")
            return flat / pb.targets.shape[1]
        return per_example(out, pb.targets).sum()

    return summed


def clear_grads(params: Iterable[nn.Parameter]) -> None:
    for p in params:
        p.grad = None


def floor(pb: Problem) -> Step:
    loss, params = _plain_summed_loss(pb), list(trainable(pb.model).values())

    def step() -> None:
        clear_grads(params)  # so the floor's peak memory includes allocating the gradients
        loss(pb.model(*pb.inputs)).backward()

    return step


def linear_hooks(pb: Problem) -> Step:
    """For scale, not a method: the floor plus the cheapest hooks a pass needs, the ghost norms
    of the ``nn.Linear`` layers (and transformers' ``Conv1D``, GPT-2's) alone (a forward hook
    keeps each input, a hook on its output takes the output gradient; ||s||^2 ||a||^2 on one
    position, the Gram route on several), no other layer, no check. Its answer leaves every
    other parameter out (the result's note says how much), so it is not checked against the
    loop: a replayed gradscope pass near it costs little beyond its hooks."""
    loss, params = _plain_summed_loss(pb), list(trainable(pb.model).values())
    kinds: tuple[type, ...] = (nn.Linear,)
    with contextlib.suppress(ImportError):
        from transformers.pytorch_utils import Conv1D  # x @ W + b: the same norms

        kinds += (Conv1D,)
    linears = [m for m in pb.model.modules() if isinstance(m, kinds)]
    norms: list[Tensor] = []

    def captured(module: nn.Module, args: tuple, out: Tensor) -> None:
        a = args[0].detach().flatten(1, -2) if args[0].dim() > 2 else args[0].detach()[:, None]
        biased = module.bias is not None

        def on_grad(grad: Tensor) -> None:
            s = grad.flatten(1, -2) if grad.dim() > 2 else grad[:, None]  # (B, T, out)
            if s.shape[1] == 1:
                sq = s[:, 0].square().sum(1)
                norms.append(sq * (a[:, 0].square().sum(1) + biased))
            else:
                weight = ((a @ a.mT) * (s @ s.mT)).sum((1, 2))
                norms.append(weight + s.sum(1).square().sum(1) if biased else weight)

        out.register_hook(on_grad)

    def step() -> Tensor:
        norms.clear()
        handles = [m.register_forward_hook(captured) for m in linears]
        try:
            clear_grads(params)
            loss(pb.model(*pb.inputs)).backward()
        finally:
            for h in handles:
                h.remove()
        return torch.stack(norms).sum(0).sqrt()

    step.note = left_out(pb.model, linears)  # the result's note: what it leaves out
    return step


def left_out(model: nn.Module, hooked: list[nn.Module]) -> str:
    """What hooks on the ``hooked`` modules' own parameters leave out of the trainable weights:
    their share of the elements, and the classes of the modules holding them ("" for none)."""
    mine = {id(p) for m in hooked for p in m.parameters(recurse=False)}
    owner = {id(p): type(m).__name__ for m in model.modules() for p in m.parameters(False)}
    params = list(trainable(model).values())
    rest = [p for p in params if id(p) not in mine]
    if not rest:
        return ""
    share = sum(p.numel() for p in rest) / sum(p.numel() for p in params)
    kinds = ", ".join(sorted({owner[id(p)] for p in rest}))
    return f"leaves out {share:.0%} of the weights ({len(rest)} of {len(params)} tensors: {kinds})"


def all_layer_hooks(pb: Problem) -> Step:
    """The yardstick for an exact pass: ``layer_hooks``, a hand-written rule per layer type, on
    every parameter (``linear_hooks`` serves the Linear layers alone)."""
    model, hooks = layer_hooks.all_layer_hooks(pb.model, pb.targets.shape[0])
    loss, params = _plain_summed_loss(pb), list(trainable(model).values())

    def step() -> Tensor:
        hooks.total.clear()
        clear_grads(params)
        loss(model(*pb.inputs)).backward()
        return torch.stack(hooks.total).sum(0).sqrt()

    return step


# ---------------------------------------------------------------- the loop and torch.func


def _example(pb: Problem, i: int) -> tuple[tuple[Tensor, ...], Tensor]:
    return tuple(t[i : i + 1] for t in pb.inputs), pb.targets[i : i + 1]


def _ref_grads(pb: Problem) -> dict[str, Tensor]:
    """Gradient of the mean loss over the reference batch, as gradscope's influence defines it."""
    params = trainable(pb.model)
    loss = resolve_loss(pb.loss)(pb.model(*pb.ref_inputs), pb.ref_targets).mean()
    return dict(zip(params, torch.autograd.grad(loss, list(params.values())), strict=True))


def _ref_rows(pb: Problem) -> list[dict[str, Tensor]]:
    """Each reference example's own loss gradient, by its own backward: ``--per-ref``'s."""
    loss_fn, params = resolve_loss(pb.loss), trainable(pb.model)
    out = []
    for i in range(pb.ref_targets.shape[0]):
        x, y = tuple(t[i : i + 1] for t in pb.ref_inputs), pb.ref_targets[i : i + 1]
        grads = torch.autograd.grad(loss_fn(pb.model(*x), y)[0], list(params.values()))
        out.append(dict(zip(params, grads, strict=True)))
    return out


def _flat(pb: Problem, grads: dict[str, Tensor]) -> Tensor:
    """One vector of per-parameter tensors, in the model's parameter order."""
    return torch.cat([grads[n].flatten() for n in trainable(pb.model)])


def _loop(pb: Problem, reduce: Callable[[dict[str, Tensor]], Tensor]) -> Step:
    """One backward per example; ``reduce`` turns its gradients {name: grad} into one number."""
    loss_fn, params = resolve_loss(pb.loss), trainable(pb.model)

    def step() -> Tensor:
        out = []
        for i in range(pb.targets.shape[0]):
            x, y = _example(pb, i)
            loss = loss_fn(pb.model(*x), y)[0]
            grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
            out.append(reduce({n: g for n, g in zip(params, grads, strict=True) if g is not None}))
        return torch.stack(out)

    return step


def loop_norms(pb: Problem) -> Step:
    return _loop(pb, lambda grads: sum(g.pow(2).sum() for g in grads.values()).sqrt())


def loop_reference(pb: Problem) -> Step:
    return lambda: _flat(pb, _ref_grads(pb))


def loop_influence(pb: Problem) -> Step:
    ref = _ref_grads(pb)
    return _loop(pb, lambda grads: sum((g * ref[n]).sum() for n, g in grads.items()))


def loop_per_ref(pb: Problem) -> Step:
    refs = _ref_rows(pb)

    def dots(grads: dict[str, Tensor]) -> Tensor:  # (R,)
        return torch.stack([sum((g * r[n]).sum() for n, g in grads.items()) for r in refs])

    return _loop(pb, dots)


def _vmap_grads(pb: Problem) -> Callable[[], dict[str, Tensor]]:
    """Per-example gradients {name: (B, *shape)} with torch.func's vmap(grad(...))."""
    from torch.func import functional_call, grad, vmap

    loss_fn = resolve_loss(pb.loss)
    buffers = dict(pb.model.named_buffers())
    n_in = len(pb.inputs)

    def one(params: dict[str, Tensor], *args: Tensor) -> Tensor:
        xs, y = args[:n_in], args[n_in]
        out = functional_call(pb.model, (params, buffers), tuple(x.unsqueeze(0) for x in xs))
        return loss_fn(out, y.unsqueeze(0))[0]

    per_example = vmap(grad(one), in_dims=(None,) + (0,) * (n_in + 1))

    def run() -> dict[str, Tensor]:
        params = {n: p.detach() for n, p in trainable(pb.model).items()}
        return per_example(params, *pb.inputs, pb.targets)

    return run


def func_norms(pb: Problem) -> Step:
    grads = _vmap_grads(pb)

    def step() -> Tensor:
        return torch.stack([g.flatten(1).pow(2).sum(1) for g in grads().values()]).sum(0).sqrt()

    return step


def func_influence(pb: Problem) -> Step:
    grads, ref = _vmap_grads(pb), _ref_grads(pb)

    def step() -> Tensor:
        per_example = grads()
        return sum(per_example[n].flatten(1) @ r.flatten() for n, r in ref.items())

    return step


# ---------------------------------------------------------------- Opacus and BackPACK


def _import(module: str):
    try:
        return __import__(module, fromlist=["_"])
    except ImportError as e:
        raise Skip("missing", f"{module} is not installed") from e


def _opacus_model(pb: Problem) -> nn.Module:
    """The model as Opacus takes it, after checking that any module it swaps computes the same."""
    validators = _import("opacus.validators")
    model = copy.deepcopy(pb.model)
    if validators.ModuleValidator.validate(model, strict=False):
        fixed = validators.ModuleValidator.fix(model).eval()
        with torch.no_grad():
            want, got = model(*pb.inputs), fixed(*pb.inputs)
        err = ((want - got).abs().max() / want.abs().max()).item()
        if err > WRONG_REL_ERR:
            raise Skip(
                "wrong",
                f"ModuleValidator.fix (DPMultiheadAttention) changes the outputs by {err:.2g} "
                "relative (opacus#774)",
                "opacus#774",
            )
        model = fixed
    # Opacus captures only in training mode; dropout stays off so examples match the loop
    model.train()
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.eval()
    return model


def opacus_hooks(pb: Problem) -> Step:
    grad_sample = _import("opacus.grad_sample")
    gsm = grad_sample.GradSampleModule(_opacus_model(pb), batch_first=True, loss_reduction="sum")
    loss, params, batch = _plain_summed_loss(pb), trainable(gsm), pb.targets.shape[0]

    def step() -> Tensor:
        gsm.zero_grad(set_to_none=True)
        loss(gsm(*pb.inputs)).backward()
        samples = {n.removeprefix("_module."): p.grad_sample for n, p in params.items()}
        # a table the batch shares (position ids of shape (1, T)) gets a grad_sample of batch 1
        off = [n for n, g in samples.items() if g is None or g.shape[0] != batch]
        if off:
            raise Skip(
                "wrong",
                f"no grad_sample of batch {batch} for {', '.join(off)}",
                f"{len(off)} of {len(params)} params",
            )
        return torch.stack([g.flatten(1).pow(2).sum(1) for g in samples.values()]).sum(0).sqrt()

    return step


def opacus_ghost(pb: Problem) -> Step:
    grad_sample = _import("opacus.grad_sample")
    gsm = grad_sample.GradSampleModuleFastGradientClipping(
        _opacus_model(pb), batch_first=True, loss_reduction="sum", use_ghost_clipping=True
    )
    loss = _plain_summed_loss(pb)

    def step() -> Tensor:
        gsm.zero_grad(set_to_none=True)
        loss(gsm(*pb.inputs)).backward()
        return gsm.get_norm_sample()

    return step


def backpack_l2(pb: Problem) -> Step:
    backpack = _import("backpack")
    extensions = _import("backpack.extensions")
    model = backpack.extend(copy.deepcopy(pb.model))
    loss, params = _plain_summed_loss(pb), list(trainable(model).values())

    def step() -> Tensor:
        for p in params:
            p.grad = None
            if hasattr(p, "batch_l2"):
                del p.batch_l2  # so a parameter BackPACK skipped this time cannot look served
        with backpack.backpack(extensions.BatchL2Grad()):
            loss(model(*pb.inputs)).backward()
        missing = sum(not hasattr(p, "batch_l2") for p in params)
        if missing:  # BackPACK only warns about modules it cannot handle
            note = f"{missing} of {len(params)} parameters got no batch_l2"
            raise Skip("wrong", note, f"{missing} of {len(params)} params")
        return torch.stack([p.batch_l2 for p in params]).sum(0).sqrt()

    return step


# ---------------------------------------------------------------- gradscope


def held(pb: Problem) -> Engine:
    """An Engine built and entered once, as ``gradscope norms`` holds its own over all the
    batches of a dataset, on a copy of the model (as the peers' hooks are attached to theirs):
    the other methods' passes never meet its module hooks."""
    core = Engine(copy.deepcopy(pb.model), resolve_loss(pb.loss))
    core.__enter__()  # held for the process's life
    return core


def gradscope_norms(pb: Problem) -> Step:
    """One batch of a run."""
    core = held(pb)
    return lambda: total(core.norms(pb.inputs, pb.targets).norm_sq).sqrt()


def _gradscope_refs(pb: Problem, factored: bool = False) -> dict[str, Tensor]:
    """{name: (1, *shape)}: gradscope's reference gradient, on a fresh Engine as the API takes it;
    ``factored``: kept as ``gradscope influence --curvature none`` keeps it (``Factored``)."""
    core = Engine(pb.model, resolve_loss(pb.loss))
    with core:
        return reference_gradients(core, [(pb.ref_inputs, pb.ref_targets)], factored=factored)


def gradscope_reference(pb: Problem) -> Step:
    return lambda: _flat(pb, {n: r[0] for n, r in _gradscope_refs(pb).items()})


def gradscope_influence(engine: str) -> Callable[[Problem], Step]:
    """gradscope's scoring pass with one engine, ``hooks`` (ghost inner products) or ``jvp``:
    one batch of ``gradscope influence``, whose reference gradient and scorer the setup
    computes and builds once (the scorer, as the command holds its own over the batches: where
    forward mode fails on the model, the first batch alone tries it)."""

    def setup(pb: Problem) -> Step:
        scorer = Influence(held(pb), _gradscope_refs(pb, factored=True), engine, norms=False)
        return lambda: scorer(pb.inputs, pb.targets).inner[:, 0]

    return setup


def gradscope_per_ref(pb: Problem) -> Step:
    """``influence --per-ref``'s scoring pass (its engine ``auto``: the hooks, R > 1), against
    the 8 reference examples' own gradients, which the setup computes on a fresh Engine (kept
    factored where that costs less, as the command keeps them)."""
    core = Engine(pb.model, resolve_loss(pb.loss))
    with core:
        refs = reference_gradients(
            core, [(pb.ref_inputs, pb.ref_targets)], per_ref=True, factored=True
        )
    scorer = Influence(held(pb), refs, "auto", norms=False)
    return lambda: scorer(pb.inputs, pb.targets).inner


def _projector(pb: Problem, core: Engine) -> Projector:
    """The projections ``gradscope index`` draws for the model, at its default dimension."""
    device = next(pb.model.parameters()).device
    return Projector(blocks(core.plan, DEFAULT_DIM), 0, device, torch.float32)


def loop_index(pb: Problem) -> Step:
    """Each example's gradient formed by its own backward, then projected (the definition)."""
    projector = _projector(pb, Engine(pb.model, resolve_loss(pb.loss)))
    return _loop(pb, lambda grads: projector.dense({n: g[None] for n, g in grads.items()})[0])


def gradscope_index(pb: Problem) -> Step:
    """The pass of ``gradscope index`` on one batch: the projections answered in the backward."""
    core = held(pb)
    projector = _projector(pb, core)
    want = Want(norms=False, project=projector.projections)
    rows = None  # the scorer's buffer of a batch's rows, kept from batch to batch

    def step() -> Tensor:
        nonlocal rows
        inner = core.scores(pb.inputs, pb.targets, want).inner
        rows = reused(rows, pb.targets.shape[0], projector.width, inner)
        return projector.rows(inner, rows)

    return step


METHODS = {
    m.key: m
    for m in [
        Method("floor", "floor", floor),
        Method("linear hooks", "floor", linear_hooks),
        Method("loop", "norms", loop_norms),
        Method("all-layer hooks", "norms", all_layer_hooks),
        Method("torch.func", "norms", func_norms),
        Method("opacus hooks", "norms", opacus_hooks),
        Method("opacus ghost", "norms", opacus_ghost),
        Method("backpack", "norms", backpack_l2),
        Method("gradscope", "norms", gradscope_norms),
        Method("loop", "reference", loop_reference),
        Method("gradscope", "reference", gradscope_reference),
        Method("loop", "influence", loop_influence),
        Method("torch.func", "influence", func_influence),
        Method("gradscope hooks", "influence", gradscope_influence("hooks")),
        Method("gradscope jvp", "influence", gradscope_influence("jvp")),
        Method("loop", "per-ref", loop_per_ref),
        Method("gradscope", "per-ref", gradscope_per_ref),
        Method("loop", "index", loop_index),
        Method("gradscope", "index", gradscope_index),
    ]
}
