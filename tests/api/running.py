"""The command line run in this process, for the API tests to compare with (a module of its own:
a test module that imported it from conftest would get another folder's conftest)."""

from __future__ import annotations

from typer.testing import CliRunner

from gradscope.cli import app

N, K = 10, 3  # examples (three batches of 4) and reference examples


def cli(*args: object) -> str:
    """``gradscope ARGS``, which must succeed; its output."""
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return result.output
