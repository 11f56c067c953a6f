"""The watch on the model types of the benchmark's W workloads, at tiny sizes, in train mode:
each step's rows against a float64 per-example loop, and ``.grad`` against the plain step's
(two steps of one batch shape: the first's gradient is autograd's, the second's the sum of
the examples' the rules formed), relative to the largest value."""

from __future__ import annotations

import copy
from collections.abc import Callable

import families
import pyarrow.parquet as pq
import pytest
import torch
from oracle import assert_rel_close, reference_norms
from torch import Tensor, nn
from workloads import CNN

from gradscope.losses import resolve_loss
from gradscope.training.watch import Watch

Batch = tuple[tuple[Tensor, ...], Tensor]


def _images(shape: tuple[int, ...], classes: int) -> Callable[[torch.Generator], Batch]:
    return lambda g: (
        (torch.randn(3, *shape, generator=g),),
        torch.randint(0, classes, (3,), generator=g),
    )


def _padded(g: torch.Generator) -> Batch:
    mask = families.padding_mask(3, 8, g)
    ids = torch.randint(1, 32, (3, 8), generator=g) * mask
    return (ids, mask), torch.randint(0, 3, (3,), generator=g)


def _next(g: torch.Generator) -> Batch:
    ids = torch.randint(0, 32, (3, 8), generator=g)
    return (ids,), ids[:, 1:]  # the logits of 0..T-2 against ids 1..T-1


def _decoded(g: torch.Generator) -> Batch:
    ids = torch.randint(4, 32, (3, 8), generator=g)
    return (ids,), ids  # the decoder reconstructs its input


def _cnn() -> nn.Module:
    model = CNN()
    model[5].p = 0.0  # its dropout: the masks are test_watch.py's
    return model


TINY = {"vocab": 32, "d": 16, "layers": 1, "heads": 2, "seq": 8}
# each: the model, a batch, the tolerance (Mixtral's router takes its softmax in float32: the
# gradient of the batch's loss summed, then divided, rounds there otherwise than the mean's)
CASES = {
    "W2 CNN": (_cnn, _images((1, 28, 28), 10), 1e-10),
    "W6 BERT padded": (lambda: families.hf_bert(**TINY), _padded, 1e-10),
    "W8 ViT": (lambda: families.ViT(img=8, patch=4, d=16, layers=1, heads=2, classes=3),
               _images((3, 8, 8), 3), 1e-10),
    # its experts run by a loop: grouped_mm takes no float64 (its rule: tests/engine/backward)
    "W9 Mixtral": (lambda: families.hf_mixtral(**TINY, experts=4,
                                               experts_implementation="eager"), _next, 1e-6),
    "W10 BART": (lambda: families.hf_bart(**TINY), _decoded, 1e-10),
}  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_each_workloads_type_is_watched_as_the_loop_gives(tmp_path, case):
    build, batch, rtol = CASES[case]
    torch.manual_seed(0)
    model = build().double().train()
    g = torch.Generator().manual_seed(1)
    batches = [batch(g) for _ in range(2)]
    batches = [
        (tuple(t.double() if t.is_floating_point() else t for t in x), y) for x, y in batches
    ]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = resolve_loss("cross_entropy")
    want = []
    with Watch(model, tmp_path / "w.parquet") as watch:
        for step, (x, y) in enumerate(batches):
            want.append(reference_norms(model, x, y, "cross_entropy"))
            plain = copy.deepcopy(model)
            loss(plain(*x), y).mean().backward()
            optimizer.zero_grad()
            watch.step(x, y, torch.arange(3) + 3 * step).backward()
            grads = [
                torch.cat([p.grad.reshape(-1) for p in m.parameters()]) for m in (model, plain)
            ]
            assert_rel_close(*grads, rtol)
            optimizer.step()
    table = pq.read_table(tmp_path / "w.parquet").to_pydict()
    assert table["example_id"] == list(range(6))
    for name, at in (("loss", 0), ("grad_norm", 1)):
        expected = torch.cat([w[at] for w in want])
        assert_rel_close(torch.tensor(table[name], dtype=torch.float64), expected, rtol)
