"""Reads intercepted where the parameter is read (``replay/intercept.py``): a ViT-like model's
class token and position table at its top level, and ``nn.MultiheadAttention``'s projections,
replay every batch after the first with no torch function mode over their calls, each batch's
norms the float64 loop's; a parameter the model reaches by another way than its modules'
attributes fails the witness, the batch is analysed, and the mode serves its kind after."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from oracle import assert_rel_close, reference_norms
from torch import Tensor, nn

from gradscope.engine import Engine, total
from gradscope.errors import ModelError
from gradscope.losses import resolve_loss

D, CLASSES = 8, 3


class TinyViT(nn.Module):
    """Patches embedded by a Linear, a class token and a position table added at the model's
    top level, an attention block called twice, a head on the class token."""

    def __init__(self, patches: int = 4):
        super().__init__()
        self.embed = nn.Linear(6, D)
        self.cls_token = nn.Parameter(torch.randn(1, 1, D))
        self.pos_embed = nn.Parameter(torch.randn(1, patches + 1, D))
        self.attn = nn.MultiheadAttention(D, 2, batch_first=True)
        self.mlp, self.head = nn.Linear(D, D), nn.Linear(D, CLASSES)

    def forward(self, x: Tensor) -> Tensor:  # (B, patches, 6)
        h = self.embed(x)
        h = torch.cat([self.cls_token.expand(h.shape[0], -1, -1), h], 1) + self.pos_embed
        for _ in range(2):  # the same attention twice: a region call each time
            h = h + self.attn(h, h, h, need_weights=False)[0]
            h = h + torch.tanh(self.mlp(h))
        return self.head(h[:, 0])


class SequenceFirst(nn.Module):
    """``nn.MultiheadAttention`` on (T, B, D), a padding mask as an input."""

    def __init__(self):
        super().__init__()
        self.emb, self.attn = nn.Embedding(11, D), nn.MultiheadAttention(D, 2)
        self.head = nn.Linear(D, CLASSES)

    def forward(self, ids: Tensor, mask: Tensor) -> Tensor:  # (B, T) each
        h = self.emb(ids).transpose(0, 1)  # (T, B, D)
        h = self.attn(h, h, h, key_padding_mask=mask == 0, need_weights=False)[0]
        return self.head(h.mean(0))


class Kept(nn.Module):
    """A raw weight read by ``F.linear`` inside a block through a list the block kept at its
    making: not its attribute, so no ``Read`` stands where it is read."""

    def __init__(self):
        super().__init__()
        self.block = _KeptBlock()
        self.head = nn.Linear(D, CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.block(x).mean(1))


class _KeptBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(D, D) / 3)
        self.kept = [self.w]

    def forward(self, h: Tensor) -> Tensor:
        return F.linear(h, self.kept[0])


def _vit_batches(sizes: list[int], patches: int = 4) -> list:
    return [
        ((torch.randn(b, patches, 6, dtype=torch.float64),), torch.arange(b) % CLASSES)
        for b in sizes
    ]


def _seq_batches(sizes: list[int], tokens: int = 5) -> list:
    out = []
    for k, b in enumerate(sizes):
        ids = torch.randint(0, 11, (b, tokens))
        mask = torch.ones(b, tokens, dtype=torch.long)
        mask[k % b, tokens - 1 - k % 2 :] = 0
        out.append(((ids, mask), torch.arange(b) % CLASSES))
    return out


def _scored(model: nn.Module, batches: list) -> tuple[Engine, list[Tensor]]:
    """Each batch's norms through one Engine, the intercepting regions counted."""
    engine = Engine(model, resolve_loss("cross_entropy"))
    norms = []
    with engine:
        for inputs, targets in batches:
            norms.append(total(engine.norms(inputs, targets).norm_sq).sqrt())
    return engine, norms


@pytest.mark.parametrize(
    ("case", "sizes", "replays"),
    [
        ("vit", [3, 3, 3, 3], 3),
        # batches of one: the class token's gradient is read where its slice of the cat's
        # begins (capture.read_at), so the first batch's program holds the rest
        ("vit", [1, 1, 1, 1], 3),
        ("vit-odd", [5, 5, 5], 2),  # 7 patches
        ("sequence-first", [4, 4, 4], 2),
        ("sequence-first", [1, 1, 1], 2),
    ],
)
def test_later_batches_replay_intercepted_and_exact(case, sizes, replays, intercepted):
    torch.manual_seed(0)
    patches = 7 if case == "vit-odd" else 4
    model = (SequenceFirst() if case == "sequence-first" else TinyViT(patches)).double()
    batches = _seq_batches(sizes) if case == "sequence-first" else _vit_batches(sizes, patches)
    engine, norms = _scored(model, batches)
    findings = engine.record.at(*batches[0])
    assert (findings.replays, findings.analyses) == (replays, len(sizes) - replays)
    calls = {"vit": 3, "vit-odd": 3, "sequence-first": 1}[case]  # the root, the attention twice
    assert all(intercepted) and len(intercepted) >= calls * replays  # a failed replay's too
    assert all(p is model.get_parameter(n) for n, p in model.named_parameters())  # given back
    for (inputs, targets), got in zip(batches, norms, strict=True):
        _, expected = reference_norms(model, inputs, targets, "cross_entropy")
        assert_rel_close(got, expected, 1e-9)


