"""The replay tests' shared fixture: which light region calls intercepted their reads."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from gradscope.engine.replay import light

sys.path.insert(0, str(Path(__file__).parents[1] / "analysis"))  # test_repeated.py: a toy


@pytest.fixture
def intercepted(monkeypatch) -> list[bool]:
    """Of each region call that ran open: whether its reads were intercepted."""
    held, closing = [], light.LightRegion.close

    def close(region):
        if region._open:
            held.append(region.intercepts)
        closing(region)

    monkeypatch.setattr(light.LightRegion, "close", close)
    return held
