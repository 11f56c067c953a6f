"""The layer configurations Opacus's ``tests/grad_samples`` and BackPACK's first-order
(``BatchGrad``) tests parametrize, rewritten as our own table of cases, each measured against the
float64 per-example loop on two batches (``benchmarks/harness.py``).

    PYTHONPATH=$PWD:$PWD/tests:$PWD/benchmarks OMP_NUM_THREADS=1 nice -n 10 \\
        python benchmarks/layers.py [--only linear-2d,lstm-packed] [--out PATH]

Inputs are batch-first at the API (dim 0 the example); sequence-first layers get their layout
inside the model (``SeqFirst``), as a user's model would. ``bs1`` cases run a batch of one.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import harness
import torch
from oracle import Case
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

OUT = Path(__file__).parent / "results" / "layers.json"


class First(nn.Module):
    """A module returning a tuple (RNNs, attention), its first item."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *x: Tensor) -> Tensor:
        out = self.module(*x)
        return out[0] if isinstance(out, tuple) else out


class SeqFirst(First):
    """(B, T, ...) inputs handed to the module as (T, B, ...), its output turned back."""

    def forward(self, *x: Tensor) -> Tensor:
        return super().forward(*(t.transpose(0, 1) for t in x)).transpose(0, 1)


class Packed(nn.Module):
    """An RNN over a PackedSequence of each example's first ``lengths[i]`` steps."""

    def __init__(self, rnn: nn.RNNBase):
        super().__init__()
        self.rnn = rnn

    def forward(self, x: Tensor, lengths: Tensor) -> Tensor:
        packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        out, _ = pad_packed_sequence(self.rnn(packed)[0], batch_first=True, total_length=x.shape[1])
        return out  # (B, T, H), zeros past each length


class Bags(nn.Module):
    """EmbeddingBag with flat ids and offsets: example i's bag is its first ``lengths[i]`` ids."""

    def __init__(self, bag: nn.EmbeddingBag):
        super().__init__()
        self.bag = bag

    def forward(self, ids: Tensor, lengths: Tensor) -> Tensor:
        keep = torch.arange(ids.shape[1]) < lengths.unsqueeze(1)  # (B, L)
        offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)[:-1]])
        return self.bag(ids[keep], offsets)  # (B, D)


def head(*layers: nn.Module, classes: int | None = None) -> nn.Module:
    """The layers, then (BackPACK's simple CNN) ReLU, Flatten and a Linear to ``classes``."""
    if classes is None:
        return nn.Sequential(*layers)
    return nn.Sequential(*layers, nn.ReLU(), nn.Flatten(), nn.LazyLinear(classes))


def randn(*shape: int):
    return lambda b: (torch.randn(b, *shape),)


def ids(vocab: int, *shape: int):
    return lambda b: (torch.randint(0, vocab, (b, *shape)),)


def with_lengths(x, t: int):
    """Inputs plus (B,) lengths in 1..t, the first example the longest."""

    def make(b: int) -> tuple[Tensor, ...]:
        lengths = torch.randint(1, t + 1, (b,))
        lengths[0] = t
        return (*x(b), lengths)

    return make


def qkv(t: int, d: int, kdim: int | None = None, vdim: int | None = None):
    return lambda b: (
        torch.randn(b, t, d),
        torch.randn(b, t, kdim or d),
        torch.randn(b, t, vdim or d),
    )


def classes(out: Tensor) -> Tensor:
    return torch.randint(0, out.shape[-1], out.shape[:-1])


def values(out: Tensor) -> Tensor:
    return torch.randn_like(out)


