"""The replay's newer paths through fresh public calls and the command line, not one Engine:
reads of tensors made from parameters intercepted (a CLIP-like and a SigLIP-like dual encoder,
cross-attention ``nn.MultiheadAttention``, SigLIP's probe head), a state changed every batch
(analysed each time, self-checked once), a decoder input shifted from the ids (BART's
``shift_tokens_right``), and where transformers is installed Mixtral's grouped experts (rows
settled by position) and BART on padded batches. Each: batches of several shapes (a batch of 1,
other lengths, padding) by a fresh ``per_example_norms`` or ``per_example_influence`` call
each, then as one ``gradscope norms`` run whose last batch is a single row, each number against
the float64 per-example loop, the model left as it was, and the passes after a signature's
first replayed (the state-changing model's analysed, its self-check not repeated)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from oracle import assert_rel_close, model_state, reference_influence, reference_norms
from project import run_cli
from test_decoder_start import Shifted
from test_intercept_computed import CrossAttention, DualEncoder
from test_repeated import Model as Recurrent
from torch import Tensor, nn

import gradscope
from gradscope.engine import engine, record
from gradscope.engine.analysis.program import repeated as repeated_

HERE = Path(__file__).parent
Batch = tuple[tuple[Tensor, ...], Tensor]


@dataclass
class Case:
    """A model and its batches: ``make(seed, n, k)`` the ``k``-th shape's batch of ``n``."""

    build: Callable[[], nn.Module]
    make: Callable[[int, int, int], Batch]
    shapes: int = 2  # how many other shapes (lengths, padding) its batches take
    dtype: torch.dtype = torch.float64
    rtol: float = 1e-9
    replays: bool = True  # False: its state changes every batch, every batch analysed
    intercepts: bool = False  # its light regions' reads intercepted, every one


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _dual(seed: int, n: int, k: int) -> Batch:
    x, y = torch.randn(n, 6, generator=_g(seed)), torch.randn(n, 5, generator=_g(seed + 50))
    return (x.double(), y.double()), torch.arange(n) % 3


def _cross(seed: int, n: int, k: int) -> Batch:
    q, kv = (3, 4) if k == 0 else (5, 2)  # other lengths of queries and keys
    x, y = torch.randn(n, q, 6, generator=_g(seed)), torch.randn(n, kv, 5, generator=_g(seed + 50))
    return (x.double(), y.double()), torch.arange(n) % 3


def _recurrent(seed: int, n: int, k: int) -> Batch:
    return (torch.randn(n, 5 - k, 4, generator=_g(seed)).double(),), torch.arange(n) % 3


def _ids(seed: int, n: int, k: int) -> Batch:
    ids = torch.randint(3, 16, (n, 6 - 2 * k), generator=_g(seed))
    return (ids,), ids


def _hf(seed: int, n: int, k: int, vocab: int, t: int, shifted: bool) -> Batch:
    """Ids of ``vocab`` over ``t`` tokens; ``k`` 1: a padding mask too, its pads' targets left
    out (-100) where the model predicts the next token, pad ids (1) in BART's decoder input."""
    g = _g(seed)
    ids = torch.randint(4, vocab, (n, t), generator=g)
    targets = ids if shifted else ids[:, 1:].contiguous()
    if k == 0:
        return (ids,), targets
    import families

    mask = families.padding_mask(n, t, g)
    if shifted:
        return (ids * mask + 1 - mask, mask), ids
    return (ids * mask, mask), targets.masked_fill(mask[:, 1:] == 0, -100)


def _mixtral() -> nn.Module:
    import families

    model = families.hf_mixtral(vocab=64, d=16, layers=2, heads=2, experts=8, seq=6)
    return model.eval()


def _bart() -> nn.Module:
    import families

    return families.hf_bart(vocab=64, d=16, layers=1, heads=2, seq=8).double().eval()


CASES = {
    "clip": Case(DualEncoder, _dual, shapes=1, intercepts=True),
    "siglip": Case(lambda: DualEncoder(bias=True), _dual, shapes=1, intercepts=True),
    "cross": Case(CrossAttention, _cross, intercepts=True),
    "cross-sequence-first": Case(
        lambda: CrossAttention(batch_first=False), _cross, intercepts=True
    ),
    "probe": Case(lambda: CrossAttention(probe=True), _cross, intercepts=True),
    "recurrent": Case(Recurrent, _recurrent, replays=False),
    "shifted": Case(lambda: Shifted().eval(), _ids),
    "mixtral": Case(
        _mixtral, lambda s, n, k: _hf(s, n, k, 64, 6, False), dtype=torch.float32, rtol=1e-5
    ),
    "bart": Case(_bart, lambda s, n, k: _hf(s, n, k, 64, 8, True)),
}
HF = ("mixtral", "bart")


def build(name: str) -> nn.Module:
    """The case's model, of seed 0 and its dtype: the command line's factory too."""
    torch.manual_seed(0)
    return CASES[name].build().to(CASES[name].dtype)


def _oracle(name: str, model: nn.Module) -> nn.Module:
    """The model the loop runs: Mixtral's grouped experts as transformers' eager loop (its
    ``grouped_mm`` has no float64 kernel), the rest as they are."""
    if name != "mixtral":
        return model
    double = copy.deepcopy(model).double()
    double.model.config._experts_implementation = "eager"
    return double


