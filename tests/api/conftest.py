"""The project the API tests run on: make_project's model and 10 rows in float64, a REF of 3
rows."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from project import make_ref_project
from running import K, N

sys.path.insert(0, str(Path(__file__).parents[1] / "validation"))  # problem.py: a retrain


@pytest.fixture
def project(tmp_path: Path) -> Path:
    return make_ref_project(tmp_path, N, K)