def cases() -> list[Case]:
    ce = {"targets": classes, "loss": "cross_entropy"}
    mse = {"targets": values, "loss": "mse"}
    out = [
        # Linear: BackPACK's 2-D and one to three additional dims, Opacus's sequence-first
        Case("linear-2d", lambda: head(nn.Linear(10, 7), nn.ReLU(), nn.Linear(7, 5)), randn(10), **ce),
        Case("linear-2d-bs1", lambda: head(nn.Linear(10, 7), nn.Sigmoid(), nn.Linear(7, 5)), randn(10), batch=1, **mse),
        Case("linear-3d", lambda: head(nn.Linear(5, 3), nn.Linear(3, 2)), randn(4, 5), **mse),
        Case("linear-4d", lambda: head(nn.Linear(5, 3), nn.Sigmoid(), nn.Linear(3, 2)), randn(4, 2, 5), **mse),
        Case("linear-5d-flatten", lambda: head(nn.Linear(5, 3), nn.ReLU(), nn.Linear(3, 2), nn.Flatten()), randn(4, 2, 3, 5), **ce),
        Case("linear-seq-first", lambda: SeqFirst(nn.Linear(6, 4)), randn(5, 6), **mse),
        Case("linear-no-bias-bs1", lambda: head(nn.Linear(6, 4, bias=False)), randn(3, 6), batch=1, **mse),
    ]  # fmt: skip
    # Conv and ConvTranspose: BackPACK's make_simple_cnn_setting (in, out, k, stride, padding,
    # dilation|output_padding, groups, bias, dilation), then Opacus's padding modes and groups
    convs = {  # class: [(input shape without the batch, constructor args)], as BackPACK lists them
        nn.Conv1d: [((3, 7), (3, 2, 2)), ((2, 7), (2, 3, 2, 2, 0, 2)), ((3, 7), (3, 2, 2, 2, 1)), ((3, 8), (3, 6, 2, 4, 2, 3)), ((3, 7), (3, 2, 2, 4, 2, 1, 1, False))],
        nn.Conv2d: [((3, 7, 7), (3, 2, 2)), ((2, 7, 7), (2, 3, 2, 2, 0, 2)), ((3, 7, 7), (3, 2, 2, 2, 1)), ((3, 8, 8), (3, 6, 2, 4, 2, 3)), ((3, 7, 7), (3, 2, 2, 4, 2, 1, 1, False))],
        nn.Conv3d: [((3, 2, 7, 7), (3, 2, 2)), ((2, 3, 7, 7), (2, 3, 2, 2, 0, 2)), ((3, 2, 7, 7), (3, 2, 2, 3, 2)), ((3, 4, 8, 8), (3, 6, 2, 4, 2, 3)), ((3, 2, 7, 7), (3, 2, 2, 4, 2, 1, 1, False))],
        nn.ConvTranspose1d: [((3, 7), (3, 2, 2)), ((2, 7), (2, 3, 2, 2, 0, 0, 1, True, 2)), ((3, 7), (3, 2, 2, 2, 1)), ((3, 8), (3, 6, 2, 4, 2, 0, 1, True, 3)), ((3, 7), (3, 2, 2, 4, 2, 0, 1, False))],
        nn.ConvTranspose2d: [((3, 7, 7), (3, 2, 2)), ((2, 9, 9), (2, 4, 2, 1, 0, 0, 1, True, 2)), ((3, 7, 7), (3, 2, 2, 2, 1)), ((3, 7, 7), (3, 2, 2, 4, 2, 0, 1, False))],
        nn.ConvTranspose3d: [((3, 2, 7, 7), (3, 2, 2)), ((2, 3, 5, 5), (2, 3, 2, 2, 2, 0, 1, True, 2)), ((3, 2, 7, 7), (3, 2, 2, 4, 2, 0, 1, False))],
    }  # fmt: skip
    for cls, settings in convs.items():
        for k, (shape, args) in enumerate(settings):
            make = lambda cls=cls, args=args: head(cls(*args), classes=5)  # noqa: E731
            out.append(Case(f"{cls.__name__.lower()}-{k}", make, randn(*shape), **ce))
    out += [
        Case("conv2d-same-dilated", lambda: head(nn.Conv2d(4, 8, 3, padding="same", dilation=2), classes=5), randn(4, 9, 9), **ce),
        Case("conv2d-valid-groups2", lambda: head(nn.Conv2d(4, 8, 3, stride=2, padding="valid", groups=2), classes=5), randn(4, 9, 9), **ce),
        Case("conv2d-depthwise-bs1", lambda: head(nn.Conv2d(4, 4, 3, padding=2, groups=4), classes=5), randn(4, 9, 9), batch=1, **ce),
        Case("conv1d-groups-shrink", lambda: head(nn.Conv1d(6, 3, 3, padding="same", groups=3), classes=5), randn(6, 12), **ce),
        Case("conv3d-groups-stride", lambda: head(nn.Conv3d(4, 4, 2, stride=2, groups=2), classes=5), randn(4, 4, 6, 6), **ce),
        Case("convtranspose2d-groups", lambda: head(nn.ConvTranspose2d(4, 6, 3, stride=2, groups=2, output_padding=1), classes=5), randn(4, 5, 5), **ce),
        # BatchNorm on running statistics (BackPACK), running stats made non-trivial
        Case("batchnorm1d-eval", lambda: running(nn.BatchNorm1d(3)), randn(3, 4), **mse),
        Case("batchnorm2d-eval", lambda: running(nn.BatchNorm2d(2)), randn(2, 4, 3), **mse),
        Case("batchnorm3d-eval", lambda: running(nn.BatchNorm3d(3)), randn(3, 4, 1, 2), **mse),
        Case("batchnorm3d-linear-stack", lambda: running(head(nn.BatchNorm3d(3), nn.Linear(2, 3), nn.BatchNorm3d(3), nn.ReLU(), nn.BatchNorm3d(3))), randn(3, 4, 1, 2), **mse),
        # norms (Opacus): LayerNorm over 1-3 trailing dims, GroupNorm, InstanceNorm (affine), RMSNorm
        Case("layernorm-1", lambda: nn.LayerNorm(6), randn(5, 6), **mse),
        Case("layernorm-2", lambda: nn.LayerNorm((4, 6)), randn(3, 4, 6), **mse),
        Case("layernorm-3-bs1", lambda: nn.LayerNorm((2, 4, 6)), randn(2, 4, 6), batch=1, **mse),
        Case("layernorm-no-bias", lambda: nn.LayerNorm(6, bias=False), randn(5, 6), **mse),
        Case("groupnorm-1", lambda: nn.GroupNorm(1, 4), randn(4, 5, 5), **mse),
        Case("groupnorm-2", lambda: nn.GroupNorm(2, 4), randn(4, 5, 5), **mse),
        Case("groupnorm-c", lambda: nn.GroupNorm(4, 4), randn(4, 5), **mse),
        Case("instancenorm1d", lambda: nn.InstanceNorm1d(3, affine=True), randn(3, 7), **mse),
        Case("instancenorm2d", lambda: nn.InstanceNorm2d(3, affine=True), randn(3, 5, 5), **mse),
        Case("instancenorm3d-bs1", lambda: nn.InstanceNorm3d(3, affine=True), randn(3, 3, 4, 4), batch=1, **mse),
        Case("rmsnorm", lambda: nn.RMSNorm(6), randn(5, 6), **mse),
        # Embedding (BackPACK: ids of (B,) and (B, 2, 2); Opacus: padding_idx, repeated ids)
        Case("embedding-linear", lambda: head(nn.Embedding(5, 3), nn.Linear(3, 4)), ids(5), **ce),
        Case("embedding-3d-flatten", lambda: head(nn.Embedding(3, 5), nn.Flatten()), ids(3, 2, 2), **ce),
        Case("embedding-padding-idx", lambda: nn.Embedding(10, 4, padding_idx=0), ids(10, 6), **mse),
        Case("embedding-repeats-bs1", lambda: nn.Embedding(3, 4), ids(3, 12), batch=1, **mse),
        # EmbeddingBag (Opacus: sum and mean over bags given by offsets)
        Case("embeddingbag-sum-offsets", lambda: Bags(nn.EmbeddingBag(12, 5, mode="sum")), with_lengths(ids(12, 6), 6), **mse),
        Case("embeddingbag-mean-offsets", lambda: Bags(nn.EmbeddingBag(12, 5, mode="mean")), with_lengths(ids(12, 6), 6), **mse),
        Case("embeddingbag-max-2d", lambda: nn.EmbeddingBag(12, 5, mode="max"), ids(12, 4), **mse),
        Case("embeddingbag-mean-2d-bs1", lambda: nn.EmbeddingBag(12, 5, mode="mean"), ids(12, 4), batch=1, **mse),
    ]  # fmt: skip
    # RNN, GRU, LSTM (Opacus's DPRNN/DPGRU/DPLSTM grid; BackPACK's RNN and LSTM, batch 8 and 4)
    for cls in (nn.RNN, nn.GRU, nn.LSTM):
        n = cls.__name__.lower()
        out += [
            Case(f"{n}-batch-first", lambda cls=cls: First(cls(6, 3, batch_first=True)), randn(5, 6), batch=8 if cls is nn.RNN else 4, **ce),
            Case(f"{n}-seq-first", lambda cls=cls: SeqFirst(cls(4, 8)), randn(3, 4), **mse),
            Case(f"{n}-2layers-bidir", lambda cls=cls: First(cls(4, 8, num_layers=2, bidirectional=True, batch_first=True)), randn(3, 4), **mse),
            Case(f"{n}-no-bias-bs1", lambda cls=cls: First(cls(5, 9, bias=False, batch_first=True)), randn(2, 5), batch=1, **mse),
            Case(f"{n}-packed", lambda cls=cls: Packed(cls(4, 8, batch_first=True)), with_lengths(randn(3, 4), 3), **mse),
            Case(f"{n}-packed-2layers-bidir", lambda cls=cls: Packed(cls(4, 8, num_layers=2, bidirectional=True, batch_first=True)), with_lengths(randn(3, 4), 3), **mse),
        ]  # fmt: skip
    # MultiheadAttention (Opacus: D 4, heads 1-2, bias, add_bias_kv, add_zero_attn, kdim/vdim)
    out += [
        Case("mha-self-batch-first", lambda: First(nn.MultiheadAttention(8, 2, batch_first=True)), qkv(5, 8), **mse),
        Case("mha-seq-first", lambda: SeqFirst(nn.MultiheadAttention(4, 1)), qkv(6, 4), **mse),
        Case("mha-bias-kv-zero-attn", lambda: SeqFirst(nn.MultiheadAttention(4, 2, add_bias_kv=True, add_zero_attn=True)), qkv(6, 4), **mse),
        Case("mha-no-bias", lambda: First(nn.MultiheadAttention(4, 2, bias=False, batch_first=True)), qkv(6, 4), **mse),
        Case("mha-kdim-vdim", lambda: First(nn.MultiheadAttention(4, 2, kdim=3, vdim=5, batch_first=True)), qkv(6, 4, 3, 5), **mse),
        Case("mha-kdim-vdim-bs1", lambda: First(nn.MultiheadAttention(4, 2, kdim=3, vdim=5, add_bias_kv=True, batch_first=True)), qkv(6, 4, 3, 5), batch=1, **mse),
    ]  # fmt: skip
    return out


