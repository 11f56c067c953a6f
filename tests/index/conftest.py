"""The project the index tests run on: make_project's model in float64, and a REF of 3 rows."""

from __future__ import annotations

from pathlib import Path

import pytest
from project import make_ref_project
from runs import K, N


@pytest.fixture
def project(tmp_path: Path) -> Path:
    return make_ref_project(tmp_path, N, K)
