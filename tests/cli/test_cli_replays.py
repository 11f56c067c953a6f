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
BATCHES = 4  # of the digits' 256 examples each, one shape
# (arguments, {passes analysed, replayed}): influence makes an Engine per checkpoint of TracIn's
# three, each scoring the 297 reference rows first (their gradient kept as factors where that
# costs less: ``rules/factored.py``), in batches of 256 and 41: the 41 analysed, the rest replayed
COMMANDS = {
    "norms": (["norms", DIGITS], {"analysed": 1, "replayed": BATCHES - 1}),
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
        {"analysed": 3 * 2, "replayed": 3 * BATCHES},
    ),
    "index": (["index", DIGITS], {"analysed": 1, "replayed": BATCHES - 1}),
}


@pytest.mark.parametrize("command", COMMANDS)
def test_each_batch_after_the_first_replays(command: str, tmp_path: Path, monkeypatch):
    passes = count_passes(monkeypatch)
    args, counted = COMMANDS[command]
    out = tmp_path / ("digits.index" if command == "index" else "scores.parquet")
    result = CliRunner().invoke(app, [*args, "--limit", str(BATCHES * 256), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert passes == counted
