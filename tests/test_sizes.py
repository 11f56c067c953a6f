"""The package read as a newcomer reads it: no module past 300 lines, no function past 60 but
those whose docstring says why they are one piece (``LONG``). Read from the source with ``ast``."""

from __future__ import annotations

import ast
from pathlib import Path

import gradscope

PACKAGE = Path(gradscope.__file__).parent
MODULE_LINES, FUNCTION_LINES = 300, 60
LONG = "One piece:"  # how a longer function's docstring begins its reason


def _too_long() -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        source, where = path.read_text(), path.relative_to(PACKAGE)
        if source.count("\n") > MODULE_LINES:
            found.append(f"{where}: {source.count(chr(10))} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > FUNCTION_LINES and LONG not in (ast.get_docstring(node) or ""):
                    found.append(f"{where}:{node.lineno} {node.name}: {lines} lines")
    return found


def test_no_module_or_function_past_its_size():
    assert not _too_long(), _too_long()
