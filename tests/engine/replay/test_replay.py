"""The replayed pass: later batches of an analysed signature repeat its outcome while the witness
holds, and a batch whose calls, operations or layout differ is analysed in full. Every batch of
every case is checked against the float64 loop, through fresh API calls and through one CLI run;
structure that changes from batch to batch comes from values (routing, masks) or from state the
model keeps between calls."""

from __future__ import annotations

import moe_models
import pytest
import torch
import torch.nn.functional as F
from oracle import (
    assert_influence_through_one_engine,
    assert_rel_close,
    model_state,
    reference_norms,
)
from project import run_cli
from switches import Switched
from torch import Tensor, nn

import gradscope
from gradscope.engine import Engine, total
from gradscope.losses import resolve_loss
from gradscope.predictions import predictions

D, CLASSES, BATCH = 6, 3, 5


class Dense(nn.Module):
    """Embedding, a block called twice, a tied head: every call a rule's, no value read back."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, D)
        self.norm = nn.LayerNorm(D)
        self.fc = nn.Linear(D, D)
        self.head = nn.Linear(D, 11, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: Tensor) -> Tensor:
        h = self.emb(ids)  # (B, T, D)
        h = h + torch.tanh(self.fc(self.norm(h)))
        h = h + torch.tanh(self.fc(h))  # fc called twice
        return self.head(h).mean(1)[:, :CLASSES]


class Sometimes(Switched):
    """A base MLP whose forward differs on the batches where the state it keeps (``odd``, set
    between batches) says so: the witness must see it, as no value of the batch decides it."""

    switches = ("odd",)

    def __init__(self, how: str):
        super().__init__()
        self.how, self.odd = how, False
        self.fc1, self.fc2, self.extra = nn.Linear(D, D), nn.Linear(D, CLASSES), nn.Linear(D, D)
        self.scale = nn.Parameter(torch.randn(D))

    def forward(self, x: Tensor) -> Tensor:
        odd, how = self.odd, self.how
        h = torch.tanh(self.fc1(x))
        if odd and how == "module":  # a module that runs only on some batches
            h = torch.tanh(self.extra(h))
        if odd and how == "raw":  # a parameter read only on some batches
            h = h * self.scale
        if odd and how == "outside":  # a ruled parameter read outside its module
            h = h + F.linear(h, self.extra.weight)
        if odd and how == "flip":  # rows moved across examples, and back after fc2
            return self.fc2(h.flip(0)).flip(0)
        return self.fc2(h)


class ByValue(nn.Module):
    """A module that runs only on the batches whose mean input is positive (each example of a
    batch alike: the data make them so)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.extra = nn.Linear(D, D), nn.Linear(D, CLASSES), nn.Linear(D, D)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.fc1(x))
        if x.mean() > 0:
            h = torch.tanh(self.extra(h))
        return self.fc2(h)


class ThreeWays(ByValue):
    """``ByValue`` with a third way: ``extra`` runs again where the mean input passes 1."""

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.fc1(x))
        if x.mean() > 0:
            h = torch.tanh(self.extra(h))
        if x.mean() > 1:
            h = torch.tanh(self.extra(h))
        return self.fc2(h)


class MaskFirst(Switched):
    """A mask read on the host before anything else, skipped where nothing is padded; counts
    its forwards past that read."""

    switches = ("forwards",)

    def __init__(self):
        super().__init__()
        self.emb, self.head, self.forwards = nn.Embedding(11, D), nn.Linear(D, CLASSES), 0

    def forward(self, ids: Tensor, mask: Tensor) -> Tensor:
        h = self.emb(ids)
        if not bool(mask.all()):
            h = h * mask[..., None]
        self.forwards += 1
        return self.head(h.mean(1))


