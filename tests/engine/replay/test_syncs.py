"""A steady pass adds no host-device synchronisation: on every workload of the benchmarks (the
tiny and host ones as the benchmark builds them, the larger ones as the same families at test
sizes), a replayed batch reads back to the host no more often than one plain forward and
backward with the same loss. Counted as calls of the tensor methods and functions that wait for
the device (``bool``, ``item``, ``tolist``, ``equal``, ``unique``, ...), over every batch, so
that the analysed batches and the replayed one see the same (counting) functions;
``benchmarks/cuda_check.py`` counts them on a GPU itself."""

from __future__ import annotations

import pytest
import torch
import workloads
from syncs import OFFSETS, counted, step_and_pass

from gradscope.engine import Engine
from gradscope.losses import resolve_loss
from gradscope.rules.routed import gram_cheap

transformers = pytest.importorskip("transformers")
import families  # noqa: E402 - after the skip: its builders import transformers


def _hf(build, **config: int) -> workloads.Problem:
    """A Hugging Face causal LM of ``families`` at width 16, vocabulary 64, on 3 × 8 tokens."""
    torch.manual_seed(0)
    model = build(vocab=64, d=16, seq=8, **config)
    return workloads._problem(model, workloads._next_tokens(64, 8), 3, "cross_entropy")


def _bert() -> workloads.Problem:
    """W6's padded BERT classifier: some batches padded, some not (another way through it)."""
    torch.manual_seed(0)
    model = families.hf_bert(vocab=64, d=16, layers=2, heads=2, seq=8)

    def make(n: int):
        mask = families.padding_mask(n, 8)
        return (torch.randint(1, 64, (n, 8)) * mask, mask), torch.randint(0, 3, (n,))

    return workloads._problem(model, make, 3, "cross_entropy")


def _bart() -> workloads.Problem:
    torch.manual_seed(0)
    model = families.hf_bart(vocab=64, d=16, layers=2, heads=2, seq=8)

    def make(n: int):
        ids = torch.randint(4, 64, (n, 8))
        return ids, ids

    return workloads._problem(model, make, 3, "cross_entropy")


def _vit() -> torch.nn.Module:
    return families.ViT(img=8, patch=4, d=16, layers=2, heads=2, classes=10)


# the W workloads' families at test sizes; the T and H ones are built as the benchmark builds them
SMALL = {
    "W1": lambda: workloads._mlp([16, 32, 32, 1], 6),
    "W2": lambda: workloads._images(workloads.CNN, (1, 28, 28), 3),
    "W3": lambda: workloads._classifier(vocab=64, seq=8, d=16, heads=2, batch=3),
    "W4": lambda: workloads._lm(vocab=64, seq=8, d=16, heads=2, batch=3),
    "W5": lambda: _hf(families.hf_gpt2, layers=2, heads=2),
    "W6": _bert,
    "W7": lambda: _hf(families.hf_llama, layers=2, heads=4, kv_heads=2),
    "W8": lambda: workloads._images(_vit, (3, 8, 8), 3),
    "W9": lambda: _hf(families.hf_mixtral, layers=2, heads=4, experts=4),
    "W10": _bart,
}
NAMES = [name for name in workloads.WORKLOADS if name != "smoke"]


def _problem(name: str) -> workloads.Problem:
    return SMALL[name]() if name in SMALL else workloads.WORKLOADS[name].build()


@pytest.mark.parametrize("name", NAMES)
def test_a_replayed_pass_syncs_no_more_than_a_plain_step(name: str):
    """... but for its check of a branch on the batch's values (``analysis/branches.py``):
    W6's and H5's padded batches read their mask's ``all()`` on the host, false, where each
    example with nothing padded reads true alone. Each example's own value is read off the mask
    at once (one ``tolist``); one with nothing padded runs whole, its loss compared with the
    batch's (an ``allclose``), and several run whole together, their losses compared at once
    (a second ``tolist``), their forward's own reads besides."""
    pb = _problem(name)
    plain, ours, replays, checked = step_and_pass(pb)
    assert replays >= 2  # the counted pass replayed
    assert not ours - plain, (ours, plain)
    mask = pb.batch(3)[0][1] if name in ("W6", "H5") else None
    if mask is None or bool(mask.all()):
        assert not checked, checked
    else:
        apart = int(mask.all(1).sum())
        assert checked["tolist"] == 1 + (apart > 1), checked
        assert checked["allclose"] == (apart == 1) and not checked["item"] - 2 * (apart == 1)


def test_keyed_experts_wait_no_more_than_a_plain_step():
    """W9's family where its experts' reads are keyed (``Routed.keyed``: 3 x 50 tokens top-2,
    300 rows, of 4 experts of 256 x 64 and 64 x 128: no Gram over all rows cheap), as at W9's
    own size: a layer's two reads take their keys' row counts to the host once (a ``tolist``),
    and skip autograd's weight gradients, whose grouped products a plain step runs and which
    read their offsets on the host as the forward's and the input gradients' do: the pass
    waits less often in all."""
    torch.manual_seed(0)
    model = families.hf_mixtral(vocab=64, d=64, seq=50, layers=2, heads=4, experts=4)
    problem = workloads._problem(model, workloads._next_tokens(64, 50), 3, "cross_entropy")
    for shape in ((4, 2 * 128, 64), (4, 64, 128)):  # gate-up's and down's reads: keyed
        assert not gram_cheap(3 * 50 * 2, torch.Size(shape))
    plain, ours, replays, _ = step_and_pass(problem)
    assert replays >= 2
    assert ours["tolist"] == 2 and plain[OFFSETS] == 3 * 2 * 2  # a read a layer; 2 layers
    assert ours.total() < plain.total(), (ours, plain)


def test_every_workload_is_counted():
    assert set(SMALL) == set(workloads.SETS["default"])


class _Gated(torch.nn.Module):
    """Branches on the batch's values read on the host, outside any region."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)

    def forward(self, x):
        h = self.a(x)
        if bool((x[:, 0] > 0).all()):
            h = h * 2
        return self.b(h)


def test_a_read_through_a_replaced_method_is_witnessed_as_that_read():
    """``counted`` replaces ``Tensor.__bool__`` after gradscope was imported, as any library
    may: the engine still sees the model's branch as a value read on the host (before, it
    saw an unknown op named ``call`` and the batch failed a later witness instead)."""
    torch.manual_seed(0)
    model = _Gated().double()
    engine = Engine(model, resolve_loss("mse"))
    xs = [torch.randn(3, 4, dtype=torch.float64) for _ in range(3)]
    for x, sign in zip(xs, (1, -1, 1), strict=True):
        x[:, 0] = sign * x[:, 0].abs()  # the branch taken, not taken, taken
    y = torch.randn(3, 1, dtype=torch.float64)
    with counted(), engine:
        for x in xs:
            engine.norms((x,), y)
    findings = engine.record.at((xs[0],), y)
    assert (findings.analyses, findings.replays) == (2, 1)
    assert findings.why == "other values read on the host (__bool__) than analysed"
