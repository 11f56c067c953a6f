"""Counting host-device synchronisations: calls of the tensor methods and torch functions that
wait for the device (``bool``, ``item``, ``tolist``, ``equal``, ``unique``, ...)."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator

import torch

from gradscope.engine import Engine
from gradscope.losses import resolve_loss

# each waits for the device: to read a value, or to size its output by the values
# (``unique``: GPU runs showed the embedding rule's, one a table and batch)
METHODS = (
    "__bool__", "item", "tolist", "__int__", "__float__", "__index__", "numpy", "nonzero",
    "unique", "unique_consecutive", "masked_select",
)  # fmt: skip
FUNCTIONS = ("equal", "nonzero", "allclose", "unique", "unique_consecutive", "masked_select")


@contextlib.contextmanager
def counted() -> Iterator[list[str]]:
    """Every call of a synchronising tensor method or torch function, by name: once where a
    function mode (the engine's) is handed the replaced method and calls it again."""
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

    try:
        for owner, name, original in saved:
            setattr(owner, name, counting(name, original))
        yield calls
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


def step_and_pass(pb) -> tuple[Counter, Counter, int]:
    """A workload's (``benchmarks/workloads.py`` ``Problem``) synchronising calls in a plain
    training step and in a replayed ``norms`` pass of one Engine on the same batch, after three
    passes on other batches (the analyses, then replays), and how many times that batch's
    shape replayed."""
    model, loss = pb.model, resolve_loss(pb.loss)
    params = [p for p in model.parameters() if p.requires_grad]
    with Engine(model, loss) as engine, counted() as calls:
        for seed in range(3):  # the analyses (W6: padded and not), then replays
            engine.norms(*pb.batch(seed))
        inputs, targets = pb.batch(3)
        calls.clear()
        torch.autograd.grad(loss(model(*inputs), targets).sum(), params)
        plain = Counter(calls)
        calls.clear()
        engine.norms(inputs, targets)
        ours = Counter(calls)
        return plain, ours, engine.record.at(inputs, targets).replays