class Routed(nn.Module):
    """Each example's rows sent to one of two experts by the sign of a router: which rows an
    expert gets depends on the batch's values."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(D, 1)
        self.experts = nn.ModuleList([nn.Linear(D, D), nn.Linear(D, D)])
        self.head = nn.Linear(D, CLASSES)

    def forward(self, x: Tensor) -> Tensor:  # (B, T, D)
        flat = x.reshape(-1, D)
        pick = (self.router(flat)[:, 0] > 0).long()  # (B*T,)
        order = torch.argsort(pick, stable=True)
        rows = flat[order]
        n0 = int((pick == 0).sum())
        out = torch.cat([self.experts[0](rows[:n0]), self.experts[1](rows[n0:])])
        back = torch.empty_like(out).index_copy(0, order, out)
        return self.head(torch.tanh(back.view(x.shape)).mean(1))


class TopLevel(Switched):
    """A class token and position embeddings read at the model's top level, outside every
    module call (a timm ViT's): reads the replay serves by recipe over the whole forward. With
    ``other``, the batches its state marks add another position table instead."""

    switches = ("odd",)

    def __init__(self, other: bool = False):
        super().__init__()
        self.other, self.odd = other, False
        self.proj, self.head = nn.Linear(D, D), nn.Linear(D, CLASSES)
        self.token = nn.Parameter(torch.randn(1, 1, D))
        self.pos, self.pos2 = nn.Parameter(torch.randn(1, 5, D)), nn.Parameter(torch.randn(1, 5, D))

    def forward(self, x: Tensor) -> Tensor:  # (B, 4, D)
        h = self.proj(x)
        h = torch.cat([self.token.expand(h.shape[0], -1, -1), h], 1)
        h = h + (self.pos2 if self.other and self.odd else self.pos)
        return self.head(torch.tanh(h).mean(1))


class TiedTop(nn.Module):
    """An embedding whose table the model's own forward also reads as its head: the top-level
    read is served by recipe, the embedding's own call by its rule."""

    def __init__(self):
        super().__init__()
        self.emb, self.fc = nn.Embedding(11, D), nn.Linear(D, D)

    def forward(self, ids: Tensor) -> Tensor:
        h = torch.tanh(self.fc(self.emb(ids)))
        return F.linear(h, self.emb.weight).mean(1)[:, :CLASSES]


class DualTowers(nn.Module):
    """Two towers and their (B, B) similarity scaled by ``exp(logit_scale)`` in the model's own
    forward (CLIP's), each example's logits from its own diagonal element: the scale's read
    is element by element, served by recipe at the top level."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, D)
        self.logit_scale = nn.Parameter(torch.tensor(0.5))
        self.head = nn.Linear(1, CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        similarity = self.a(x) @ self.b(x).T * self.logit_scale.exp()
        return self.head(similarity.diagonal()[:, None])


class Padded(nn.Module):
    """Attention over padded tokens whose mask is skipped where nothing is padded, as the
    Hugging Face models' fast paths do."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, D)
        self.qkv = nn.Linear(D, 3 * D)
        self.head = nn.Linear(D, CLASSES)

    def forward(self, ids: Tensor, mask: Tensor) -> Tensor:
        q, k, v = self.qkv(self.emb(ids)).chunk(3, -1)  # (B, T, D) each
        scores = q @ k.transpose(1, 2) / D**0.5  # (B, T, T)
        if not bool(mask.all()):
            scores = scores.masked_fill(mask[:, None, :] == 0, float("-inf"))
        return self.head((scores.softmax(-1) @ v).mean(1))


class RoutedBlock(nn.Module):
    """``Routed``'s experts as a block of a larger model: its rows picked by values, its row
    count read on the host, inside a module call a replay follows the rows of (an open routed
    region, its router and experts Linears: ``replay/hooked.py``)."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(D, 1)
        self.experts = nn.ModuleList([nn.Linear(D, D), nn.Linear(D, D)])

    def forward(self, h: Tensor) -> Tensor:  # (B, T, D)
        flat = h.reshape(-1, D)
        pick = (self.router(flat)[:, 0] > 0).long()  # (B*T,)
        order = torch.argsort(pick, stable=True)
        rows = flat[order]
        n0 = int((pick == 0).sum())
        out = torch.cat([self.experts[0](rows[:n0]), self.experts[1](rows[n0:])])
        return torch.empty_like(out).index_copy(0, order, out).view(h.shape)


class ScaledRouter(nn.Module):
    """A router reading its weight scaled (a tensor made from it, as MoE routers read theirs
    cast to float32) and the rows its top score picks: routed, so traced on every batch (a
    routed region makes nothing from parameters)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(2, D))

    def forward(self, h: Tensor) -> Tensor:
        flat = h.reshape(-1, D)
        logits = F.linear(flat, self.weight * 0.5)
        order = torch.argsort(logits.argmax(-1), stable=True)
        picked = flat[order] * logits.softmax(-1)[order, :1]
        return torch.empty_like(picked).index_copy(0, order, picked).view(h.shape)


