"""The commit of the gradscope a benchmark measured: that of the checkout its imported package
sits in, which ``PYTHONPATH`` may make another tree than the benchmark script's own (an A/B of
two worktrees runs one tree's scripts on both packages)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import gradscope


def measured_commit() -> str:
    """``git rev-parse --short HEAD`` where the imported ``gradscope`` lives ("" outside git)."""
    return subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        cwd=Path(gradscope.__file__).resolve().parent,
    ).stdout.strip()
