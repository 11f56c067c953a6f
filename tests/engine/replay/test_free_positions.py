"""Position tables looked up on B rows wholly of no example, each row taken as its example's (the
rows policy's assumption, which the losses' owners confirm on the analysed batch): BART's
encoder (``arange(T).expand(B, -1)``, in a call of the table's own module on a tensor of the
batch), ProphetNet's (positions from a cumsum of ones, in a call with no tensor argument, then
looked up again outside it, shifted by one, beside a broadcast ngram row) and Whisper's
(``W[position_ids]`` on ``arange(T)`` repeated to the batch). Each read keeps a recipe: every
region is light, and the batches after the first of their shape replay with no trace, exact
against the float64 loop on batches of several shapes, through fresh public calls and one
Engine. ``gain``: beside the lookup, a read of a parameter scaled by a buffer (made with
constants), so that the light region follows constants and sees the positions as made from
them alone: the lookup is still the analysed read, not a tensor computed from the table."""

from __future__ import annotations

import pytest
import torch
from oracle import assert_rel_close, findings_by_shape
from torch import Tensor, nn

import gradscope
from gradscope.engine import Engine, naive_grads, total
from gradscope.engine.steps import RegionCall
from gradscope.losses import resolve_loss

VOCAB, D, LONGEST = 16, 8, 8
LOSS = resolve_loss("cross_entropy")
SHAPES = [(3, 6), (2, 4), (3, 6), (1, 6), (2, 4), (4, 5), (3, 6)]  # (B, T), repeated


class Gained(nn.Module):
    """Holds ``shift``, read as ``shift * gain`` (a buffer): a tensor made with constants."""

    def __init__(self, gain: bool):
        super().__init__()
        self.shift = nn.Parameter(torch.randn(D)) if gain else None
        self.register_buffer("gain", torch.rand(D) + 0.5)

    def gained(self, h: Tensor) -> Tensor:
        return h if self.shift is None else h + self.shift * self.gain


class BartPositions(nn.Embedding):
    """BART's encoder positions: ``arange`` expanded to the batch, offset by 2."""

    def __init__(self, gain: bool):
        super().__init__(LONGEST + 2, D)
        self.extra = Gained(gain)

    def forward(self, x: Tensor) -> Tensor:  # x: (B, T), its values unread
        positions = torch.arange(x.shape[1]).expand(x.shape[0], -1)
        return self.extra.gained(super().forward(positions + 2))


class ProphetPositions(nn.Embedding):
    """ProphetNet's positions: a cumsum of ones, its module called on shapes alone."""

    def __init__(self):
        super().__init__(LONGEST + 2, D, padding_idx=0)

    def forward(self, shape: torch.Size) -> tuple[Tensor, Tensor]:
        mask = torch.ones(shape, dtype=torch.long)
        positions = (torch.cumsum(mask, dim=1) * mask).long().clamp(0, LONGEST)
        return super().forward(positions), positions

    def again(self, positions: Tensor) -> Tensor:
        return super().forward(positions)


class WhisperPositions(nn.Embedding):
    """Whisper's decoder positions: the table indexed by ids, not ``F.embedding``."""

    def __init__(self, gain: bool):
        super().__init__(LONGEST, D)
        self.extra = Gained(gain)

    def forward(self, x: Tensor, position_ids: Tensor) -> Tensor:
        return self.extra.gained(self.weight[position_ids])


class Block(nn.Module):
    """Tokens and positions (of the ``pattern``'s kind), a Linear, a head."""

    def __init__(self, pattern: str, gain: bool):
        super().__init__()
        self.pattern, self.tokens = pattern, nn.Embedding(VOCAB, D)
        if pattern == "bart":
            self.positions = BartPositions(gain)
        elif pattern == "whisper":
            self.positions = WhisperPositions(gain)
        else:
            self.positions, self.ngram = ProphetPositions(), nn.Embedding(2, D)
            self.extra = Gained(gain)
        self.mix, self.head = nn.Linear(D, D), nn.Linear(D, VOCAB)

    def forward(self, ids: Tensor) -> Tensor:
        h = self.tokens(ids)
        if self.pattern == "bart":
            h = h + self.positions(h[:, :, -1])
        elif self.pattern == "whisper":
            b, t = ids.shape
            h = h + self.positions(ids, torch.arange(t).unsqueeze(0).repeat(b, 1))
        else:  # the table read again outside its call, by the positions it returned
            main, positions = self.positions(ids.shape)
            shifted = self.positions.again(positions + 1)
            h = self.extra.gained(h + main + (self.ngram.weight[1] + shifted))
        return self.head(torch.tanh(self.mix(h)))


class Seq2Seq(nn.Module):
    """Two blocks, the second on the first's output added to its own tokens."""

    def __init__(self, pattern: str, gain: bool = False):
        super().__init__()
        self.encoder, self.decoder = Block(pattern, gain), Block(pattern, gain)

    def forward(self, ids: Tensor) -> Tensor:
        return self.decoder(ids) + self.encoder(ids).mean(1, keepdim=True)


def _batch(seed: int, n: int, t: int) -> tuple[tuple[Tensor, ...], Tensor]:
    ids = torch.randint(0, VOCAB, (n, t), generator=torch.Generator().manual_seed(seed))
    return (ids,), ids


def _loop(model: nn.Module, inputs: tuple, targets: Tensor) -> Tensor:
    names = [name for name, _ in model.named_parameters()]
    _, grads = naive_grads(model, inputs, targets, LOSS, names)
    return torch.stack([g.flatten(1).pow(2).sum(1) for g in grads.values()]).sum(0)


PATTERNS = ["bart", "prophetnet", "whisper"]


@pytest.mark.parametrize("gain", [False, True], ids=["plain", "gain"])
@pytest.mark.parametrize("pattern", PATTERNS)
def test_positions_of_no_example_replay_exact(pattern: str, gain: bool):
    torch.manual_seed(0)
    model = Seq2Seq(pattern, gain).double().eval()
    with Engine(model, LOSS) as engine:
        for seed, (n, t) in enumerate(SHAPES):
            inputs, targets = _batch(seed, n, t)
            expected = _loop(model, inputs, targets)
            assert_rel_close(total(engine.norms(inputs, targets).norm_sq), expected, 1e-9)
    for findings in findings_by_shape(engine, _batch, SHAPES).values():
        (program,) = findings.programs
        regions = [s for s in program.steps if isinstance(s, RegionCall)]
        assert regions and all(s.light is not None for s in regions)  # none traced


@pytest.mark.parametrize("pattern", PATTERNS)
def test_positions_of_no_example_through_fresh_calls(pattern: str):
    torch.manual_seed(0)
    model = Seq2Seq(pattern, gain=True).double().eval()
    for seed, (n, t) in enumerate(SHAPES[:4]):
        inputs, targets = _batch(seed, n, t)
        got = gradscope.per_example_norms(model, inputs, targets, "cross_entropy")
        assert_rel_close(got.pow(2), _loop(model, inputs, targets), 1e-9)
