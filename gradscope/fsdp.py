"""``distributed.shard: fsdp``: the model sharded with FSDP2 over the torchrun ranks.

A rule reads a call's inputs and output gradient, which FSDP2 leaves whole on each rank, and the
parameters it reads in the backward are the all-gathered ones: ghost norms never need the weight
gradient. What does need a parameter's own gradient is decided before sharding, on the whole
model and the first batch (the same batch on every rank, so the same decisions): the expansion
test, the rows test and the self-check. A parameter they leave to the fallback (torch.func
through the whole model) or to the parameter tap (which watches a whole parameter) cannot be
served sharded: that is an error naming it. From then on every rank runs the same passes, one
forward and one backward per batch, since each forward and backward all-gathers parameters
across the ranks.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .engine import Engine, prepared
from .errors import ConfigError, models_backward
from .rules.base import accumulation_dtype


def blocks(model: nn.Module, classes: Sequence[str] | None = None) -> list[nn.Module]:
    """The modules sharded as units, outermost first: those of the named classes; unset, the
    classes a Hugging Face model lists as ``_no_split_modules`` (its transformer blocks), else
    the items of every ``nn.ModuleList``."""
    names = set(classes or ())
    if classes is None:
        for m in model.modules():
            names |= set(getattr(m, "_no_split_modules", None) or ())
    if names:
        return [m for m in model.modules() if type(m).__name__ in names and m is not model]
    return [c for m in model.modules() if isinstance(m, nn.ModuleList) for c in m]


def shard(model: nn.Module, device: torch.device, classes: Sequence[str] | None = None) -> int:
    """Shard ``model`` in place over every rank with ``fully_shard``, block by block, then the
    rest as the root; parameters move to ``device``. Returns the number of blocks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    units = blocks(model, classes)
    if classes and not units:
        raise ConfigError(
            f"distributed.wrap names no module of the model: {', '.join(classes)}",
            "distributed.wrap",
        )
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for module in reversed(units):  # inner blocks before the blocks holding them
        fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return len(units)


def decide(engine: Engine, inputs: tuple[Tensor, ...], targets: Tensor) -> None:
    """Score one batch on the whole model, keep its decisions for every later batch, and refuse
    the parameters a sharded pass cannot serve."""
    with prepared(engine.model, engine.plan):
        engine.norms(inputs, targets)
    findings = engine.pin_decisions(inputs, targets)
    engine.analysis.sharded = True  # no example runs alone from now on: the ranks' passes
    if not findings.verified:
        raise ConfigError(
            "distributed.shard: fsdp checks the rules on the first batch, whose loss is not "
            "finite; put a batch with a finite loss first",
            "distributed.shard",
        )
    unserved = engine.plan.fallback + engine.plan.raw
    if unserved:
        names = ", ".join(f"{p.name} ({p.rule}: {p.note})" for p in unserved[:3])
        more = f" and {len(unserved) - 3} more" if len(unserved) > 3 else ""
        raise ConfigError(
            f"distributed.shard: fsdp serves only parameters a layer rule serves; {names}{more} "
            "would need the fallback: leave them out with params.exclude, or run unsharded",
            "distributed.shard",
        )


class Gathered(Mapping):
    """Reference directions {name: (1, *shape)} held sharded like their parameters; each read
    gathers that one parameter's whole (every rank reads them in the same order, the
    backward's), so a rank holds one whole direction at a time."""

    def __init__(self, shards: dict[str, Tensor]):
        self.shards = shards

    def __getitem__(self, name: str) -> Tensor:
        t = self.shards[name]
        whole = t.full_tensor() if hasattr(t, "full_tensor") else t
        return whole.unsqueeze(0)

    def __iter__(self) -> Iterator[str]:
        return iter(self.shards)

    def __len__(self) -> int:
        return len(self.shards)


def reference_gradients(
    engine: Engine, batches: Iterable[tuple[tuple[Tensor, ...], Tensor]]
) -> Gathered:
    """The gradient of the MEAN loss over all ``batches``, sharded like the parameters.

    Every rank runs every batch through the sharded model and FSDP2 averages the ranks' equal
    gradients into each rank's shard; each batch's shard is added up in float32 or better. The
    model must be prepared; its ``.grad`` fields are left empty.
    """
    params = {p.name: p.param for p in engine.plan.included}
    sums: dict[str, Tensor] = {}
    count = 0
    for inputs, targets in batches:
        losses = engine.losses(inputs, targets).sum()
        with models_backward():
            losses.backward()
        for name, p in params.items():
            if p.grad is not None:
                g = p.grad.to(accumulation_dtype(p.dtype))
                sums[name] = sums[name] + g if name in sums else g
                p.grad = None
        count += targets.shape[0]
    return Gathered(
        {
            n: sums[n] / count
            if n in sums
            else torch.zeros_like(p, dtype=accumulation_dtype(p.dtype))
            for n, p in params.items()
        }
    )