class TopKMask(nn.Module):
    """Attention over each token's top two keys by score, its mask written by ``scatter`` where
    the batch's values say (DeepSeek's sparse attention): the mask is no example's wherever it
    writes, so no region; it replays. With ``owned`` the scores themselves are written where
    the values say (their owners there would be the number's): a routed region, its Linear
    served on the rows it follows (``replay/hooked.py``)."""

    def __init__(self, owned: bool = False):
        super().__init__()
        self.qk, self.owned = nn.Linear(D, D), owned

    def forward(self, h: Tensor) -> Tensor:
        scores = self.qk(h) @ h.transpose(1, 2)
        top = scores.topk(2, dim=-1).indices
        if self.owned:
            return scores.scatter(-1, top, float("-inf")).softmax(-1) @ h
        mask = torch.full_like(scores, float("-inf")).scatter(-1, top, 0.0)
        return (scores + mask).softmax(-1) @ h


class MaskedBlock(nn.Module):
    """``Padded``'s attention as a block: its mask skipped where nothing is padded."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)

    def forward(self, h: Tensor, mask: Tensor) -> Tensor:
        q, k, v = self.qkv(h).chunk(3, -1)  # (B, T, D) each
        scores = q @ k.transpose(1, 2) / D**0.5  # (B, T, T)
        if not bool(mask.all()):
            scores = scores.masked_fill(mask[:, None, :] == 0, float("-inf"))
        return scores.softmax(-1) @ v


class Lengths(nn.Module):
    """``MaskedBlock`` with learned positions (a read a recipe serves: a light region) checking
    its lengths (``lengths.max().item()``, as XLM does): scalars of the batch's values read on
    the host, the same on every batch here (some example padded, the longest not), which the
    light region's witness compares."""

    def __init__(self):
        super().__init__()
        self.qkv, self.pos = nn.Linear(D, 3 * D), nn.Parameter(torch.randn(4, D) / 3)

    def forward(self, h: Tensor, mask: Tensor) -> Tensor:
        assert mask.sum(1).max().item() <= mask.shape[1]
        q, k, v = self.qkv(h + self.pos).chunk(3, -1)
        scores = q @ k.transpose(1, 2) / D**0.5
        if not bool(mask.all()):
            scores = scores.masked_fill(mask[:, None, :] == 0, float("-inf"))
        return scores.softmax(-1) @ v


