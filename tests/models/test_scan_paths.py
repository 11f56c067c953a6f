"""The paths transformers 5.25 takes through its state-space scans, written in plain torch so that
they are tested with the lock's transformers too: an empty tail split off the sequence, and the
replay of a batch that no rule serves, which runs under ``no_grad``."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from oracle import assert_fallback, assert_rel_close, reference_norms
from torch import Tensor, nn

from gradscope.engine import Engine, Plan, total
from gradscope.losses import resolve_loss

if TYPE_CHECKING:
    from gradscope.engine.record import Findings

B, T, D, OUT = 3, 5, 4, 3


class SplitScan(nn.Module):
    """5.25's ``mamba_scan_forward`` with no cache: ``tensor_split(x, [T], dim=2)`` keeps the
    whole sequence and an empty tail, the scan (here a decayed cumulative sum, the decay
    ``exp(-exp(A_log))`` read outside any module) runs on the first, and ``cat`` joins its one
    output."""

    def __init__(self):
        super().__init__()
        self.in_proj, self.out_proj = nn.Linear(D, D), nn.Linear(D, OUT)
        self.A_log = nn.Parameter(torch.randn(D) * 0.3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.in_proj(x).transpose(1, 2)  # (B, D, T)
        chunk, _ = torch.tensor_split(h, [x.shape[1]], dim=2)  # (B, D, T), (B, D, 0)
        decay = torch.exp(-torch.exp(self.A_log))[None, :, None]  # (1, D, 1)
        scanned = torch.cat([torch.cumsum(chunk * decay, dim=2)], dim=2)  # (B, D, T)
        return self.out_proj(scanned.transpose(1, 2)).mean(1)  # (B, OUT)


class NothingOnRules(nn.Module):
    """A position table added at the model's top level (a read served by recipe over the whole
    forward) and an op the trace cannot follow on sequence-first rows, which takes every
    parameter to the fallback: its program has no read or call a rule serves, so a later batch
    replays it with gradients off, as 5.25's Mamba2, Bamba and Falcon-H1 once did."""

    def __init__(self):
        super().__init__()
        self.pos, self.head = nn.Parameter(torch.randn(T, D)), nn.Linear(D, OUT)

    def forward(self, x: Tensor) -> Tensor:
        h = (x + self.pos).transpose(0, 1)  # (T, B, D)
        return self.head(torch.special.expit(h).transpose(0, 1)).sum(1)  # (B, OUT)


def _three_batches(model: nn.Module) -> tuple[Plan, Findings]:
    """Three batches of one signature through one Engine, each against the float64 loop: the
    plan they leave and the signature's findings."""
    g = torch.Generator().manual_seed(0)
    with Engine(model, resolve_loss("mse")) as engine:
        for _ in range(3):
            x = torch.randn(B, T, D, generator=g, dtype=torch.float64)
            y = torch.randn(B, OUT, generator=g, dtype=torch.float64)
            got = total(engine.norms((x,), y).norm_sq).sqrt()
            assert_rel_close(got, reference_norms(model, (x,), y, "mse")[1], 1e-9)
        findings = engine.record.at((x,), y)
    return engine.plan, findings


def test_an_empty_tail_split_off_the_sequence_keeps_the_rows():
    """The empty part's owners once failed the trace, which took tensor_split's results as
    mixing the examples: every parameter went to the fallback."""
    torch.manual_seed(0)
    plan, findings = _three_batches(SplitScan().double())
    assert_fallback(plan)
    assert findings.replays == 2, findings.why


def test_a_program_no_rule_serves_replays_without_gradients():
    """Its top-level read once asked for the gradient edge of a view made under ``no_grad``,
    and the batch failed as "the model cannot take inputs"."""
    torch.manual_seed(0)
    plan, findings = _three_batches(NothingOnRules().double())
    # the premise: nothing on a rule (an op the trace learns would need another one here)
    assert {p.name for p in plan.fallback} == {"pos", "head.weight", "head.bias"}
    assert findings.replays >= 1, findings.why


def test_a_failure_of_the_replay_sends_the_batch_to_the_analysis(monkeypatch):
    """Whatever raises inside a replayed forward is not blamed on the model: the batch is
    analysed, which runs the same forward and says whose fault it is; the numbers are exact."""
    from gradscope.engine.replay import reads

    def broken(*args, **kwargs):
        raise RuntimeError("a bug of the replay's")

    monkeypatch.setattr(reads.RecipeReads, "_credited", broken)
    torch.manual_seed(0)
    # the scan's decay is a read a recipe credits on every replayed batch (NothingOnRules's
    # table is not: it replays with gradients off, and a read under no_grad is credited to none)
    _, findings = _three_batches(SplitScan().double())  # exact, batch by batch
    assert "a bug of the replay's" in findings.why  # a batch that went back to the analysis
