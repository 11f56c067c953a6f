"""`gradscope norms` on models whose batch's values pick for every example, through ids the
batch's routing hit or numbers read on the host, and what Python made of them
(``analysis/hits.py``, ``routes.py``, ``readback.py``, ``tags.py``): refused in one ``error:`` line that says the examples mix, no Parquet of
numbers that are not any example's. The same model picking by each example's own value read
on the host scores every example as the per-example loop does."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import torch
from oracle import assert_rel_close, reference_norms
from project import invoke_cli, saved_model
from torch import nn

from tests.engine.analysis.test_crossed_indices import F_IN, HIT, OWN_READ, Model, T
from tests.engine.analysis.test_host_numbers import DERIVED, OWN

N, C = 9, 3  # three batches of 3, each of its own values
HELD: list[nn.Module] = []  # the model the config's factory hands the CLI


def held() -> nn.Module:
    return HELD[0]


def _norms(root: Path, op) -> tuple[object, nn.Module]:
    torch.manual_seed(0)
    HELD[:] = [Model(op).double().eval()]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N, T, F_IN, generator=g, dtype=torch.float64)
    torch.save({"x": x, "y": torch.randint(0, C, (N,), generator=g)}, root / "data.pt")
    section = saved_model(root, HELD[0], f"{__name__}:held")
    data = {"path": "data.pt", "inputs": "x", "targets": "y"}
    return invoke_cli(root, section, data, "cross_entropy", "norms"), HELD[0]


FOR_ALL = {**HIT, **{f"derived-{k}": v for k, v in DERIVED.items()}}


@pytest.mark.parametrize(
    "case",
    ["first-hit", "host-int", "host-tolist", "sum-over-hits"]
    + ["derived-item-plus-one", "derived-int-plus-one", "derived-float-scale"],
)
def test_the_batch_s_ids_or_host_reads_picking_for_all_are_refused(tmp_path: Path, case: str):
    result, _ = _norms(tmp_path, FOR_ALL[case])
    assert result.exit_code != 0, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "mixes the examples of a batch" in errors[0], result.output


def _branch_all_take(h, m):
    """A branch on the whole batch's values that each example alone takes too: its examples
    run alone up to it (``analysis/branches.py``), then scored."""
    return h * 2 if bool(h.detach().abs().sum() > 0) else h


@pytest.mark.parametrize(
    "op", [OWN_READ["item"], OWN["float-scale"], _branch_all_take], ids=["item", "float", "branch"]
)
def test_each_example_s_own_read_scores_as_the_loop(tmp_path: Path, op):
    result, model = _norms(tmp_path, op)
    assert result.exit_code == 0, result.output
    before = {k: v.clone() for k, v in model.state_dict().items()}
    got = pd.read_parquet(tmp_path / "scores.parquet")["grad_norm"].to_numpy()
    data = torch.load(tmp_path / "data.pt")
    want = reference_norms(model, (data["x"],), data["y"], "cross_entropy")[1]
    assert_rel_close(torch.tensor(got), want, 1e-9)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_a_branch_on_the_batch_s_values_is_refused(tmp_path: Path):
    """``if h[:, 0, 0].mean() > 0:`` over the whole batch, which an example alone takes the
    other way (``analysis/branches.py``): one ``error:`` line naming it, no Parquet."""

    def branch(h, m):
        return h * 2 if bool(h.detach()[:, 0, 0].mean() > 0) else h

    result, _ = _norms(tmp_path, branch)
    assert result.exit_code != 0, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "branches on a value of the whole batch" in errors[0], errors
    assert not (tmp_path / "scores.parquet").exists()
