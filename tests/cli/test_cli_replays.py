"""Every command that runs the engine over batches replays each batch after the first of its
shape, as it runs the bundled example. A command's own reads off the forward (the predictions
its columns show) run outside the trace: read inside it, they would leave the batch without a
program, and the run would analyse every batch in full. The numbers stay exact either way; only
the run's time shows it, so this counts the passes."""

from __future__ import annotations

from pathlib import Path

import pytest
from project import count_passes
from typer.testing import CliRunner

from gradscope.cli import app

ROOT = Path(__file__).resolve().parents[2]
DIGITS = str(ROOT / "configs/digits.yaml")
# (arguments, Engines the run makes: one per checkpoint of TracIn's three)
COMMANDS = {
    "norms": (["norms", DIGITS], 1),
    "influence": (
        [
            "influence",
            str(ROOT / "configs/digits_influence.yaml"),
            "--ref",
            str(ROOT / "examples/digits/digits_ref.pt"),
            "--engine",
            "hooks",
            "--curvature",
            "none",  # the passes counted are the scoring's, not a curvature fit's
        ],
        3,
    ),
    "index": (["index", DIGITS], 1),
}
BATCHES = 4  # of the digits' 256 examples each, one shape


@pytest.mark.parametrize("command", COMMANDS)
def test_each_batch_after_the_first_replays(command: str, tmp_path: Path, monkeypatch):
    passes = count_passes(monkeypatch)
    args, engines = COMMANDS[command]
    out = tmp_path / ("digits.index" if command == "index" else "scores.parquet")
    result = CliRunner().invoke(app, [*args, "--limit", str(BATCHES * 256), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert passes == {"analysed": engines, "replayed": engines * (BATCHES - 1)}
