"""The project the API tests run on: make_project's model and 10 rows in float64, a REF of 3 rows;
and the command line run on it, in this process."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from project import make_project
from typer.testing import CliRunner

from gradscope.cli import app

sys.path.insert(0, str(Path(__file__).parents[1] / "validation"))  # problem.py: a retrain
N, K = 10, 3  # examples (three batches of 4) and reference examples


@pytest.fixture
def project(tmp_path: Path) -> Path:
    make_project(tmp_path, n=N, dtype="float64")
    g = torch.Generator().manual_seed(5)
    torch.save({"x": torch.randn(K, 5, generator=g), "y": torch.randint(0, 3, (K,), generator=g)},
               tmp_path / "ref.pt")  # fmt: skip
    return tmp_path


def cli(*args: object) -> str:
    """``gradscope ARGS``, which must succeed; its output."""
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return result.output
