"""Rows that the batch's values pick, at fixed shapes and with no value read on the host: in a
module's call or in the model's own forward, rows sorted and put back (each row its example's
on every batch), or picked and added where a value says (the examples mixed on some batches).
Every batch of one Engine exact against the float64 loop, or refused where the examples mix;
one CLI run over the batches exact, or refused in one line."""

from __future__ import annotations

import pytest
import torch
from oracle import (
    assert_fresh_norms_exact_or_refused,
    assert_rel_close,
    model_state,
    reference_norms,
)
from project import invoke_cli, run_cli
from torch import Tensor, nn

from gradscope.engine import Engine, total
from gradscope.errors import ModelError
from gradscope.losses import resolve_loss

D, CLASSES, BATCH, BATCHES = 6, 3, 5, 6


def _picked(how: str, h: Tensor, x: Tensor) -> Tensor:
    rows = torch.arange(h.shape[0])
    if how == "sorted":  # sorted by a value, scaled, put back: each row its example's
        order = x[:, 0].argsort()
        return (h[order] * 2)[order.argsort()]
    if how == "copied":  # example 0's row copied where a value is small: mixed on some batches
        return h[torch.where(x[:, 0] > -0.5, rows, torch.zeros_like(rows))]
    # "added": rows added into row 0 where a value is large, by index_add
    return torch.zeros_like(h).index_add(0, torch.where(x[:, 0] > 0.8, 0, rows), h)


class Picker(nn.Module):
    def __init__(self, how: str):
        super().__init__()
        self.how = how

    def forward(self, h: Tensor, x: Tensor) -> Tensor:
        return _picked(self.how, h, x)


class Picked(nn.Module):
    """Rows picked between two Linears, in a module's call or in the model's own forward."""

    def __init__(self, how: str, where: str):
        super().__init__()
        self.fc1, self.fc2, self.picker = nn.Linear(D, D), nn.Linear(D, CLASSES), Picker(how)
        self.how, self.where = how, where

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.fc1(x))
        h = self.picker(h, x) if self.where == "call" else _picked(self.how, h, x)
        return self.fc2(h)


def _batches() -> list[tuple[tuple[Tensor], Tensor]]:
    out = []
    for k in range(BATCHES):
        g = torch.Generator().manual_seed(k)
        x = torch.randn(BATCH, D, generator=g, dtype=torch.float64)
        out.append(((x,), torch.randint(0, CLASSES, (BATCH,), generator=g)))
    return out


def _mixes(how: str, x: Tensor) -> bool:
    """Whether the batch's values send a row into another example's."""
    if how == "copied":
        return bool((x[:, 0] <= -0.5)[1:].any())
    if how == "added":
        return bool((x[:, 0] > 0.8)[1:].any())
    return False


def _build(how: str, where: str) -> nn.Module:
    torch.manual_seed(0)
    return Picked(how, where).double()


CASES = [(how, where) for how in ("sorted", "copied", "added") for where in ("call", "forward")]


@pytest.mark.parametrize(("how", "where"), CASES)
def test_every_batch_is_exact_or_refused_where_its_values_mix_the_examples(how, where):
    model = _build(how, where)
    engine = Engine(model, resolve_loss("cross_entropy"))
    mixed = 0
    with engine:
        for inputs, targets in _batches():
            before = model_state(model)
            if _mixes(how, inputs[0]):
                mixed += 1
                with pytest.raises(ModelError, match="mixes the examples of a batch"):
                    engine.norms(inputs, targets)
                continue
            norms = total(engine.norms(inputs, targets).norm_sq).sqrt()
            before.assert_kept(model)
            expected = reference_norms(model, inputs, targets, "cross_entropy")[1]
            assert_rel_close(norms, expected, 1e-9)
    assert (mixed > 0) == (how != "sorted")  # the batches try both ways
    findings = engine.record.at(*_batches()[0])
    if (how, where) == ("sorted", "call"):  # a routed region: the rest replayed
        assert findings.replays == BATCHES - 1


@pytest.mark.parametrize(("how", "where"), CASES)
def test_every_batch_through_a_fresh_api_call_is_exact_or_refused(how, where):
    """``per_example_norms`` called afresh on each batch (the model's record, and its programs,
    kept between the calls): exact, or refused where the batch's values mix the examples; the
    model left as it was either way."""
    model = _build(how, where)
    for inputs, targets in _batches():
        assert_fresh_norms_exact_or_refused(model, inputs, targets, _mixes(how, inputs[0]))


@pytest.mark.parametrize(("how", "where"), CASES)
def test_one_cli_run_is_exact_or_refused_in_one_line(tmp_path, how, where):
    model, batches = _build(how, where), _batches()
    torch.save(
        {"x": torch.cat([b[0][0] for b in batches]), "y": torch.cat([b[1] for b in batches])},
        tmp_path / "data.pt",
    )
    torch.save(model.state_dict(), tmp_path / "model.pt")
    (tmp_path / "models.py").write_text(
        f"from test_values import _build\n\ndef make():\n    return _build({how!r}, {where!r})\n"
    )
    sections = (
        {"factory": "models.py:make", "checkpoint": "model.pt"},
        {"path": "data.pt", "inputs": ["x"], "targets": "y", "batch_size": BATCH},
        "cross_entropy",
    )
    if how != "sorted":
        result = invoke_cli(tmp_path, *sections)
        assert result.exit_code != 0
        (line,) = [s for s in result.output.splitlines() if "mixes the examples" in s]
        assert line.startswith("error")
        return
    scores = run_cli(tmp_path, *sections)
    for k, (inputs, targets) in enumerate(batches):
        expected = reference_norms(model, inputs, targets, "cross_entropy")[1]
        got = torch.tensor(scores["grad_norm"].to_numpy()[k * BATCH : (k + 1) * BATCH])
        assert_rel_close(got, expected, 1e-9)