def test_a_read_the_modules_do_not_hold_is_analysed_then_left_to_the_mode():
    """A weight read through a list the block kept: intercepted, the read is not seen, the
    witness fails (fewer reads), the batch is analysed with the loop's numbers; the block's
    class is read under the mode from then on, and replays."""
    torch.manual_seed(0)
    model = Kept().double()
    batches = [((torch.randn(3, 4, D, dtype=torch.float64),), torch.arange(3) % CLASSES)] * 4
    engine, norms = _scored(model, batches)
    findings = engine.record.at(*batches[0])
    assert engine.record.moded == {_KeptBlock}
    assert (findings.replays, findings.analyses) == (2, 2)
    for (inputs, targets), got in zip(batches, norms, strict=True):
        _, expected = reference_norms(model, inputs, targets, "cross_entropy")
        assert_rel_close(got, expected, 1e-9)


def test_a_forward_that_raises_inside_an_intercepted_call_gives_the_parameters_back():
    """A hook of the user's raising inside the attention's call (its Reads held): the model
    holds its own parameters again, and its next batch replays exact."""
    torch.manual_seed(0)
    model = TinyViT().double()
    batches = _vit_batches([3, 3, 3, 3])
    raising = [False]

    def hook(module, args, output):
        if raising[0]:
            raise ValueError("the user's hook")

    model.attn.register_forward_hook(hook)
    engine = Engine(model, resolve_loss("cross_entropy"))
    with engine:
        for k, (inputs, targets) in enumerate(batches):
            raising[0] = k == 2
            if k == 2:
                with pytest.raises(ModelError, match="the user's hook"):
                    engine.norms(inputs, targets)
                assert all(type(p) is nn.Parameter for p in model.parameters())
                continue
            got = total(engine.norms(inputs, targets).norm_sq).sqrt()
            _, expected = reference_norms(model, inputs, targets, "cross_entropy")
            assert_rel_close(got, expected, 1e-9)
    assert engine.record.at(*batches[0]).replays == 2


def test_a_parameter_given_new_data_between_batches_is_read_anew():
    """``p.data = ...`` between batches (the Parameter the same object, its tensor another):
    each batch's norms the loop's at the values it holds then."""
    torch.manual_seed(0)
    model = TinyViT().double()
    engine = Engine(model, resolve_loss("cross_entropy"))
    with engine:
        for k, (inputs, targets) in enumerate(_vit_batches([3, 3, 3, 3])):
            if k >= 2:
                model.pos_embed.data = torch.randn_like(model.pos_embed) * k
                model.attn.in_proj_weight.data = torch.randn_like(model.attn.in_proj_weight)
            got = total(engine.norms(inputs, targets).norm_sq).sqrt()
            _, expected = reference_norms(model, inputs, targets, "cross_entropy")
            assert_rel_close(got, expected, 1e-9)


class _PosBlock(nn.Module):
    def __init__(self, pos: nn.Parameter):
        super().__init__()
        self.fc, self.pos = nn.Linear(D, D), pos

    def forward(self, h: Tensor) -> Tensor:
        return self.fc(h + self.pos)


class SharedTable(nn.Module):
    """One position table held by the model and by a block: read at the top level, inside the
    block's call (a light region), and at the top level again after it."""

    def __init__(self):
        super().__init__()
        self.pos = nn.Parameter(torch.randn(4, D))
        self.fc, self.block, self.head = nn.Linear(D, D), _PosBlock(self.pos), nn.Linear(D, 3)

    def forward(self, x: Tensor) -> Tensor:  # (B, 4, D)
        h = self.block(self.fc(x) + self.pos)
        return self.head((torch.tanh(h) * self.pos).mean(1))


def test_a_table_read_at_the_top_level_and_inside_a_region_replays_exact():
    """The block's region holds the table's Read while it runs and gives it back to the top
    level's after: the top level's read after the block is served, not passed over."""
    torch.manual_seed(0)
    model = SharedTable().double()
    batches = [((torch.randn(3, 4, D, dtype=torch.float64),), torch.arange(3) % 3)] * 4
    engine, norms = _scored(model, batches)
    findings = engine.record.at(*batches[0])
    assert (findings.replays, findings.analyses) == (3, 1), findings.why
    assert not engine.record.moded
    for (inputs, targets), got in zip(batches, norms, strict=True):
        _, expected = reference_norms(model, inputs, targets, "cross_entropy")
        assert_rel_close(got, expected, 1e-9)
