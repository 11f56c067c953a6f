"""The project the index tests run on: make_project's model in float64, and a REF of 3 rows."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from project import make_project
from runs import K, N


@pytest.fixture
def project(tmp_path: Path) -> Path:
    make_project(tmp_path, n=N, dtype="float64")
    g = torch.Generator().manual_seed(5)
    torch.save({"x": torch.randn(K, 5, generator=g), "y": torch.randint(0, 3, (K,), generator=g)},
               tmp_path / "ref.pt")  # fmt: skip
    return tmp_path