def _cases() -> list:
    return [pytest.param(n, marks=pytest.mark.slow) if n in HF else n for n in CASES]


@pytest.fixture
def passes(monkeypatch) -> list[str]:
    """Each batch's pass, in order: replayed, analysed, or analysed and not self-checked again
    (its structure one checked: ``repeated``)."""
    log: list[str] = []
    skipped = [False]  # whether the batch under analysis skips its self-check
    replayed, analysed, repeated = record.Findings.replayed, record.Findings.analysed, repeated_

    def replay(findings, program):
        log.append("replayed")
        replayed(findings, program)

    def analyse(findings, *args):
        log.append("repeated" if skipped[0] else "analysed")
        skipped[0] = False
        analysed(findings, *args)

    def skips(*args):
        skipped[0] = repeated(*args)
        return skipped[0]

    monkeypatch.setattr(record.Findings, "replayed", replay)
    monkeypatch.setattr(record.Findings, "analysed", analyse)
    monkeypatch.setattr(engine, "repeated", skips)
    return log


def _expected(case: Case, want: list[str]) -> list[str]:
    """``want`` as the state-changing model has it: every batch analysed, those after each
    signature's first not self-checked again."""
    return want if case.replays else [w.replace("replayed", "repeated") for w in want]


def _model(name: str) -> tuple[Case, nn.Module, nn.Module]:
    case = CASES[name]
    if name in HF:
        pytest.importorskip("transformers")
    model = build(name)
    return case, model, _oracle(name, model)


@pytest.mark.parametrize("name", _cases())
def test_fresh_calls_on_batches_of_several_shapes_equal_the_loop(name, passes, intercepted):
    """Per shape: two batches of 3, then two of 1, each by a fresh call: each signature's
    first analysed, the second replayed, its reads intercepted where the case's are."""
    case, model, oracle = _model(name)
    for k in range(case.shapes):
        for n in (3, 1):
            for seed in (1, 2):
                inputs, targets = case.make(seed, n, k)
                state = model_state(model)
                got = gradscope.per_example_norms(model, inputs, targets)
                state.assert_kept(model)
                want = reference_norms(oracle, inputs, targets, "cross_entropy")[1]
                assert_rel_close(got, want, case.rtol)
    assert passes == _expected(case, ["analysed", "replayed"] * 2 * case.shapes)
    assert not case.intercepts or (intercepted and all(intercepted)), intercepted


@pytest.mark.parametrize("name", _cases())
def test_fresh_influence_calls_equal_the_loop(name, passes):
    """``per_example_influence`` through the hooks engine (the replay's), against the mean
    gradient of a batch of 3, on batches of 3 and of 1 of each shape."""
    case, model, oracle = _model(name)
    ref = case.make(0, 3, 0)
    for k in range(case.shapes):
        for n, seed in ((3, 1), (3, 2), (1, 3), (1, 4)):
            inputs, targets = case.make(seed, n, k)
            state = model_state(model)
            got = gradscope.per_example_influence(model, inputs, targets, *ref, engine="hooks")
            state.assert_kept(model)
            want = reference_influence(oracle, inputs, targets, ref, "cross_entropy")[0][:, 0]
            assert_rel_close(got, want, case.rtol)
    assert ("replayed" if case.replays else "repeated") in passes


# the tests' folders the case's toys come from, and benchmarks/ (families.py)
PATHS = [str(p) for p in (HERE, HERE.parent / "analysis", HERE.parents[1], HERE.parents[2])]
MODEL_PY = f"""
import sys

sys.path[:0] = {PATHS[:3]!r} + [{PATHS[3]!r} + "/benchmarks"]
from test_paths_public import build


def make():
    return build({{name!r}})
"""


@pytest.mark.parametrize("name", _cases())
def test_the_command_line_equals_the_loop(name, passes, tmp_path: Path):
    """``gradscope norms`` on 10 rows of the case's last shape (padded, where it pads) from a
    ``model.factory`` file: batches of 3, 3, 3 and 1, losses and norms the loop's."""
    case, model, oracle = _model(name)
    k = case.shapes - 1
    batches = [case.make(seed, 3, k) for seed in (1, 2, 3)] + [case.make(4, 1, k)]
    inputs = tuple(torch.cat(column) for column in zip(*(b[0] for b in batches), strict=True))
    targets = torch.cat([b[1] for b in batches])
    names = [f"x{i}" for i in range(len(inputs))]
    torch.save(dict(zip(names, inputs, strict=True)) | {"y": targets}, tmp_path / "data.pt")
    torch.save(model.state_dict(), tmp_path / "model.pt")
    (tmp_path / "models.py").write_text(MODEL_PY.format(name=name))
    scores = run_cli(
        tmp_path,
        {"factory": "models.py:make", "checkpoint": "model.pt"},
        {"path": "data.pt", "inputs": names, "targets": "y", "batch_size": 3},
        "cross_entropy",
        dtype=str(case.dtype).removeprefix("torch."),
    ).sort_values("example_id")
    losses, norms = reference_norms(oracle, inputs, targets, "cross_entropy")
    assert_rel_close(torch.tensor(scores["loss"].to_numpy()), losses, case.rtol)
    assert_rel_close(torch.tensor(scores["grad_norm"].to_numpy()), norms, case.rtol)
    assert passes == _expected(case, ["analysed", "replayed", "replayed", "analysed"])
