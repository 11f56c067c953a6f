"""A replayed pass's session is freed by reference counting, not left to Python's collector:
its regions' analyses and the root's reads hold its methods, and were they still linked to it
once the pass ends, the cycle would keep each batch's tensors until the collector ran (a watched
training loop's heap grew step after step). A ViT-like model trained under the watch, its later
steps replayed with the collector off."""

from __future__ import annotations

import gc

import torch
from test_intercept import CLASSES, TinyViT

from gradscope.engine import Engine
from gradscope.engine.replay.light import LightRegion
from gradscope.engine.replay.session import ReplaySession
from gradscope.losses import resolve_loss
from gradscope.training.watch import Watch

B, STEPS = 3, 4


def test_no_replayed_steps_session_is_left_to_the_collector(tmp_path):
    torch.manual_seed(0)
    model = TinyViT().double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(STEPS, B, 4, 6, dtype=torch.float64)
    y = torch.arange(B) % CLASSES
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        with Watch(model, tmp_path / "w.parquet") as watch:
            for k in range(STEPS):
                optimizer.zero_grad()
                watch.step(x[k], y, torch.arange(B) + k * B).backward()
                optimizer.step()
            gc.set_debug(gc.DEBUG_SAVEALL)  # what the collector frees, kept to be looked at
            gc.collect()
            # this watch's sessions: an earlier test's objects may die in a cycle meanwhile
            plan = watch.engine.plan
            left = sum(isinstance(o, ReplaySession) and o.plan is plan for o in gc.garbage)
            replays = watch.engine.record.at((x[0],), y).replays
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        if enabled:
            gc.enable()
    assert replays == STEPS - 1  # the first batch analysed, the others replayed
    assert left == 0


def test_no_region_outlives_its_pass_through_the_reads_the_engine_keeps():
    """Each parameter's ``Read`` is kept for the Engine's later batches; between passes it
    points at no region, so it keeps no batch's session or tensors alive."""
    torch.manual_seed(0)
    model = TinyViT().double()
    x = torch.randn(3, B, 4, 6, dtype=torch.float64)
    y = torch.arange(B) % CLASSES
    engine = Engine(model, resolve_loss("cross_entropy"))
    with engine:
        for k in range(3):
            engine.norms((x[k],), y)
        reads = [found[0] for found in engine.replayed.holders.values()]
        assert reads and engine.record.at((x[0],), y).replays == 2
        assert not any(isinstance(read.region, LightRegion) for read in reads)
