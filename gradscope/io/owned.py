"""Whether a file at an output's path is one gradscope wrote, of the kind the run writes there:
a run replaces its own earlier output, never a file of the user's that happens to lie there
(a notes file, another tool's Parquet, a report edited by hand), nor another command's (a
validate truth file, whose retrained models took hours, under ``norms --out``). An empty file
holds nothing to lose: it is replaced."""

from __future__ import annotations

import json
from pathlib import Path

from .parquet import METADATA_KEY

# what each kind of output is called in a refusal
KINDS = {
    "scores": "gradscope scores file (norms, influence)",
    "query": "gradscope query file",
    "validate": "gradscope validate table",
    "watch": "gradscope watch file",
    "json": "gradscope validate JSON",
    "factors": "gradscope factors file",
    "html": "gradscope report",
}
COMMANDS = {"scores": ("norms", "influence"), "query": ("query",), "validate": ("validate",),
            "watch": ("watch",)}  # fmt: skip
HEAD = 512  # bytes a JSON or HTML output is told by


def written_by_gradscope(path: Path, kind: str) -> bool:
    """Whether the file ``path`` is a ``kind`` output gradscope wrote (or empty): Parquet whose
    metadata names the command, a factors file, a report's or validate's JSON's first bytes."""
    try:
        if path.stat().st_size == 0:
            return True
        if kind in COMMANDS:
            return _command(path) in COMMANDS[kind]
        if kind == "factors":
            from ..curvature.store import is_factors_file

            return is_factors_file(path)
        with path.open("rb") as f:
            head = f.read(HEAD)
    except Exception:  # unreadable, or not of the format at all: not ours
        return False
    if kind == "html":
        return b"<title>gradscope " in head
    return kind == "json" and b'"command": "validate"' in head


def _command(path: Path) -> str | None:
    """The command a gradscope Parquet file's metadata names (a validate truth file: none,
    it is no table of results)."""
    import pyarrow.parquet as pq

    meta = json.loads((pq.read_metadata(path).metadata or {}).get(METADATA_KEY, b"{}"))
    return None if "identity" in meta else meta.get("command")
