"""The fenced blocks of the documentation, and how each kind is checked.

- ```console: each ``$ command`` runs in the page's sandbox and must print the lines below it
  (trailing spaces aside; a line ``...`` stands for any number of lines). ``gradscope ...`` runs
  through the typer app, ``python script.py ...`` as ``__main__``, both in this process (a
  subprocess would import torch again for each). That output is not a terminal: it is a batch
  job's log, whose first and last lines (``started``/``finished``, the time) are left out; the
  rest is what a wide terminal without colour shows (``^`` under the top-k bins, not red).
- ```pycon: a doctest, in one namespace per page, in the same sandbox after the blocks above it.
- a block titled with a file (```yaml title="configs/digits.yaml"): the file as it is.
"""

from __future__ import annotations

import contextlib
import difflib
import doctest
import io
import os
import re
import runpy
import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from typer.testing import CliRunner

from gradscope.cli import app

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^( *)```(\w*)([^\n]*)\n(.*?)^\1```$", re.M | re.S)
TITLE = re.compile(r'title="([^"]+)"')
# a batch job's log's first and last lines: the time, the folder (see gradscope/terminal.py)
TIMED = re.compile(
    r"^(started|finished|stopped) \d{4}-\d\d-\d\d \d\d:\d\d:\d\d [+-]\d{4}\b.*\n?", re.M
)
ANY_LINES = "..."


@dataclass
class Block:
    page: Path
    line: int
    lang: str
    title: str | None
    body: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    text = page.read_text()
    found = []
    for m in FENCE.finditer(text):
        indent, lang, info, body = m.groups()
        body = "".join(line[len(indent) :] for line in body.splitlines(keepends=True))
        title = TITLE.search(info)
        line = text.count("\n", 0, m.start()) + 1
        found.append(Block(page, line, lang, title[1] if title else None, body))
    return found


def sandbox(folder: Path) -> Path:
    """A folder laid out as the repository for the examples: ``examples/`` linked, ``configs/``
    copied (a config's outputs land beside its folder: here, not in the checkout)."""
    (folder / "examples").symlink_to(ROOT / "examples")
    shutil.copytree(ROOT / "configs", folder / "configs")
    return folder


def commands(body: str) -> list[tuple[str, list[str]]]:
    """``(command, expected output lines)`` of a console block; ``\\`` continues a command."""
    runs: list[tuple[str, list[str]]] = []
    lines = body.splitlines()
    while lines:
        line = lines.pop(0)
        if not line.startswith("$ "):
            raise AssertionError(f"console output before any command: {line!r}")
        command = line[2:]
        while command.endswith("\\"):
            command = command[:-1] + lines.pop(0).strip()
        output = []
        while lines and not lines[0].startswith("$ "):
            output.append(lines.pop(0))
        runs.append((command, output))
    return runs


def run(command: str, cwd: Path) -> tuple[int, str]:
    """Exit status and output (stdout and stderr) of a documented command."""
    argv = shlex.split(command)
    if argv[0] == "gradscope":
        result = CliRunner().invoke(app, argv[1:])
        if result.exception and not isinstance(result.exception, SystemExit):
            raise result.exception
        return result.exit_code, TIMED.sub("", result.output)
    if argv[0] == "python":
        out, status = io.StringIO(), 0
        saved = sys.argv
        sys.argv = argv[1:]
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                runpy.run_path(str(cwd / argv[1]), run_name="__main__")
        except SystemExit as e:
            status = e.code if isinstance(e.code, int) else 1
        finally:
            sys.argv = saved
        return status, out.getvalue()
    raise AssertionError(f"the docs tests run gradscope and python commands, not {argv[0]!r}")


def matches(expected: list[str], actual: str) -> bool:
    pattern = "".join(
        r"(?:[^\n]*\n)*?" if line == ANY_LINES else re.escape(line.rstrip()) + r"\n"
        for line in expected
    )
    text = "".join(line.rstrip() + "\n" for line in actual.splitlines())
    return re.fullmatch(pattern, text) is not None


def check_console(block: Block, cwd: Path) -> None:
    for command, expected in commands(block.body):
        status, output = run(command, cwd)
        failed = any(line.startswith("error:") for line in expected)
        diff = "\n".join(difflib.unified_diff(expected, output.splitlines(), "docs", "ran", n=1))
        assert matches(expected, output), f"{block.where}: $ {command}\n{diff}"
        assert (status != 0) == failed, f"{block.where}: $ {command} exited {status}"


def check_pycon(block: Block, namespace: dict) -> None:
    test = doctest.DocTestParser().get_doctest(
        block.body, namespace, block.where, str(block.page), block.line
    )
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    runner = doctest.DocTestRunner(optionflags=flags)
    report: list[str] = []
    runner.run(test, out=report.append, clear_globs=False)
    namespace.update(test.globs)  # DocTest ran on a copy: the page's next block sees these names
    assert not runner.failures, "".join(report)


def run_page(page: Path, folder: Path) -> int:
    """Run every console and pycon block of ``page`` in order in a sandbox; returns how many."""
    cwd, namespace, ran = sandbox(folder), {}, 0
    old = Path.cwd()
    os.chdir(cwd)
    try:
        for block in blocks(page):
            if block.lang == "console":
                check_console(block, cwd)
            elif block.lang == "pycon":
                check_pycon(block, namespace)
            else:
                continue
            ran += 1
    finally:
        os.chdir(old)
    return ran
