"""Time and peak memory of per-example gradient norms and influence, as ratios to one plain backward.

    python benchmarks/bench.py [--quick] [--workloads W1,W2] [--json out.json] [--markdown out.md]

Every method runs on the same model, batch and loss as the floor: one forward and one backward of
the batch's summed loss with all parameters requiring grad. Each workload runs in its own
subprocess, where the methods take turns round-robin (the starting method rotates every round)
after warm-up, and the median of the repeats is reported. Peak memory is measured in a second
subprocess per workload (see ``measure_memory``). Every answer is checked against the naive
per-example loop before it is timed, so a fast wrong answer shows up as "wrong", not as a win.
Peers (torch.func, Opacus, BackPACK) are optional: one that is not installed is "missing".
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import gc
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import families
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import gradscope
from gradscope.losses import resolve_loss

# An answer further than this from the loop's (max |a - e| / max |e|) is reported as wrong.
WRONG_REL_ERR = 1e-3


# ---------------------------------------------------------------- workloads


class CNN(nn.Sequential):
    """The network of PyTorch's per-sample-gradients tutorial, with its dropout."""

    def __init__(self) -> None:
        super().__init__(
            nn.Conv2d(1, 32, 3, 1),
            nn.ReLU(),
            nn.Conv2d(32, 64, 3, 1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Dropout(0.25),
            nn.Flatten(),
            nn.Linear(9216, 128),
            nn.ReLU(),
            nn.Linear(128, 10),
        )


class Classifier(nn.Module):
    """Transformer encoder over tokens, mean-pooled, then a linear head."""

    def __init__(
        self, vocab: int, seq: int, d: int, heads: int, ff: int, layers: int, classes: int
    ):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        layer = nn.TransformerEncoderLayer(d, heads, ff, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, classes)

    def forward(self, ids: Tensor) -> Tensor:
        b, t = ids.shape
        # contiguous position ids: Opacus' ghost embedding norm calls .view() on them
        pos = torch.arange(t, device=ids.device).repeat(b, 1)  # (B, T)
        h = self.encoder(self.tok(ids) + self.pos(pos))  # (B, T, d)
        return self.head(h.mean(1))  # (B, classes)


class CausalLM(nn.Module):
    """Pre-norm causal transformer whose output projection is the token embedding (tied)."""

    def __init__(self, vocab: int, seq: int, d: int, heads: int, ff: int, layers: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        layer = nn.TransformerEncoderLayer(
            d, heads, ff, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.tok.weight
        # GPT-2's 0.02, not Embedding's N(0, 1): tied to the output, N(0, 1) gives logits of
        # scale sqrt(d), softmax probabilities that underflow to denormals, and matmuls on those
        # run 50x slower on x86, which would time the CPU's denormal path, not the methods
        for table in (self.tok, self.pos):
            nn.init.normal_(table.weight, std=0.02)

    def forward(self, ids: Tensor) -> Tensor:
        b, t = ids.shape
        pos = torch.arange(t, device=ids.device).repeat(b, 1)  # (B, T)
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=ids.device)
        h = self.blocks(self.tok(ids) + self.pos(pos), mask=mask, is_causal=True)  # (B, T, d)
        return self.lm_head(self.norm(h))  # (B, T, vocab)


@dataclass
class Problem:
    """One workload, built: a model in eval mode, a batch, a reference batch and the loss name."""

    model: nn.Module
    inputs: tuple[Tensor, ...]
    targets: Tensor
    ref_inputs: tuple[Tensor, ...]
    ref_targets: Tensor
    loss: str

    def to(self, device: torch.device) -> Problem:
        def move(ts: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
            return tuple(t.to(device) for t in ts)

        return Problem(
            self.model.to(device),
            move(self.inputs),
            self.targets.to(device),
            move(self.ref_inputs),
            self.ref_targets.to(device),
            self.loss,
        )


@dataclass(frozen=True)
class Workload:
    name: str
    title: str
    build: Callable[[], Problem]
    requires: str | None = None  # an optional package it is built with: "missing" without it

    @property
    def missing(self) -> bool:
        return self.requires is not None and importlib.util.find_spec(self.requires) is None


Inputs = Tensor | tuple[Tensor, ...]


def _problem(model: nn.Module, make: Callable[[int], tuple[Inputs, Tensor]], batch: int, loss: str):
    """Model in eval mode (as gradscope scores), a batch and an 8-example reference batch."""
    (x, y), (rx, ry) = make(batch), make(8)
    x, rx = (x, rx) if isinstance(x, tuple) else ((x,), (rx,))
    return Problem(model.eval(), x, y, rx, ry, loss)


def _mlp(sizes: Sequence[int], batch: int) -> Problem:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        layers += [nn.Linear(a, b)] + ([nn.ReLU()] if i < len(sizes) - 2 else [])
    return _problem(
        nn.Sequential(*layers),
        lambda n: (torch.randn(n, sizes[0]), torch.randn(n)),
        batch,
        "mse",
    )


def _cnn() -> Problem:
    torch.manual_seed(0)
    return _problem(
        CNN(),
        lambda n: (torch.randn(n, 1, 28, 28), torch.randint(0, 10, (n,))),
        64,
        "cross_entropy",
    )


def _classifier() -> Problem:
    torch.manual_seed(0)
    model = Classifier(vocab=8000, seq=128, d=128, heads=4, ff=512, layers=2, classes=10)
    return _problem(
        model,
        lambda n: (torch.randint(0, 8000, (n, 128)), torch.randint(0, 10, (n,))),
        32,
        "cross_entropy",
    )


def _lm() -> Problem:
    torch.manual_seed(0)
    model = CausalLM(vocab=8000, seq=512, d=128, heads=4, ff=512, layers=2)

    def make(n: int) -> tuple[Tensor, Tensor]:
        ids = torch.randint(0, 8000, (n, 513))
        return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()  # next-token targets

    return _problem(model, make, 8, "cross_entropy")


def _next_tokens(vocab: int, seq: int) -> Callable[[int], tuple[Inputs, Tensor]]:
    """ids of T tokens, and ids 1..T-1 as the targets of the logits at 0..T-2 (families.Logits)."""

    def make(n: int) -> tuple[Inputs, Tensor]:
        ids = torch.randint(0, vocab, (n, seq))
        return ids, ids[:, 1:].contiguous()

    return make


def _hf_gpt2() -> Problem:
    torch.manual_seed(0)
    model = families.hf_gpt2(vocab=8000, d=256, layers=4, heads=4, seq=256)
    return _problem(model, _next_tokens(8000, 256), 8, "cross_entropy")


def _hf_bert() -> Problem:
    torch.manual_seed(0)
    model = families.hf_bert(vocab=8000, d=256, layers=4, heads=4, seq=128)

    def make(n: int) -> tuple[Inputs, Tensor]:
        mask = families.padding_mask(n, 128)
        return (torch.randint(1, 8000, (n, 128)) * mask, mask), torch.randint(0, 3, (n,))

    return _problem(model, make, 16, "cross_entropy")


def _hf_llama() -> Problem:
    torch.manual_seed(0)
    model = families.hf_llama(vocab=8000, d=256, layers=4, heads=8, kv_heads=2, seq=256)
    return _problem(model, _next_tokens(8000, 256), 8, "cross_entropy")


def _hf_mixtral() -> Problem:
    torch.manual_seed(0)
    model = families.hf_mixtral(vocab=8000, d=256, layers=4, heads=8, experts=8, seq=256)
    return _problem(model, _next_tokens(8000, 256), 8, "cross_entropy")


def _hf_bart() -> Problem:
    torch.manual_seed(0)
    model = families.hf_bart(vocab=8000, d=256, layers=3, heads=4, seq=256)

    def make(n: int) -> tuple[Inputs, Tensor]:
        ids = torch.randint(4, 8000, (n, 256))
        return ids, ids  # the decoder reconstructs its input

    return _problem(model, make, 8, "cross_entropy")


def _vit() -> Problem:
    torch.manual_seed(0)
    return _problem(
        families.ViT(img=32, patch=4, d=192, layers=6, heads=3, classes=10),
        lambda n: (torch.randn(n, 3, 32, 32), torch.randint(0, 10, (n,))),
        64,
        "cross_entropy",
    )


WORKLOADS = {
    w.name: w
    for w in [
        Workload(
            "W1", "MLP 256-512-512-1, batch 1024, MSE", lambda: _mlp([256, 512, 512, 1], 1024)
        ),
        Workload("W2", "tutorial CNN, batch 64 of 1x28x28", _cnn),
        Workload("W3", "transformer classifier d128 T128, batch 32", _classifier),
        Workload("W4", "causal LM d128 T512 tied, batch 8", _lm),
        Workload("W5", "HF GPT-2 d256 4 layers T256, batch 8", _hf_gpt2, "transformers"),
        Workload(
            "W6", "HF BERT classifier d256 4 layers T128 padded, batch 16", _hf_bert, "transformers"
        ),
        Workload("W7", "HF LLaMA d256 4 layers GQA T256, batch 8", _hf_llama, "transformers"),
        Workload("W8", "timm-style ViT 32x32 patch 4 d192 6 layers, batch 64", _vit),
        Workload(
            "W9",
            "HF Mixtral d256 4 layers 8 experts top-2 T256, batch 8",
            _hf_mixtral,
            "transformers",
        ),  # fmt: skip
        Workload("W10", "HF BART d256 3+3 layers T256, batch 8", _hf_bart, "transformers"),
        # for the smoke test: seconds, not minutes
        Workload("tiny", "MLP 8-16-1, batch 4", lambda: _mlp([8, 16, 1], 4)),
    ]
}
DEFAULT_WORKLOADS = ("W1", "W2", "W3", "W4", "W5", "W6", "W7", "W8", "W9", "W10")


# ---------------------------------------------------------------- methods


class Skip(Exception):
    """A method that cannot be timed here; ``status`` says why (missing, wrong, unsupported...)."""

    def __init__(self, status: str, note: str = ""):
        super().__init__(status)
        self.status, self.note = status, note


Step = Callable[[], Tensor | None]


@dataclass(frozen=True)
class Method:
    name: str
    task: str  # "floor", "norms" or "influence"
    setup: Callable[[Problem], Step]  # done once, untimed; the step is what is timed

    @property
    def key(self) -> str:
        """ "floor", "norms:loop", "influence:gradscope", ..."""
        return self.task if self.task == "floor" else f"{self.task}:{self.name}"


def _params(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def _clear_grads(params: Sequence[nn.Parameter]) -> None:
    for p in params:
        p.grad = None


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


def floor(pb: Problem) -> Step:
    loss, params = _plain_summed_loss(pb), _params(pb.model)

    def step() -> None:
        _clear_grads(params)  # so the floor's peak memory includes allocating the gradients
        loss(pb.model(*pb.inputs)).backward()

    return step


def _example(pb: Problem, i: int) -> tuple[tuple[Tensor, ...], Tensor]:
    return tuple(t[i : i + 1] for t in pb.inputs), pb.targets[i : i + 1]


def _ref_grads(pb: Problem, params: Sequence[nn.Parameter]) -> tuple[Tensor, ...]:
    """Gradient of the mean loss over the reference batch, as gradscope's influence defines it."""
    loss = resolve_loss(pb.loss)(pb.model(*pb.ref_inputs), pb.ref_targets).mean()
    return torch.autograd.grad(loss, params)


def loop_norms(pb: Problem) -> Step:
    loss_fn, params = resolve_loss(pb.loss), _params(pb.model)

    def step() -> Tensor:
        out = []
        for i in range(pb.targets.shape[0]):
            x, y = _example(pb, i)
            grads = torch.autograd.grad(loss_fn(pb.model(*x), y)[0], params, allow_unused=True)
            out.append(sum(g.pow(2).sum() for g in grads if g is not None))
        return torch.stack(out).sqrt()

    return step


def loop_influence(pb: Problem) -> Step:
    loss_fn, params = resolve_loss(pb.loss), _params(pb.model)

    def step() -> Tensor:
        ref = _ref_grads(pb, params)
        out = []
        for i in range(pb.targets.shape[0]):
            x, y = _example(pb, i)
            grads = torch.autograd.grad(loss_fn(pb.model(*x), y)[0], params, allow_unused=True)
            out.append(sum((g * r).sum() for g, r in zip(grads, ref, strict=True) if g is not None))
        return torch.stack(out)

    return step


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
        params = {n: p.detach() for n, p in pb.model.named_parameters()}
        return per_example(params, *pb.inputs, pb.targets)

    return run


def func_norms(pb: Problem) -> Step:
    grads = _vmap_grads(pb)

    def step() -> Tensor:
        return torch.stack([g.flatten(1).pow(2).sum(1) for g in grads().values()]).sum(0).sqrt()

    return step


def func_influence(pb: Problem) -> Step:
    grads, params = _vmap_grads(pb), _params(pb.model)

    def step() -> Tensor:
        ref = _ref_grads(pb, params)
        per_example = grads().values()  # same order as named_parameters, as ref
        return torch.stack(
            [(g.flatten(1) @ r.flatten()) for g, r in zip(per_example, ref, strict=True)]
        ).sum(0)

    return step


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
    loss, params = _plain_summed_loss(pb), _params(gsm)

    def step() -> Tensor:
        gsm.zero_grad(set_to_none=True)
        loss(gsm(*pb.inputs)).backward()
        if any(p.grad_sample is None for p in params):
            raise Skip("wrong", "some parameters got no grad_sample")
        return torch.stack([p.grad_sample.flatten(1).pow(2).sum(1) for p in params]).sum(0).sqrt()

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
    loss, params = _plain_summed_loss(pb), _params(model)

    def step() -> Tensor:
        for p in params:
            p.grad = None
            if hasattr(p, "batch_l2"):
                del p.batch_l2  # so a parameter BackPACK skipped this time cannot look served
        with backpack.backpack(extensions.BatchL2Grad()):
            loss(model(*pb.inputs)).backward()
        missing = sum(not hasattr(p, "batch_l2") for p in params)
        if missing:  # BackPACK only warns about modules it cannot handle
            raise Skip("wrong", f"{missing} of {len(params)} parameters got no batch_l2")
        return torch.stack([p.batch_l2 for p in params]).sum(0).sqrt()

    return step


def gradscope_norms(pb: Problem) -> Step:
    def step() -> Tensor:
        return gradscope.per_example_norms(pb.model, pb.inputs, pb.targets, loss=pb.loss)

    return step


def gradscope_influence(engine: str) -> Callable[[Problem], Step]:
    """gradscope's influence with one engine: ``hooks`` (ghost inner products) or ``jvp``."""

    def setup(pb: Problem) -> Step:
        def step() -> Tensor:
            return gradscope.per_example_influence(
                pb.model,
                pb.inputs,
                pb.targets,
                pb.ref_inputs,
                pb.ref_targets,
                loss=pb.loss,
                engine=engine,
            )

        return step

    return setup


METHODS = {
    m.key: m
    for m in [
        Method("floor", "floor", floor),
        Method("loop", "norms", loop_norms),
        Method("torch.func", "norms", func_norms),
        Method("opacus hooks", "norms", opacus_hooks),
        Method("opacus ghost", "norms", opacus_ghost),
        Method("backpack", "norms", backpack_l2),
        Method("gradscope", "norms", gradscope_norms),
        Method("loop", "influence", loop_influence),
        Method("torch.func", "influence", func_influence),
        Method("gradscope hooks", "influence", gradscope_influence("hooks")),
        Method("gradscope jvp", "influence", gradscope_influence("jvp")),
    ]
}


# ---------------------------------------------------------------- one workload, in one process


@dataclass
class Result:
    workload: str
    method: str  # a METHODS key
    status: str = "ok"  # ok | wrong | missing | fails
    note: str = ""
    time_s: float | None = None
    mem_bytes: int | None = None
    rel_err: float | None = None
    time_ratio: float | None = None
    mem_ratio: float | None = None
    times_s: list[float] = field(default_factory=list)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _setup(
    pb: Problem, workload: str, keys: Sequence[str]
) -> tuple[dict[str, Step], dict[str, Result]]:
    steps: dict[str, Step] = {}
    results = {k: Result(workload, k) for k in keys}
    for key in keys:
        try:
            steps[key] = METHODS[key].setup(pb)
        except Exception as e:  # noqa: BLE001 - a peer that breaks is a result, not a crash
            _fail(results[key], e)
    return steps, results


def _fail(result: Result, e: Exception) -> None:
    if isinstance(e, Skip):
        result.status, result.note = e.status, e.note
    else:
        result.status, result.note = "fails", f"{type(e).__name__}: {e}".splitlines()[0][:200]


def _rel_err(actual: Tensor, expected: Tensor) -> float:
    actual, expected = actual.detach().double().cpu(), expected.detach().double().cpu()
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-30)).item()


def time_workload(
    workload: str,
    keys: Sequence[str],
    repeats: int,
    warmup: int,
    device: torch.device,
    budget_s: float = float("inf"),
) -> list[Result]:
    """Check every method against the loop, then time them round-robin; medians in ``time_s``.

    A method stops being timed once its samples add up to ``budget_s`` (it keeps at least one).
    """
    pb = WORKLOADS[workload].build().to(device)
    steps, results = _setup(pb, workload, keys)
    answers: dict[str, Tensor | None] = {}
    for key, step in list(steps.items()):
        try:
            answers[key] = step()  # also the first warm-up call
        except Exception as e:  # noqa: BLE001
            _fail(results[key], e)
            del steps[key]
    for key in steps:
        method = METHODS[key]
        reference = answers.get(f"{method.task}:loop")
        if method.task == "floor" or method.name == "loop":
            continue
        if reference is None:
            results[key].note = "not checked: the loop did not run"
            continue
        results[key].rel_err = _rel_err(answers[key], reference)
        if results[key].rel_err > WRONG_REL_ERR:
            results[key].status = "wrong"
    order = list(steps)
    for r in range(warmup - 1 + repeats):
        # rotate the starting method so none always runs right after the same neighbour
        for key in order[r % len(order) :] + order[: r % len(order)]:
            if sum(results[key].times_s) > budget_s:
                continue  # a slow baseline: one or two samples place it well enough
            gc.collect()
            _sync(device)
            start = time.perf_counter()
            steps[key]()
            _sync(device)
            if r >= warmup - 1:
                results[key].times_s.append(time.perf_counter() - start)
    for key in steps:
        results[key].time_s = statistics.median(results[key].times_s)
    return list(results.values())


def _rss_kib(field_name: str) -> int:
    status = Path("/proc/self/status").read_text()
    return int(re.search(rf"{field_name}:\s+(\d+)", status).group(1))


def _peak_bytes(step: Step, device: torch.device) -> int:
    """Memory above what was held before the call, at the call's peak."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        step()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand freed pages back, so the baseline is live data
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak RSS (VmHWM) to the current RSS
    before = _rss_kib("VmRSS")
    step()
    return (_rss_kib("VmHWM") - before) * 1024


def measure_memory(workload: str, keys: Sequence[str], device: torch.device) -> list[Result]:
    """Peak memory of one call of each method, after one warm-up call, methods one at a time.

    On the CPU the process runs with ``MALLOC_MMAP_THRESHOLD_`` fixed at 64 KiB, so every large
    tensor is its own mapping that goes back to the system when freed, and the peak resident set
    size (Linux VmHWM, reset through /proc/self/clear_refs) above the resident size just before
    the call is the memory the call needed at its worst moment. On CUDA: max_memory_allocated.
    """
    pb = WORKLOADS[workload].build().to(device)
    results = []
    for key in keys:
        result = Result(workload, key)
        try:
            step = METHODS[key].setup(pb)
            step()
            result.mem_bytes = _peak_bytes(step, device)
        except Exception as e:  # noqa: BLE001
            _fail(result, e)
        step = None
        _clear_grads(list(pb.model.parameters()))
        results.append(result)
    return results


# ---------------------------------------------------------------- all workloads, one subprocess each


def _worker(args: argparse.Namespace) -> None:
    keys, device = args.methods.split(","), torch.device(args.device)
    if args.mode == "time":
        results = time_workload(args.worker, keys, args.repeats, args.warmup, device, args.budget)
    else:
        results = measure_memory(args.worker, keys, device)
    Path(args.out).write_text(json.dumps([asdict(r) for r in results]))


def _spawn(workload: str, mode: str, keys: Sequence[str], args: argparse.Namespace) -> list[Result]:
    env = dict(os.environ)
    if mode == "memory":
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "results.json"
        cmd = [
            sys.executable, __file__, "--worker", workload, "--mode", mode,
            "--methods", ",".join(keys), "--repeats", str(args.repeats),
            "--warmup", str(args.warmup), "--budget", str(args.budget), "--device", args.device,
            "--threads", str(args.threads), "--out", str(out),
        ]  # fmt: skip
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0 or not out.exists():
            tail = (proc.stderr.strip().splitlines() or ["no output"])[-1][:200]
            return [
                Result(
                    workload,
                    k,
                    status="fails",
                    note=f"{mode} worker exit {proc.returncode}: {tail}",
                )
                for k in keys
            ]
        return [Result(**r) for r in json.loads(out.read_text())]


def run_workload(workload: str, keys: Sequence[str], args: argparse.Namespace) -> list[Result]:
    """Timing and memory subprocesses for one workload, merged, as ratios to the floor."""
    if WORKLOADS[workload].missing:
        note = f"{WORKLOADS[workload].requires} is not installed"
        return [Result(workload, k, status="missing", note=note) for k in keys]
    timed = _spawn(workload, "time", keys, args)
    memory = {r.method: r for r in _spawn(workload, "memory", keys, args)}
    floor = next((r for r in timed if r.method == "floor"), None)
    floor_mem = memory.get("floor")
    for r in timed:
        r.mem_bytes = memory[r.method].mem_bytes if r.status in ("ok", "wrong") else None
        if r.time_s is not None and floor is not None and floor.time_s:
            r.time_ratio = r.time_s / floor.time_s
        if r.mem_bytes is not None and floor_mem is not None and floor_mem.mem_bytes:
            r.mem_ratio = r.mem_bytes / floor_mem.mem_bytes
    return timed


# ---------------------------------------------------------------- reports


def _ratio(x: float | None) -> str:
    return "" if x is None else f"{x:.2f}x"


def _cell(r: Result) -> str:
    """One markdown cell: time and memory ratios, or why there are none."""
    if r.status in ("ok", "wrong") and r.time_ratio is not None:
        text = f"{r.time_ratio:.2f}x / {_ratio(r.mem_ratio) or '?'}"
        return text if r.status == "ok" else f"wrong ({text})"
    return r.status


def markdown(results: Sequence[Result], workloads: Sequence[str]) -> str:
    """Methods down, workloads across: 'time / peak memory' as multiples of the floor."""
    keys = list(dict.fromkeys(r.method for r in results))
    by = {(r.workload, r.method): r for r in results}
    lines = [
        "| method | " + " | ".join(f"{w} {WORKLOADS[w].title}" for w in workloads) + " |",
        "|---|" + "---|" * len(workloads),
    ]
    floor = ["floor (absolute)"]
    for w in workloads:
        r = by.get((w, "floor"))
        mem = "?" if r is None or r.mem_bytes is None else f"{r.mem_bytes / 2**20:.0f} MiB"
        floor.append("?" if r is None or r.time_s is None else f"{r.time_s * 1e3:.1f} ms / {mem}")
    lines.append("| " + " | ".join(floor) + " |")
    for key in keys:
        if key == "floor":
            continue
        cells = [_cell(by[(w, key)]) if (w, key) in by else "" for w in workloads]
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    notes = [
        f"- {r.workload} {r.method}: {r.status}: {r.note}"
        for r in results
        if r.status not in ("ok",) and r.note
    ]
    return "\n".join(lines + ([""] + notes if notes else [])) + "\n"


def print_table(results: Sequence[Result]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="ratios to the floor (one forward+backward of the summed loss)")
    for col in [
        "workload",
        "method",
        "time",
        "time/floor",
        "peak mem",
        "mem/floor",
        "rel err",
        "status",
    ]:
        table.add_column(
            col, justify="left" if col in ("workload", "method", "status") else "right"
        )
    for r in results:
        table.add_row(
            r.workload,
            r.method,
            "" if r.time_s is None else f"{r.time_s * 1e3:.1f} ms",
            _ratio(r.time_ratio),
            "" if r.mem_bytes is None else f"{r.mem_bytes / 2**20:.1f} MiB",
            _ratio(r.mem_ratio),
            "" if r.rel_err is None else f"{r.rel_err:.1e}",
            r.status if not r.note else f"{r.status}: {r.note}",
        )
    Console(width=200).print(table)


def _environment(args: argparse.Namespace) -> dict[str, object]:
    versions: dict[str, object] = {"python": platform.python_version(), "torch": torch.__version__}
    for dist in ("opacus", "backpack-for-pytorch", "gradscope"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = None
    return {
        **versions,
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": args.device,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "budget_s": args.budget,
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats: a few minutes in all")
    parser.add_argument("--workloads", default=",".join(DEFAULT_WORKLOADS))
    parser.add_argument(
        "--methods", default=",".join(METHODS), help="METHODS keys, comma-separated"
    )
    parser.add_argument(
        "--repeats", type=int, default=None, help="timed rounds (default 7, quick 3)"
    )
    parser.add_argument(
        "--warmup", type=int, default=None, help="untimed rounds, checking included"
    )
    parser.add_argument(
        "--budget",
        type=float,
        default=None,
        help="seconds of samples per method (default 20, quick 4)",
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    parser.add_argument("--json", type=Path, help="write every result here")
    parser.add_argument("--markdown", type=Path, help="write the README table here")
    # the subprocess side
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=["time", "memory"], help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.repeats = args.repeats or (3 if args.quick else 7)
    args.warmup = args.warmup or (1 if args.quick else 2)
    args.budget = args.budget or (4.0 if args.quick else 20.0)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.worker:
        _worker(args)
        return
    workloads = args.workloads.split(",")
    keys = args.methods.split(",")
    unknown = [w for w in workloads if w not in WORKLOADS] + [k for k in keys if k not in METHODS]
    if unknown:
        parser.error(f"unknown workload or method: {', '.join(unknown)}")
    if "floor" not in keys:
        keys.insert(0, "floor")  # every ratio needs it
    results: list[Result] = []
    for w in workloads:
        start = time.perf_counter()
        results += run_workload(w, keys, args)
        print(f"{w} done in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    print_table(results)
    table = markdown(results, workloads)
    print(table)
    if args.markdown:
        args.markdown.write_text(table)
    if args.json:
        report = {"environment": _environment(args), "results": [asdict(r) for r in results]}
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