class Relative(nn.Module):
    """Relative-position scores as DeBERTa, SEW-D and SAM make them: a table normed once for
    the batch (made from parameters), multiplied by each example's queries with its heads
    broadcast (``q @ rel``), by ``bmm`` against the table repeated over the batch, by
    ``einsum``."""

    def __init__(self):
        super().__init__()
        self.q, self.out = nn.Linear(D, D), nn.Linear(8, D)
        self.table, self.norm = nn.Parameter(torch.randn(4, D) / 3), nn.LayerNorm(D)

    def forward(self, h: Tensor) -> Tensor:
        B, T, _ = h.shape
        q = self.q(h).view(B, T, 2, D // 2).transpose(1, 2)  # (B, heads, T, D / heads)
        rel = self.norm(self.table).view(4, 2, D // 2).permute(1, 2, 0)  # (heads, D / heads, 4)
        by_heads = q @ rel
        by_rows = torch.bmm(q.reshape(B * 2, T, D // 2), rel.repeat(B, 1, 1)).view(B, 2, T, 4)
        by_letters = torch.einsum("bhtd,hdr->bhtr", q, rel)
        scores = (by_heads + by_rows * by_letters).softmax(-1)
        return h + self.out(scores.transpose(1, 2).reshape(B, T, 8))


class PositionBlock(nn.Module):
    """Learned positions and a LayerScale gain, raw parameters the tap serves, in a block."""

    def __init__(self):
        super().__init__()
        self.pos = nn.Parameter(torch.randn(4, D))
        self.gamma = nn.Parameter(torch.linspace(0.5, 1.5, D))
        self.fc = nn.Linear(D, D)

    def forward(self, h: Tensor) -> Tensor:
        return h + self.gamma * self.fc(h + self.pos)


class AttentionBlock(nn.Module):
    """``nn.MultiheadAttention`` over padded tokens, its padding mask an input whose values
    differ batch to batch: its projections read inside ``F.multi_head_attention_forward`` on
    sequence-first rows (a light region, ``replay/light.py``)."""

    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(D, 2, batch_first=True)

    def forward(self, h: Tensor, mask: Tensor) -> Tensor:
        return self.attn(h, h, h, key_padding_mask=mask == 0, need_weights=False)[0]


class Reader(Switched):
    """Raw weights read by ``F.linear`` (a light region), which one, and whether an op comes
    first, or a Linear (a module with a rule) called first, by the state it keeps (``how`` says
    which): a later batch reads otherwise. With ``cast`` the weight is cast to the dtype it has
    (itself: still light), with ``copy`` to float32 and back (a tensor made from the weight:
    light, its gradient carried back through the casts); with ``view`` the weight's transpose
    and a Linear's bias doubled, outside its call (tensors made from parameters: light); with
    ``left`` the weight on the left of the tokens, ``W @ x`` (Mamba's ``dt_proj``: light);
    with ``tied`` the Linear's own weight is read again after its call (light, its call a step,
    the read inside the call its rule's)."""

    switches = ("odd",)

    def __init__(self, how: str = "read"):
        super().__init__()
        self.how, self.odd = how, False
        self.w1, self.w2 = nn.Parameter(torch.randn(D, D)), nn.Parameter(torch.randn(D, D))
        self.fc = nn.Linear(D, D)

    def forward(self, h: Tensor) -> Tensor:
        odd = self.odd
        if odd and self.how == "op":
            h = h * 2
        if odd and self.how == "call":
            h = self.fc(h)
        w = self.w2 if odd and self.how == "read" else self.w1
        if self.how == "tied":
            h, w = self.fc(h), self.fc.weight
        if self.how == "view":
            return F.linear(h, self.w1.T, self.fc.bias * 2)
        if self.how == "left":
            return (self.w1 @ h.transpose(1, 2)).transpose(1, 2)
        if self.how == "cast":
            w = w.to(h.dtype)
        if self.how == "copy":
            w = w.float().to(h.dtype)
        return F.linear(h, w)


class ScaleBlock(nn.Module):
    """A scale and a shift, each a parameter broadcast along the tokens (MobileBERT's NoNorm,
    a LayerScale), and a token prepended by ``expand`` (a ViT's class token): a light region
    of broadcast reads."""

    def __init__(self):
        super().__init__()
        self.gamma, self.beta = nn.Parameter(torch.randn(D)), nn.Parameter(torch.randn(D))
        self.token = nn.Parameter(torch.randn(1, 1, D))

    def forward(self, h: Tensor) -> Tensor:
        h = h * self.gamma + self.beta
        return torch.cat([self.token.expand(h.shape[0], -1, -1), h], 1)


class Computing(Switched):
    """Tensors made from parameters, numbers and buffers alone, read where the batch is: a
    gain ``exp(a)`` (DiffLlama's, XIELU's), a table gathered by an index buffer and joined
    again from its slices (Swin's relative positions, a ViT's resized positions), with a Linear
    called between (a light region). With ``odd`` a later batch's gain is ``exp(b)`` (another
    read); with ``arange`` the table is gathered by a fresh ``arange`` (a constant too: light);
    with ``attr`` by a tensor the module keeps but not as a buffer, which a light region cannot
    tell from the batch's (a region traced again); with ``mask`` the gathered table is an
    attention mask (Swin's relative position bias), added to the scores."""

    switches = ("odd",)

    def __init__(self, how: str = "computed"):
        super().__init__()
        self.how, self.odd = how, False
        self.a, self.b = nn.Parameter(torch.randn(D) / 4), nn.Parameter(torch.randn(D) / 4)
        self.table = nn.Parameter(torch.randn(7, D))
        self.register_buffer("index", torch.tensor([3, 1, 4, 6]))
        self.kept = torch.tensor([3, 1, 4, 6])  # not a buffer
        self.fc = nn.Linear(D, D)

    def forward(self, h: Tensor, index: Tensor | None = None) -> Tensor:
        gain = (self.b if self.odd and self.how == "computed-odd" else self.a).exp()
        if index is None:
            index = {"computed-arange": torch.arange(4) + 2, "computed-attr": self.kept}
            index = index.get(self.how, self.index)
        pos = self.table.index_select(0, index)
        pos = torch.cat([pos[:1], pos[1:] * 2], 0)
        if self.how == "computed-mask":
            q = self.fc(h).unsqueeze(1)
            return F.scaled_dot_product_attention(q, q, h.unsqueeze(1), pos[:, :4]).squeeze(1)
        return self.fc(h * gain) + pos


class Passing(nn.Module):
    """A ``Computing`` block given its index, an ``arange`` made outside it: the region (the
    inner block) begins on a constant."""

    def __init__(self):
        super().__init__()
        self.inner = Computing()

    def forward(self, h: Tensor) -> Tensor:
        return self.inner(h, torch.arange(4) + 2)


class Windows(nn.Module):
    """Tokens folded into the batch by windows of two (Swin's), each window's scores scaled by
    a tensor made from a parameter: a broadcast on rows that are lanes of the examples (each
    example's windows together), light."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(2, D) / 4)
        self.fc = nn.Linear(D, D)

    def forward(self, h: Tensor) -> Tensor:
        return self.fc(h.reshape(-1, 2, D) * self.scale.exp()).reshape(h.shape)


class PositionTable(nn.Embedding):
    """LED's and PLBart's learned positions: an ``Embedding`` called on a shape, which looks
    itself up by an ``arange`` it makes."""

    def forward(self, shape: torch.Size) -> Tensor:
        return super().forward(torch.arange(shape[1]).unsqueeze(0))


class Positions(nn.Module):
    """A ``PositionTable`` added to the tokens: its lookup, of positions no example owns, is
    the tap's, expanded to the batch, and a light region's read again."""

    def __init__(self):
        super().__init__()
        self.table, self.fc = PositionTable(4, D), nn.Linear(D, D)

    def forward(self, h: Tensor) -> Tensor:
        return self.fc(h) + self.table(h.shape)


class ConvBlock(nn.Module):
    """Convolutions of a weight-norm weight (wav2vec2's positional convolution: a tensor made
    from two parameters) and of a raw weight with a bias made from a parameter by
    ``F.conv1d``: a light region, its ``ParametrizedConv1d`` a step."""

    def __init__(self):
        super().__init__()
        self.conv = nn.utils.parametrizations.weight_norm(nn.Conv1d(D, D, 3, padding=1), dim=2)
        self.w, self.b = nn.Parameter(torch.randn(D, D, 1) / 3), nn.Parameter(torch.randn(D))

    def forward(self, h: Tensor) -> Tensor:
        return F.conv1d(self.conv(h.transpose(1, 2)), self.w, self.b.exp()).transpose(1, 2)


class InBlock(nn.Module):
    """A projection, a block whose forward needs analysis on every batch, a head."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.proj, self.block, self.head = nn.Linear(D, D), block, nn.Linear(D, CLASSES)

    def forward(self, x: Tensor, *rest: Tensor) -> Tensor:
        h = self.block(torch.tanh(self.proj(x)), *rest)
        return self.head(torch.tanh(h).mean(1))


BLOCKS = {
    "routed-block": RoutedBlock,
    "router-block": ScaledRouter,
    "sparse-block": TopKMask,
    "sparse-owned": lambda: TopKMask(owned=True),
    "masked-block": MaskedBlock,
    "lengths-block": Lengths,
    "relative-block": Relative,
    "position-block": PositionBlock,
    "attention-block": AttentionBlock,
    "read-block": Reader,
    "op-block": lambda: Reader("op"),
    "call-block": lambda: Reader("call"),
    "cast-block": lambda: Reader("cast"),
    "scale-block": ScaleBlock,
    # eager experts: which run, and so how many reads, the routing says (an open routed region)
    "experts-block": lambda: moe_models.Block(moe_models.LoopExperts(width=D)),
    # ... as GPT-OSS and the privacy filter write them: x @ W[e] + b[e], in float32
    "experts-oss-block": lambda: moe_models.Block(
        moe_models.LoopExperts(width=D, transposed=True, biased=True, cast=True)
    ),
    "copy-block": lambda: Reader("copy"),
    "tied-block": lambda: Reader("tied"),
    "view-block": lambda: Reader("view"),
    "left-block": lambda: Reader("left"),
    "computed-block": Computing,
    "computed-odd": lambda: Computing("computed-odd"),
    "computed-arange": lambda: Computing("computed-arange"),
    "computed-attr": lambda: Computing("computed-attr"),
    "computed-passed": Passing,
    "computed-mask": lambda: Computing("computed-mask"),
    "conv-block": ConvBlock,
    "window-block": Windows,
    "positions-block": Positions,
}


# the mean input of each batch of "three-ways", so its ways are 0 1 0 1 1 2 1 0
THREE_WAYS = [-1.0, 0.5, -1.0, 0.5, 0.5, 2.0, 0.5, -1.0]


def _batches(model: str, n: int = 3) -> list[tuple[tuple[Tensor, ...], Tensor]]:
    """n batches of one signature with other values ("three-ways": one per THREE_WAYS)."""
    if model == "three-ways":
        out = []
        for seed, mean in enumerate(THREE_WAYS):
            g = torch.Generator().manual_seed(seed)
            x = mean + 0.05 * torch.randn(BATCH, D, generator=g, dtype=torch.float64)
            out.append(((x,), torch.randint(0, CLASSES, (BATCH,), generator=g)))
        return out
    out = []
    for seed in range(n):
        g = torch.Generator().manual_seed(seed)
        y = torch.randint(0, CLASSES, (BATCH,), generator=g)
        if model in ("dense", "padded", "top-tied"):
            ids = torch.randint(0, 11, (BATCH, 4), generator=g)
            if model in ("dense", "top-tied"):
                out.append(((ids,), y))
                continue
            mask = torch.ones(BATCH, 4, dtype=torch.long)
            if seed % 2:  # every other batch padded
                mask[1, 2:] = 0
            out.append(((ids, mask), y))
            continue
        rows = model in ("routed", "top", "top-other") or model in BLOCKS
        shape = (BATCH, 4, D) if rows else (BATCH, D)
        x = torch.randn(*shape, generator=g, dtype=torch.float64)
        if model == "masked-block":
            mask = torch.ones(BATCH, 4, dtype=torch.long)
            mask[1, 2:] = 0 if seed % 2 else 1  # every other batch padded
            out.append(((x, mask), y))
            continue
        if model in ("attention-block", "lengths-block"):  # others padded, by other lengths
            mask = torch.ones(BATCH, 4, dtype=torch.long)
            mask[seed % BATCH, 1 + seed % 3 :] = 0
            out.append(((x, mask), y))
            continue
        if model == "value":  # all positive on every other batch: each example alike
            x = (x.abs() + 1) * (1 if seed % 2 else -1)
        out.append(((x,), y))
    return out


def _build(model: str) -> nn.Module:
    torch.manual_seed(0)
    built = {"dense": Dense, "routed": Routed, "padded": Padded, "value": ByValue}
    built |= {"top": TopLevel, "top-other": lambda: TopLevel(other=True), "top-tied": TiedTop}
    built |= {"dual": DualTowers, "three-ways": ThreeWays}
    if model in BLOCKS:
        return InBlock(BLOCKS[model]()).double()
    return (built[model]() if model in built else Sometimes(model)).double()


# where the model computes in float32 inside a float64 model, its own batched and per-example
# roundings differ at float32's precision: the loop's answer is no closer than that
TOLERANCE = {"experts-oss-block": 1e-6}
CASES = ["dense", "module", "raw", "outside", "flip", "value", "routed", "padded", "top"]
CASES += ["top-other", "top-tied", "dual", "three-ways", *BLOCKS]


def _set_state(model: nn.Module, k: int) -> None:
    if isinstance(model, Sometimes):
        model.odd = k % 2 == 0  # the first batch analysed odd, the second even, ...
    if isinstance(model, InBlock) and isinstance(model.block, (Reader, Computing)):
        model.block.odd = k % 2 == 1  # the first batch analysed as usual, the second not
    if isinstance(model, TopLevel):
        model.odd = k % 2 == 1


@pytest.mark.parametrize("case", CASES)
def test_every_batch_of_one_signature_is_exact_through_fresh_api_calls(case: str):
    model = _build(case)
    for k, (inputs, targets) in enumerate(_batches(case)):
        _set_state(model, k)
        before = model_state(model)
        norms = gradscope.per_example_norms(model, inputs, targets, loss="cross_entropy")
        before.assert_kept(model)
        _, expected = reference_norms(model, inputs, targets, "cross_entropy")
        assert_rel_close(norms, expected, TOLERANCE.get(case, 1e-9))


@pytest.mark.parametrize(
    ("case", "replays"),
    [
        ("dense", 2),
        ("module", 1),
        ("raw", 1),
        ("outside", 1),
        ("flip", 1),
        ("value", 1),  # the values read on the host differ on batch 2; batch 3 is batch 1's
        ("routed", 0),
        ("padded", 1),
        ("top", 2),
        ("top-other", 1),
        ("top-tied", 2),
        ("dual", 2),
        ("routed-block", 2),
        ("router-block", 2),
        ("sparse-block", 2),
        ("sparse-owned", 2),
        ("masked-block", 1),  # padded on batch 2 alone: a program of its own
        ("lengths-block", 2),
        ("relative-block", 2),
        ("position-block", 2),
        ("attention-block", 2),
        ("read-block", 1),
        ("op-block", 1),
        ("call-block", 1),  # each batch's program, light, its Linear a step, fails the next
        ("cast-block", 2),
        ("scale-block", 2),
        ("experts-block", 2),
        ("experts-oss-block", 2),
        ("copy-block", 2),
        ("tied-block", 2),
        ("view-block", 2),
        ("left-block", 2),
        ("computed-block", 2),
        ("computed-odd", 1),
        ("computed-arange", 2),
        ("computed-attr", 2),
        ("computed-passed", 2),
        ("computed-mask", 2),
        ("conv-block", 2),
        ("window-block", 2),
        ("positions-block", 2),
    ],  # fmt: skip
)
def test_replays_where_the_witness_holds_and_not_elsewhere(case: str, replays: int):
    """Of three batches, the first is analysed; the later ones replay where nothing differs,
    and are analysed where the model's structure differs from every analysed batch's (each
    witness failed) or may depend on the batch's values (no program). The cases whose
    structure alternates replay batch 3 by batch 1's program."""
    model = _build(case)
    engine = Engine(model, resolve_loss("cross_entropy"))
    batches = _batches(case)
    with engine:
        for k, (inputs, targets) in enumerate(batches):
            _set_state(model, k)
            engine.norms(inputs, targets)
    findings = engine.record.at(*batches[0])
    assert (findings.replays, findings.analyses) == (replays, 3 - replays)
    if case == "routed":  # the batch's values pick rows in the model's own forward
        assert not findings.programs  # no region can hold it
    if case in ("value", "padded"):  # values read on the host: witnessed
        assert findings.programs[0].hosts  # outside every region, at the model's level
    if case == "lengths-block":  # ... inside a light region: by it
        (call,) = [s for s in findings.programs[-1].steps if hasattr(s, "hosts")]
        assert len(call.hosts) == 2 and not findings.programs[-1].hosts
    if case in ("value", "padded", "masked-block"):  # where they differed, a program of its own
        assert len(findings.programs) == 2 and all(p.hosts for p in findings.programs)
        assert engine.record.branchings == 1 and not engine.record.branches
    if replays < 2:
        assert findings.why is not None  # a program whose witness failed
    if case.startswith("top") or case == "dual":  # the top-level reads, by recipe
        assert len(findings.programs[-1].root) == (1 if case in ("top-tied", "dual") else 2)
    if case in BLOCKS:  # the block is the region, analysed again on every batch
        inner = {"attention-block": "attn", "computed-passed": "inner"}
        inner |= dict.fromkeys(("experts-block", "experts-oss-block"), "experts")
        inner["positions-block"] = "table"
        region = getattr(model.block, inner[case]) if case in inner else model.block
        inside = {id(model.block.conv)} if case == "conv-block" else set()  # a region in it
        expected = set() if case in ("sparse-block", "masked-block") else {id(region)} | inside
        assert findings.programs[-1].regions == expected
    # a region reading whole parameters on rows laid out by shapes alone replays light
    steps = findings.programs[-1].steps if findings.programs else ()
    light = [s.light is not None for s in steps if hasattr(s, "light")]
    lights = ("attention-block", "read-block", "op-block", "cast-block", "scale-block")
    lights += ("experts-block", "experts-oss-block", "position-block", "call-block")
    lights += ("tied-block",)  # with steps
    lights += ("routed-block", "sparse-owned")  # routed, their Linears inside them
    lights += ("computed-block", "computed-odd", "computed-mask", "computed-arange")
    lights += ("conv-block", "computed-passed", "copy-block", "view-block", "left-block")
    lights += ("window-block", "positions-block", "relative-block", "lengths-block")
    assert light == [case in lights] * len(light)
    if case in ("read-block", "op-block", "call-block", "computed-odd"):  # its witness failed
        assert any(w in findings.why for w in ("read", "operations", "call")), findings.why


def test_each_way_a_model_takes_replays_its_own_program():
    """Batches whose values, read on the host, send the forward two ways replay the program of
    their own way, the one that held last tried first; a third way makes such reads escapes
    from then on (the batch analysed in full: at the model's level only the model's own call,
    traced on every batch, holds them), and the programs kept replay their ways still. Every
    batch exact against the loop."""
    model = _build("three-ways")
    engine = Engine(model, resolve_loss("cross_entropy"))
    replayed = []
    with engine:
        for seed, (x, y) in enumerate(_batches("three-ways")):
            findings = engine.record.at(x, y)
            before = findings.replays
            norms = total(engine.norms(x, y).norm_sq).sqrt()
            replayed.append(findings.replays - before)
            assert_rel_close(norms, reference_norms(model, x, y, "cross_entropy")[1], 1e-9)
            assert engine.record.branches == (seed >= 5)
    assert replayed == [0, 0, 1, 1, 1, 0, 1, 1]
    assert [p.regions for p in findings.programs].count(frozenset({id(model)})) == 1
    assert len(findings.programs) == 3


def test_a_program_whose_host_read_differs_stops_there():
    """Batches padded and not in turn: each tries the other way's program first (the one that
    held last), whose witness fails at the mask's read, before the rest of the forward runs.
    On a padded batch the examples with nothing padded take the other way alone: they are
    run whole too, together, as a batch of their own that reads what each reads alone
    (``analysis/branches.py``), and give their losses in the batch."""
    torch.manual_seed(0)
    model = MaskFirst().double()
    engine = Engine(model, resolve_loss("cross_entropy"))
    with engine:
        for k in range(6):
            g = torch.Generator().manual_seed(k)
            mask = torch.ones(BATCH, 4, dtype=torch.long)
            mask[0, 2:] = k % 2
            ids, y = torch.randint(0, 11, (BATCH, 4), generator=g), torch.randint(0, 3, (BATCH,))
            before = model.forwards
            engine.norms((ids, mask), y)
            findings = engine.record.at((ids, mask), y)
            if k >= 2:  # replayed by the second program tried, the first stopped at the read
                together = 0 if k % 2 else 1
                assert (model.forwards - before, findings.replays) == (1 + together, k - 1)


@pytest.mark.parametrize(
    "case", ["dense", "value", "routed", "padded", "top", "dual", "three-ways", *BLOCKS]
)
def test_every_batch_of_one_cli_run_is_exact(tmp_path, case: str):
    """Three batches of one signature in one run: replayed, or analysed where values decide."""
    model = _build(case)
    batches = _batches(case)
    columns = {"padded": ["ids", "mask"], "dense": ["ids"], "masked-block": ["x", "mask"]}
    columns["attention-block"] = columns["lengths-block"] = ["x", "mask"]
    columns = columns.get(case, ["x"])
    data = {c: torch.cat([b[0][k] for b in batches]) for k, c in enumerate(columns)}
    data["y"] = torch.cat([b[1] for b in batches])
    torch.save(data, tmp_path / "data.pt")
    torch.save(model.state_dict(), tmp_path / "model.pt")
    (tmp_path / "models.py").write_text(
        f"from test_replay import _build\n\ndef make():\n    return _build({case!r})\n"
    )
    scores = run_cli(
        tmp_path,
        {"factory": "models.py:make", "checkpoint": "model.pt"},
        {"path": "data.pt", "inputs": columns, "targets": "y", "batch_size": BATCH},
        "cross_entropy",
    )
    for k, (inputs, targets) in enumerate(batches):
        _, expected = reference_norms(model, inputs, targets, "cross_entropy")
        got = torch.tensor(scores["grad_norm"].to_numpy()[k * BATCH : (k + 1) * BATCH])
        assert_rel_close(got, expected, TOLERANCE.get(case, 1e-9))


# light regions with a hooked call, or reads of tensors made from parameters, inside them
RECIPE_CASES = ["position-block", "tied-block", "computed-block", "computed-mask"]
RECIPE_CASES += ["computed-passed", "conv-block", "view-block", "left-block", "scale-block"]
RECIPE_CASES += ["window-block", "dual", "positions-block", "lengths-block", "relative-block"]


@pytest.mark.parametrize("case", RECIPE_CASES)
def test_replayed_influence_is_exact(case: str):
    """Inner products with a reference gradient on every batch of one Engine, the later ones
    replayed by recipe, against the float64 loop."""
    batches = _batches(case)
    engine = assert_influence_through_one_engine(_build(case), batches, "cross_entropy")
    assert engine.record.at(*batches[0]).replays == 2


def test_the_predictions_read_for_the_report_leave_the_program_to_replay():
    """A classifier scored as a run scores it, its predictions (pred, prob, margin: a scatter
    over the classes) read off the output: those ops are the report's, not the model's, so
    the later batches replay, exact."""
    model, batches = _build("dense"), _batches("dense")
    engine = Engine(model, resolve_loss("cross_entropy"), observe=predictions("cross_entropy"))
    with engine:
        for inputs, targets in batches:
            norms = total(engine.norms(inputs, targets).norm_sq).sqrt()
            expected = reference_norms(model, inputs, targets, "cross_entropy")[1]
            assert_rel_close(norms, expected, 1e-9)
    findings = engine.record.at(*batches[0])
    assert (findings.analyses, findings.replays) == (1, 2), findings.why
