"""The workloads bench.py times: a model in eval mode, a batch, an 8-example reference batch, a loss.

W1-W10 are the default set; ``tiny`` (T1-T4) are small models at small batches, where each call's
Python cost is most of its time; ``host`` (H1-H4) the op graphs of Hugging Face GPT-2, LLaMA,
BERT and Mixtral at width 64, where a pass is the host's work, as it is on a GPU at small
widths; ``smoke`` is the smoke test's, seconds in all.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import families
import torch
from torch import Tensor, nn

# ---------------------------------------------------------------- models


class CNN(nn.Sequential):
    """The network of PyTorch's per-sample-gradients tutorial, with its dropout."""

    def __init__(self) -> None:
        super().__init__(
            nn.Conv2d(1, 32, 3, 1),
            nn.ReLU(),
            nn.Conv2d(32, 64, 3, 1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Dropout(0.25),
            nn.Flatten(),
            nn.Linear(9216, 128),
            nn.ReLU(),
            nn.Linear(128, 10),
        )


class SmallCNN(nn.Sequential):
    """Two 3x3 convolutions with pooling over 3x16x16 images, then a linear head."""

    def __init__(self) -> None:
        super().__init__(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(16 * 4 * 4, 10),
        )


class Classifier(nn.Module):
    """Transformer encoder over tokens, mean-pooled, then a linear head."""

    def __init__(
        self, vocab: int, seq: int, d: int, heads: int, ff: int, layers: int, classes: int
    ):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        layer = nn.TransformerEncoderLayer(d, heads, ff, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, classes)

    def forward(self, ids: Tensor) -> Tensor:
        b, t = ids.shape
        # contiguous position ids: Opacus' ghost embedding norm calls .view() on them
        pos = torch.arange(t, device=ids.device).repeat(b, 1)  # (B, T)
        h = self.encoder(self.tok(ids) + self.pos(pos))  # (B, T, d)
        return self.head(h.mean(1))  # (B, classes)


class CausalLM(nn.Module):
    """Pre-norm causal transformer whose output projection is the token embedding (tied)."""

    def __init__(self, vocab: int, seq: int, d: int, heads: int, ff: int, layers: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        layer = nn.TransformerEncoderLayer(
            d, heads, ff, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.tok.weight
        # GPT-2's 0.02, not Embedding's N(0, 1): tied to the output, N(0, 1) gives logits of
        # scale sqrt(d), softmax probabilities that underflow to denormals, and matmuls on those
        # run 50x slower on x86, which would time the CPU's denormal path, not the methods
        for table in (self.tok, self.pos):
            nn.init.normal_(table.weight, std=0.02)

    def forward(self, ids: Tensor) -> Tensor:
        b, t = ids.shape
        pos = torch.arange(t, device=ids.device).repeat(b, 1)  # (B, T)
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=ids.device)
        h = self.blocks(self.tok(ids) + self.pos(pos), mask=mask, is_causal=True)  # (B, T, d)
        return self.lm_head(self.norm(h))  # (B, T, vocab)


# ---------------------------------------------------------------- problems


@dataclass
class Problem:
    """One workload, built: a model in eval mode, a batch, an 8-example reference batch, the loss
    name, and ``make``, which draws another batch of ``size`` examples of the same shapes."""

    model: nn.Module
    inputs: tuple[Tensor, ...]
    targets: Tensor
    ref_inputs: tuple[Tensor, ...]
    ref_targets: Tensor
    loss: str
    make: Callable[[int], tuple[Inputs, Tensor]] | None = None
    device: torch.device = torch.device("cpu")
    dtype: torch.dtype | None = None  # None: as built (float32)

    def to(self, device: torch.device, dtype: torch.dtype | None = None) -> Problem:
        """The problem on ``device``, its model's floating-point parameters and buffers and the
        floating-point tensors of its batches in ``dtype`` (None: as they are)."""
        model = self.model.to(device=device, dtype=dtype) if dtype else self.model.to(device)
        return Problem(
            model,
            self._moved(self.inputs, device, dtype),
            self._moved((self.targets,), device, dtype)[0],
            self._moved(self.ref_inputs, device, dtype),
            self._moved((self.ref_targets,), device, dtype)[0],
            self.loss,
            self.make,
            torch.device(device),
            dtype,
        )

    def batch(self, seed: int) -> tuple[tuple[Tensor, ...], Tensor]:
        """Another batch of the same shapes as ``inputs`` and ``targets``, drawn with ``seed``,
        on the problem's device and in its dtype."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            x, y = self.make(self.targets.shape[0])
        x = x if isinstance(x, tuple) else (x,)
        (y,) = self._moved((y,), self.device, self.dtype)
        return self._moved(x, self.device, self.dtype), y

    @staticmethod
    def _moved(
        ts: tuple[Tensor, ...], device: torch.device, dtype: torch.dtype | None
    ) -> tuple[Tensor, ...]:
        return tuple(
            t.to(device, dtype) if dtype and t.is_floating_point() else t.to(device) for t in ts
        )


Inputs = Tensor | tuple[Tensor, ...]


def _problem(model: nn.Module, make: Callable[[int], tuple[Inputs, Tensor]], batch: int, loss: str):
    """Model in eval mode (as gradscope scores), a batch and an 8-example reference batch."""
    (x, y), (rx, ry) = make(batch), make(8)
    x, rx = (x, rx) if isinstance(x, tuple) else ((x,), (rx,))
    return Problem(model.eval(), x, y, rx, ry, loss, make)


def _mlp(sizes: Sequence[int], batch: int) -> Problem:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        layers += [nn.Linear(a, b)] + ([nn.ReLU()] if i < len(sizes) - 2 else [])
    return _problem(
        nn.Sequential(*layers),
        lambda n: (torch.randn(n, sizes[0]), torch.randn(n)),
        batch,
        "mse",
    )


def _images(model: Callable[[], nn.Module], shape: Sequence[int], batch: int) -> Problem:
    """An image classifier over 10 classes on random images of ``shape`` (C, H, W)."""
    torch.manual_seed(0)
    return _problem(
        model(),
        lambda n: (torch.randn(n, *shape), torch.randint(0, 10, (n,))),
        batch,
        "cross_entropy",
    )


def _classifier(vocab: int, seq: int, d: int, heads: int, batch: int) -> Problem:
    """``Classifier`` with 2 layers, ff 4d and 10 classes on random tokens."""
    torch.manual_seed(0)
    model = Classifier(vocab=vocab, seq=seq, d=d, heads=heads, ff=4 * d, layers=2, classes=10)
    return _problem(
        model,
        lambda n: (torch.randint(0, vocab, (n, seq)), torch.randint(0, 10, (n,))),
        batch,
        "cross_entropy",
    )


def _lm(vocab: int, seq: int, d: int, heads: int, batch: int) -> Problem:
    """``CausalLM`` with 2 layers and ff 4d, per-token cross entropy on the next tokens."""
    torch.manual_seed(0)
    model = CausalLM(vocab=vocab, seq=seq, d=d, heads=heads, ff=4 * d, layers=2)

    def make(n: int) -> tuple[Tensor, Tensor]:
        ids = torch.randint(0, vocab, (n, seq + 1))
        return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()  # next-token targets

    return _problem(model, make, batch, "cross_entropy")


def _next_tokens(vocab: int, seq: int) -> Callable[[int], tuple[Inputs, Tensor]]:
    """ids of T tokens, and ids 1..T-1 as the targets of the logits at 0..T-2 (families.Logits)."""

    def make(n: int) -> tuple[Inputs, Tensor]:
        ids = torch.randint(0, vocab, (n, seq))
        return ids, ids[:, 1:].contiguous()

    return make


def _hf_lm(build: Callable[..., nn.Module], **config: int) -> Problem:
    """A Hugging Face causal LM from ``families`` (vocabulary 8000, T 256), batch 8."""
    torch.manual_seed(0)
    model = build(vocab=8000, seq=256, **config)
    return _problem(model, _next_tokens(8000, 256), 8, "cross_entropy")


def _host(build: Callable[..., nn.Module], **config: int) -> Problem:
    """A Hugging Face causal LM at width 64 on 4 sequences of 16 tokens: its arithmetic nearly
    free, a pass is the host's work (the op graph a GPU user's small batch runs)."""
    torch.manual_seed(0)
    model = build(vocab=512, d=64, seq=16, **config)
    return _problem(model, _next_tokens(512, 16), 4, "cross_entropy")


def _host_bert() -> Problem:
    torch.manual_seed(0)
    model = families.hf_bert(vocab=512, d=64, layers=12, heads=4, seq=16)

    def make(n: int) -> tuple[Inputs, Tensor]:
        return (torch.randint(1, 512, (n, 16)),), torch.randint(0, 3, (n,))

    return _problem(model, make, 4, "cross_entropy")


def _host_truncated() -> Problem:
    """H3's BERT on 16 sequences, every fourth padded, the rest truncated text that fills all
    16 positions: each of those takes transformers' mask shortcut alone."""
    torch.manual_seed(0)
    model = families.hf_bert(vocab=512, d=64, layers=12, heads=4, seq=16)

    def make(n: int) -> tuple[Inputs, Tensor]:
        mask = torch.ones(n, 16, dtype=torch.long)
        padded = torch.arange(n) % 4 == 3
        lengths = torch.randint(8, 16, (int(padded.sum()), 1))
        mask[padded] = (torch.arange(16) < lengths).long()
        return (torch.randint(1, 512, (n, 16)) * mask, mask), torch.randint(0, 3, (n,))

    return _problem(model, make, 16, "cross_entropy")


def _hf_bert() -> Problem:
    torch.manual_seed(0)
    model = families.hf_bert(vocab=8000, d=256, layers=4, heads=4, seq=128)

    def make(n: int) -> tuple[Inputs, Tensor]:
        mask = families.padding_mask(n, 128)
        return (torch.randint(1, 8000, (n, 128)) * mask, mask), torch.randint(0, 3, (n,))

    return _problem(model, make, 16, "cross_entropy")


def _hf_bart() -> Problem:
    torch.manual_seed(0)
    model = families.hf_bart(vocab=8000, d=256, layers=3, heads=4, seq=256)

    def make(n: int) -> tuple[Inputs, Tensor]:
        ids = torch.randint(4, 8000, (n, 256))
        return ids, ids  # the decoder reconstructs its input

    return _problem(model, make, 8, "cross_entropy")


def _vit() -> nn.Module:
    return families.ViT(img=32, patch=4, d=192, layers=6, heads=3, classes=10)


# ---------------------------------------------------------------- the list


@dataclass(frozen=True)
class Workload:
    name: str
    title: str
    build: Callable[[], Problem]
    requires: str | None = None  # an optional package it is built with: "missing" without it

    @property
    def missing(self) -> bool:
        return self.requires is not None and importlib.util.find_spec(self.requires) is None


WORKLOADS = {
    w.name: w
    for w in [
        Workload(
            "W1", "MLP 256-512-512-1, batch 1024, MSE", lambda: _mlp([256, 512, 512, 1], 1024)
        ),
        Workload("W2", "tutorial CNN, batch 64 of 1x28x28", lambda: _images(CNN, (1, 28, 28), 64)),
        Workload(
            "W3",
            "transformer classifier d128 T128, batch 32",
            lambda: _classifier(vocab=8000, seq=128, d=128, heads=4, batch=32),
        ),
        Workload(
            "W4",
            "causal LM d128 T512 tied, batch 8",
            lambda: _lm(vocab=8000, seq=512, d=128, heads=4, batch=8),
        ),
        Workload(
            "W5",
            "HF GPT-2 d256 4 layers T256, batch 8",
            lambda: _hf_lm(families.hf_gpt2, d=256, layers=4, heads=4),
            "transformers",
        ),
        Workload(
            "W6", "HF BERT classifier d256 4 layers T128 padded, batch 16", _hf_bert, "transformers"
        ),
        Workload(
            "W7",
            "HF LLaMA d256 4 layers GQA T256, batch 8",
            lambda: _hf_lm(families.hf_llama, d=256, layers=4, heads=8, kv_heads=2),
            "transformers",
        ),
        Workload(
            "W8",
            "timm-style ViT 32x32 patch 4 d192 6 layers, batch 64",
            lambda: _images(_vit, (3, 32, 32), 64),
        ),
        Workload(
            "W9",
            "HF Mixtral d256 4 layers 8 experts top-2 T256, batch 8",
            lambda: _hf_lm(families.hf_mixtral, d=256, layers=4, heads=8, experts=8),
            "transformers",
        ),
        Workload("W10", "HF BART d256 3+3 layers T256, batch 8", _hf_bart, "transformers"),
        Workload(
            "T1",
            "transformer classifier d32 T16, batch 16",
            lambda: _classifier(vocab=512, seq=16, d=32, heads=2, batch=16),
        ),
        Workload(
            "T2",
            "causal LM d64 T32 tied, batch 8",
            lambda: _lm(vocab=512, seq=32, d=64, heads=2, batch=8),
        ),
        Workload("T3", "MLP 32-64-64-1, batch 64, MSE", lambda: _mlp([32, 64, 64, 1], 64)),
        Workload(
            "T4", "CNN 3x16x16 8-16 channels, batch 32", lambda: _images(SmallCNN, (3, 16, 16), 32)
        ),
        Workload(
            "H1",
            "HF GPT-2 d64 12 layers T16, batch 4",
            lambda: _host(families.hf_gpt2, layers=12, heads=4),
            "transformers",
        ),
        Workload(
            "H2",
            "HF LLaMA d64 16 layers GQA T16, batch 4",
            lambda: _host(families.hf_llama, layers=16, heads=4, kv_heads=2),
            "transformers",
        ),
        Workload("H3", "HF BERT classifier d64 12 layers T16, batch 4", _host_bert, "transformers"),
        Workload(
            "H4",
            "HF Mixtral d64 8 layers 8 experts top-2 T16, batch 4",
            lambda: _host(families.hf_mixtral, layers=8, heads=4, experts=8),
            "transformers",
        ),
        Workload(
            "H5",
            "HF BERT classifier d64 12 layers T16, batch 16, 4 padded",
            _host_truncated,
            "transformers",
        ),
        Workload("smoke", "MLP 8-16-1, batch 4", lambda: _mlp([8, 16, 1], 4)),
    ]
}
# what --workloads takes besides single names
SETS = {
    "default": ("W1", "W2", "W3", "W4", "W5", "W6", "W7", "W8", "W9", "W10"),
    "tiny": ("T1", "T2", "T3", "T4"),
    # the op graphs of four model families at sizes where a pass is host work, as on a GPU;
    # run with --threads 1
    "host": ("H1", "H2", "H3", "H4"),
}


def expand(names: Sequence[str]) -> list[str]:
    """Workload names with each set name replaced by its members, first occurrence kept."""
    return list(dict.fromkeys(w for name in names for w in SETS.get(name, (name,))))
