"""Counting host-device synchronisations: calls of the tensor methods and torch functions that
wait for the device (``bool``, ``item``, ``tolist``, ``equal``, ``unique``, ...), and the grouped
products whose kernel reads their group offsets on the host (``OFFSETS``)."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gradscope.engine import Engine
from gradscope.engine.replay import programs
from gradscope.losses import resolve_loss
from gradscope.rules import trailing

# each waits for the device: to read a value, or to size its output by the values
# (``unique``: GPU runs showed the embedding rule's, one a table and batch)
METHODS = (
    "__bool__", "item", "tolist", "__int__", "__float__", "__index__", "numpy", "nonzero",
    "unique", "unique_consecutive", "masked_select",
)  # fmt: skip
FUNCTIONS = ("equal", "nonzero", "allclose", "unique", "unique_consecutive", "masked_select")
# ``_grouped_mm`` given offsets (routed experts, HF Mixtral's: its forward, and autograd's input
# and weight gradients): torch's kernel reads the offsets on the host (``offs.cpu()``, then each
# group's product), on CUDA a wait (``rules/routed.py``: in float32), but its bf16 one on sm90/100
OFFSETS = "grouped_mm offsets"


class _Offsets(TorchDispatchMode):
    """Each ``aten._grouped_mm`` given offsets, forward or backward, as one read in ``calls``."""

    def __init__(self, calls: list[str]):
        super().__init__()
        self.calls = calls

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._grouped_mm.default and (
            kwargs.get("offs") is not None or (len(args) > 2 and args[2] is not None)
        ):
            self.calls.append(OFFSETS)
        return func(*args, **kwargs)


@contextlib.contextmanager
def counted(offsets: bool = False) -> Iterator[list[str]]:
    """Every call of a synchronising tensor method or torch function, by name: once where a
    function mode (the engine's) is handed the replaced method and calls it again; with
    ``offsets``, every grouped product that reads its offsets on the host (``OFFSETS``). The
    pass counted is a device's: no rows of zeros cut (``rules/trailing.py``, the CPU's)."""
    calls: list[str] = []
    inside = [False]  # a read a function mode handed back to the method it came through: once
    saved = [(torch.Tensor, name, getattr(torch.Tensor, name)) for name in METHODS]
    saved += [(torch, name, getattr(torch, name)) for name in FUNCTIONS]

    def counting(name, original):
        def call(*args, **kwargs):
            if inside[0]:
                return original(*args, **kwargs)
            calls.append(name)
            inside[0] = True
            try:
                return original(*args, **kwargs)
            finally:
                inside[0] = False

        return call

    free = trailing.FREE
    try:
        trailing.FREE = frozenset()
        for owner, name, original in saved:
            setattr(owner, name, counting(name, original))
        with _Offsets(calls) if offsets else contextlib.nullcontext():
            yield calls
    finally:
        trailing.FREE = free
        for owner, name, original in saved:
            setattr(owner, name, original)


def step_and_pass(pb) -> tuple[Counter, Counter, int, Counter]:
    """A workload's (``benchmarks/workloads.py`` ``Problem``) synchronising calls, its grouped
    products' reads of their offsets among them, in a plain training step and in a replayed
    ``norms`` pass of one Engine on the same batch, after three passes on other batches (the
    analyses, then replays), how many times that batch's shape replayed, and apart from the
    pass's, those of its check of the branches the batch took on its values (each example
    run alone: ``analysis/branches.py``)."""
    model, loss = pb.model, resolve_loss(pb.loss)
    params = [p for p in model.parameters() if p.requires_grad]
    with Engine(model, loss) as engine, counted(offsets=True) as calls:
        for seed in range(3):  # the analyses (W6: padded and not), then replays
            engine.norms(*pb.batch(seed))
        inputs, targets = pb.batch(3)
        calls.clear()
        torch.autograd.grad(loss(model(*inputs), targets).sum(), params)
        plain = Counter(calls)
        calls.clear()
        with _apart(calls) as checked:
            engine.norms(inputs, targets)
        ours = Counter(calls)
        return plain, ours, engine.record.at(inputs, targets).replays, checked


@contextlib.contextmanager
def _apart(calls: list[str]) -> Iterator[Counter]:
    """The calls a replayed pass's check of its branches makes, moved from ``calls``."""
    checked, check = Counter(), programs.check_branches

    def counted_apart(*args, **kwargs):
        before = len(calls)
        try:
            return check(*args, **kwargs)
        finally:
            checked.update(calls[before:])
            del calls[before:]

    programs.check_branches = counted_apart
    try:
        yield checked
    finally:
        programs.check_branches = check
