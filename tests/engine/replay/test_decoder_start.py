"""A decoder input made from the batch as BART's ``shift_tokens_right`` makes it: the ids one
place to the right, written into a tensor of zeros, a start token before them. The write picks
its places by the shapes alone, not by values, and the lookup of the shifted ids (rows partly
of no example: the start token's, taken as the examples') keeps a recipe: the call is a light
region, replayed with no trace, exact against the float64 loop (batches of 1 too), waiting for
the device as often as a plain step. Tiny BART itself, whose encoder also looks its positions
up on rows of no example at all (``test_free_positions.py``), replays every batch, no region
traced."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from oracle import assert_rel_close
from syncs import counted
from torch import Tensor, nn

from gradscope.engine import Engine, Want, naive_grads, total
from gradscope.losses import resolve_loss

VOCAB, T, D, START = 16, 6, 8, 2
LOSS = resolve_loss("cross_entropy")


class Decoder(nn.Module):
    """Looks up its ids shifted right in the encoder's table (BART's shared one), by function:
    a read outside the table's own calls, the tap's."""

    def __init__(self, table: nn.Embedding):
        super().__init__()
        self.table = table

    def forward(self, ids: Tensor) -> Tensor:
        shifted = ids.new_zeros(ids.shape)
        shifted[:, 1:] = ids[:, :-1].clone()
        shifted[:, 0] = START
        return F.embedding(shifted, self.table.weight)


class Shifted(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Embedding(VOCAB, D)
        self.decoder, self.head = Decoder(self.encoder), nn.Linear(D, VOCAB)

    def forward(self, ids: Tensor) -> Tensor:
        context = self.encoder(ids).mean(1, keepdim=True)
        return self.head(torch.tanh(self.decoder(ids) + context))


def _batch(seed: int, n: int = 3) -> tuple[tuple[Tensor, ...], Tensor]:
    ids = torch.randint(3, VOCAB, (n, T), generator=torch.Generator().manual_seed(seed))
    return (ids,), ids


def _check(model: nn.Module, engine: Engine, batch, refs: dict[str, Tensor]) -> None:
    inputs, targets = batch
    scores = engine.scores(inputs, targets, Want(norms=True, refs=refs))
    names = [p.name for p in engine.plan.included]
    _, grads = naive_grads(model, inputs, targets, LOSS, names)
    norms = torch.stack([g.flatten(1).pow(2).sum(1) for g in grads.values()]).sum(0)
    assert_rel_close(total(scores.norm_sq), norms, 1e-9)
    for name, ref in refs.items():
        assert_rel_close(scores.inner[name][:, 0], grads[name].flatten(1) @ ref.flatten(), 1e-9)


def _exact(model: nn.Module, n: int, make=_batch) -> Engine:
    torch.manual_seed(1)
    refs = {name: torch.randn(1, *p.shape, dtype=p.dtype) for name, p in model.named_parameters()}
    with Engine(model, LOSS) as engine:
        for seed in range(3):
            _check(model, engine, make(seed, n), refs)
    return engine


@pytest.mark.parametrize("n", [3, 1])
def test_a_shifted_decoder_input_replays_as_a_light_region(n: int):
    torch.manual_seed(0)
    engine = _exact(Shifted().double().eval(), n)
    findings = engine.record.at(*_batch(0, n))
    assert findings.replays == 2, findings.why
    (program,) = findings.programs
    regions = [s for s in program.steps if hasattr(s, "entry") and hasattr(s, "light")]
    assert regions and all(s.light is not None for s in regions)  # none traced


def test_a_replayed_pass_syncs_no_more_than_a_plain_step():
    torch.manual_seed(0)
    model = Shifted().eval()
    params = list(model.parameters())
    with Engine(model, LOSS) as engine:
        for seed in range(2):
            engine.norms(*_batch(seed))
        inputs, targets = _batch(2)
        with counted() as ours:
            engine.norms(inputs, targets)
        assert engine.record.at(inputs, targets).replays == 2
    with counted() as plain:
        torch.autograd.grad(LOSS(model(*inputs), targets).sum(), params)
    assert sorted(ours) == sorted(plain), (ours, plain)


@pytest.mark.parametrize(("n", "padded"), [(3, False), (1, False), (3, True)])
def test_bart_replays_exact(n: int, padded: bool):
    transformers = pytest.importorskip("transformers")  # noqa: F841 - families builds with it
    import families

    def make(seed: int, n: int) -> tuple[tuple[Tensor, ...], Tensor]:
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(4, 64, (n, 8), generator=g)
        if not padded:
            return (ids,), ids
        mask = families.padding_mask(n, 8, g)
        return (ids * mask + 1 - mask, mask), ids  # pad tokens (1) where the mask is 0

    torch.manual_seed(0)
    model = families.hf_bart(vocab=64, d=16, layers=1, heads=2, seq=8).double().eval()
    engine = _exact(model, n, make)
    findings = engine.record.at(*make(0, n))
    assert findings.replays == 2, findings.why
    (program,) = findings.programs
    assert not program.varies  # every region light: none traced again
