"""The watch guide's two examples run as the guide shows them, and print what it prints."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

ROOT = Path(__file__).resolve().parents[2]
GUIDE = (ROOT / "docs" / "guides" / "watch.md").read_text()
GRADSCOPE = (sys.executable, "-m", "gradscope")


def _run(tmp_path: Path, *command: str) -> str:
    """``command`` in ``tmp_path`` with this Python, one thread; its output (it must succeed)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def _shown(line_start: str) -> str:
    """The one line of the guide that begins with ``line_start``."""
    lines = [line for line in GUIDE.splitlines() if line.startswith(line_start)]
    assert len(lines) == 1, lines
    return lines[0]


def test_the_trainer_example_writes_the_watch_file_and_its_report(tmp_path):
    pytest.importorskip("transformers")
    _run(tmp_path, sys.executable, str(ROOT / "examples" / "watch" / "tiny_gpt2.py"))
    table = pq.read_table(tmp_path / "watch.parquet").to_pydict()
    assert sorted(set(table["example_id"])) == list(range(24))
    report = _run(tmp_path, *GRADSCOPE, "report", "watch.parquet", "--top-k", "5")
    assert "wrote watch.html" in report and (tmp_path / "watch.html").is_file()


def test_the_recorded_loop_replays_to_the_guides_table(tmp_path):
    """The loop's line, and the flipped labels its replay ranks, as the guide prints them."""
    printed = _run(tmp_path, sys.executable, str(ROOT / "examples" / "watch" / "record_loop.py"))
    assert printed.strip() == _shown("36 steps;")
    _run(tmp_path, *GRADSCOPE, "influence", str(ROOT / "configs" / "digits.yaml"), "--ref",
         str(ROOT / "examples" / "digits" / "digits_ref.pt"), "--through-training",
         "digits-loop.run", "--top-k", "3", "--out", "loop.parquet")  # fmt: skip
    ranked = _run(tmp_path, sys.executable, str(ROOT / "examples" / "digits" / "flipped_rank.py"),
                  "loop.parquet", "influence:low")  # fmt: skip
    assert _shown("| `influence` (low first) |") in ranked.splitlines()