def running(module: nn.Module) -> nn.Module:
    """BatchNorm layers with running statistics that are not 0 and 1, as after training."""
    for m in module.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.running_mean.uniform_(-1, 1), m.running_var.uniform_(0.5, 2)
    return module


def run_one(name: str) -> dict:
    case = next(c for c in cases() if c.id == name)
    model, x, y = case.build(batch=case.batch, seed=0)
    torch.manual_seed(1)
    x2 = tuple(t.double() if t.is_floating_point() else t for t in case.inputs(case.batch))
    with torch.no_grad():
        y2 = case.targets(model(*x2))
    rec = harness.measure(model, [(x, y), (x2, y2)], case.loss)
    rec["batch"] = case.batch
    return rec


def faster(results: dict) -> dict[str, str]:
    """The share of cases whose warm pass beats the loop, over all and at batch 3 or more
    (issue 49's target: a batch of one pays the pass's fixed cost against one backward)."""
    ok = [r for r in results.values() if r["status"] == "ok"]
    out = {}
    for what, rows in (("all", ok), ("at batch >= 3", [r for r in ok if r["batch"] >= 3])):
        n = sum(r.get("speedup", 1) >= 1 for r in rows)
        out[f"faster than the loop, {what}"] = (
            f"{n}/{len(rows)} ({100 * n / max(len(rows), 1):.1f}%)"
        )
    return out


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        harness.serve(sys.argv[3:], run_one, Path(sys.argv[2]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated case ids")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per case")
    parser.add_argument("--out", type=Path, default=OUT)
    harness.add_clock(parser)
    args = parser.parse_args()
    harness.use_clock(args.clock)
    names = args.only.split(",") if args.only else [c.id for c in cases()]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    results = harness.run_isolated(__file__, names, args.out, args.timeout, 1)
    text = harness.write(results, args.out, "Opacus/BackPACK layer configurations", faster(results))
    print("\n".join(text.splitlines()[:10]))


if __name__ == "__main__":
    main()
