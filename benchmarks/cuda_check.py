"""gradscope on a GPU: exact against a float64 loop, and no host-device sync added to a step.

    python benchmarks/cuda_check.py [--device cuda] [--dtypes float32,bfloat16]
                                    [--workloads host,tiny,default] [--json out.json]

For each workload (``workloads.py``) and dtype, one ``Engine`` scores three batches of the same
shapes with different values (the first analysed, the others replayed): per-example gradient
norms, then norms and influence against the reference batch's gradient in one hooks pass. Each
answer is compared with a per-example backward loop in float64 on the same device, run on the
model's weights as the dtype holds them (so it computes the same function, without rounding),
and so is a per-example loop in the model's own dtype. gradscope is exact when its error is no
larger than a few times that loop's (``TIMES``) or under the dtype's floor (``FLOOR``), or where
it is within that floor of the batch's own loop: each example's loss backpropagated through one
forward of the whole batch in the model's dtype, which rounds as gradscope's pass does (a
batch's matrix products round differently from one example's, and a ReLU at its kink can then
take the other side).

On CUDA, a fourth batch's norms pass (replayed) runs under ``torch.cuda.set_sync_debug_mode("warn")``,
which warns at every operation that waits for the device, and so does one plain forward and
backward of the same batch: the counts are compared. The table goes to the terminal; ``--json``
keeps every number, and the docs' GPU page renders it.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import sys
import time
import warnings
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from provenance import measured_commit
from torch import Tensor, nn
from workloads import WORKLOADS, Problem, expand

from gradscope.engine import Engine, Influence, reference_gradients, total
from gradscope.losses import resolve_loss
from gradscope.rules.base import accumulation_dtype

TIMES = 4.0  # gradscope's error may be this many times the same-dtype loop's ...
FLOOR = {torch.float32: 1e-5, torch.float64: 1e-10, torch.bfloat16: 1e-2, torch.float16: 2e-3}
BATCHES = 3  # one analysed, the others replayed


@dataclass
class Check:
    workload: str
    dtype: str
    status: str = "ok"  # ok | wrong | fails
    note: str = ""
    reference: str = "float64"  # the dtype of the exact loop
    norms_err: list[float] = field(default_factory=list)  # gradscope vs float64, per batch
    influence_err: list[float] = field(default_factory=list)
    loop_norms_err: list[float] = field(default_factory=list)  # the same-dtype loop vs float64
    loop_influence_err: list[float] = field(default_factory=list)
    batch_norms_err: list[float] = field(default_factory=list)  # gradscope vs the batch's loop
    batch_influence_err: list[float] = field(default_factory=list)
    analyses: int = 0  # passes of the signature analysed in full (two a batch: norms, influence)
    replays: int = 0  # ... and replayed
    syncs: int | None = None  # operations of a replayed norms pass that waited for the device
    floor_syncs: int | None = None  # ... of a plain forward+backward
    sync_sites: dict[str, int] = field(default_factory=dict)  # gradscope's, beyond the step's
    seconds: float = 0.0


def _rel_err(actual: Tensor, expected: Tensor) -> float:
    actual, expected = actual.detach().double().cpu(), expected.detach().double().cpu()
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-30)).item()


def _trainable(model: nn.Module) -> dict[str, nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def _ref_grads(model: nn.Module, loss: str, inputs: tuple[Tensor, ...], targets: Tensor) -> list:
    params = list(_trainable(model).values())
    mean = resolve_loss(loss)(model(*inputs), targets).mean()
    return [g.detach() for g in torch.autograd.grad(mean, params)]


def _loop(
    model: nn.Module,
    loss: str,
    inputs: tuple[Tensor, ...],
    targets: Tensor,
    ref: list[Tensor],
    alone: bool = True,
) -> tuple[Tensor, Tensor]:
    """(B,) norms and (B,) inner products with ``ref``, one backward per example, summed in the
    dtype gradscope accumulates the model's in (float32 for half precision). ``alone``: each
    example through its own forward, as a per-example loop runs it; else each example's loss
    through one forward of the whole batch, whose matrix products round as gradscope's pass does
    (a ReLU at its kink may then take the other side: W1's float32 batch at seed 2)."""
    loss_fn, params = resolve_loss(loss), list(_trainable(model).values())
    acc = accumulation_dtype(params[0].dtype)
    batch = None if alone else loss_fn(model(*inputs), targets)
    norms, inner = [], []
    for i in range(targets.shape[0]):
        if alone:
            one = loss_fn(model(*(t[i : i + 1] for t in inputs)), targets[i : i + 1])[0]
        else:
            one = batch[i]
        grads = torch.autograd.grad(one, params, allow_unused=True, retain_graph=not alone)
        pairs = [(g.to(acc), r.to(acc)) for g, r in zip(grads, ref, strict=True) if g is not None]
        norms.append(sum(g.pow(2).sum() for g, _ in pairs).sqrt())
        inner.append(sum((g * r).sum() for g, r in pairs))
    return torch.stack(norms), torch.stack(inner)


def _syncs(device: torch.device, step) -> list[str]:
    """Where (file:line) each operation of ``step`` that waited for the device was called."""
    torch.cuda.synchronize(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return [f"{Path(w.filename).name}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)]


def _widened(ts: tuple[Tensor, ...], dtype: torch.dtype) -> tuple[Tensor, ...]:
    return tuple(t.to(dtype) if t.is_floating_point() else t for t in ts)


def _exact(pb: Problem, result: Check) -> tuple[nn.Module, torch.dtype, list[Tensor]]:
    """The model on the same weights without rounding, its dtype and its reference gradient:
    float64, or float32 where a kernel has no float64 (grouped_mm, W9's experts)."""
    for wide in (torch.float64, torch.float32):
        exact = copy.deepcopy(pb.model).to(wide)
        try:
            ref_inputs, (ref_targets,) = (
                _widened(pb.ref_inputs, wide),
                _widened((pb.ref_targets,), wide),
            )
            return exact, wide, _ref_grads(exact, pb.loss, ref_inputs, ref_targets)
        except RuntimeError as e:
            result.note = f"the reference in float32: float64 fails ({str(e).splitlines()[0][:80]})"
    raise AssertionError("unreachable: float32 is the model's own")


def _score(pb: Problem, result: Check, engine: Engine, influence: Influence) -> None:
    """Each batch scored by ``engine``, and its errors against the three loops."""
    exact, wide, ref_exact = _exact(pb, result)
    result.reference = str(wide).removeprefix("torch.")
    ref_own = _ref_grads(pb.model, pb.loss, pb.ref_inputs, pb.ref_targets)
    for seed in range(BATCHES):
        inputs, targets = pb.batch(seed) if seed else (pb.inputs, pb.targets)
        norms = total(engine.norms(inputs, targets).norm_sq).sqrt()
        scored = influence(inputs, targets)
        truth = _loop(
            exact, pb.loss, _widened(inputs, wide), *_widened((targets,), wide), ref_exact
        )
        own = _loop(pb.model, pb.loss, inputs, targets, ref_own)
        batched = _loop(pb.model, pb.loss, inputs, targets, ref_own, alone=False)
        for got, want, err in (
            (norms, truth[0], result.norms_err),
            (scored.norm_sq.sqrt(), truth[0], result.norms_err),
            (scored.inner[:, 0], truth[1], result.influence_err),
            (own[0], truth[0], result.loop_norms_err),
            (own[1], truth[1], result.loop_influence_err),
            (norms, batched[0], result.batch_norms_err),
            (scored.norm_sq.sqrt(), batched[0], result.batch_norms_err),
            (scored.inner[:, 0], batched[1], result.batch_influence_err),
        ):
            err.append(_rel_err(got, want))
    findings = engine.record.at(inputs, targets)
    result.analyses, result.replays = findings.analyses, findings.replays


def _count_syncs(pb: Problem, result: Check, engine: Engine, device: torch.device) -> None:
    """The syncs of a replayed norms pass beside a plain forward+backward's, on a batch of the
    scored signature."""
    inputs, targets = pb.batch(BATCHES)
    params, loss_fn = list(_trainable(pb.model).values()), resolve_loss(pb.loss)

    def plain() -> None:
        torch.autograd.grad(loss_fn(pb.model(*inputs), targets).sum(), params)

    plain_sites = _syncs(device, plain)
    ours = _syncs(device, lambda: engine.norms(inputs, targets))
    result.floor_syncs, result.syncs = len(plain_sites), len(ours)
    result.sync_sites = dict(Counter(ours) - Counter(plain_sites))


def _judge(result: Check, floor: float) -> None:
    bad = [
        f"{what} off by {max(err):.1e} (the loop in {result.dtype}: {max(loop):.1e}; "
        f"the batch's loop: {max(batch):.1e})"
        for what, err, loop, batch in (
            ("norms", result.norms_err, result.loop_norms_err, result.batch_norms_err),
            ("influence", result.influence_err, result.loop_influence_err,
             result.batch_influence_err),
        )
        if max(err) > max(TIMES * max(loop), floor) and max(batch) > floor
    ]  # fmt: skip
    if bad:
        result.status, result.note = "wrong", "; ".join([*bad, result.note][: len(bad) + 1])


def check(workload: str, device: torch.device, dtype: torch.dtype) -> Check:
    """One workload in one dtype: three batches through one Engine against the loops, then the
    syncs of a replayed pass (on CUDA)."""
    result = Check(workload, str(dtype).removeprefix("torch."))
    start = time.perf_counter()
    pb: Problem = WORKLOADS[workload].build().to(device, dtype if dtype != torch.float32 else None)
    engine = Engine(pb.model, resolve_loss(pb.loss))
    with engine:
        refs = reference_gradients(engine, [(pb.ref_inputs, pb.ref_targets)])
        _score(pb, result, engine, Influence(engine, refs, "hooks", norms=True))
        if device.type == "cuda":
            _count_syncs(pb, result, engine, device)
    _judge(result, FLOOR[dtype])
    result.seconds = time.perf_counter() - start
    return result


def _row(c: Check) -> str:
    def worst(xs: list[float]) -> str:
        return f"{max(xs):.1e}" if xs else ""

    syncs = "" if c.syncs is None else f"{c.syncs} / {c.floor_syncs}"
    errors = [
        c.norms_err, c.loop_norms_err, c.batch_norms_err,
        c.influence_err, c.loop_influence_err, c.batch_influence_err,
    ]  # fmt: skip
    cells = [c.workload, c.dtype, c.status, *map(worst, errors), f"{c.analyses} / {c.replays}"]
    return "| " + " | ".join([*cells, syncs]) + " |"


def markdown(checks: list[Check]) -> str:
    """One row per workload and dtype: the worst errors over the batches, relative to the
    largest answer: gradscope's against the float64 loop, the loop's own in the dtype, and
    gradscope's against the batch's loop in the dtype."""
    lines = [
        "| workload | dtype | status | norms | loop | vs batch | influence | loop | vs batch "
        "| passes analysed / replayed | syncs (gradscope / plain step) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [_row(c) for c in checks]
    notes = [f"- {c.workload} {c.dtype}: {c.note}" for c in checks if c.note]
    notes += [
        f"- {c.workload} {c.dtype}: syncs beyond the step's at "
        + ", ".join(f"{site} ({n})" for site, n in sorted(c.sync_sites.items()))
        for c in checks
        if c.sync_sites
    ]
    return "\n".join(lines + ([""] + notes if notes else [])) + "\n"


def _environment(device: torch.device) -> dict[str, object]:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "commit": measured_commit(),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--workloads", default="host,tiny,default")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    checks = []
    for name in expand(args.workloads.split(",")):
        if WORKLOADS[name].missing:
            continue
        for dtype in args.dtypes.split(","):
            try:
                checks.append(check(name, device, getattr(torch, dtype)))
            except Exception as e:  # noqa: BLE001 - a failure is a result, the others go on
                note = f"{type(e).__name__}: {e}".splitlines()[0][:300]
                checks.append(Check(name, dtype, "fails", note))
            print(_row(checks[-1]), f"{checks[-1].seconds:.0f} s", checks[-1].note, flush=True)
    print(markdown(checks))
    if args.json:
        report = {"environment": _environment(device), "checks": [asdict(c) for c in checks]}
        args.json.write_text(json.dumps(report, indent=2))
    sys.exit(any(c.status != "ok" for c in checks))


if __name__ == "__main__":
    main()
