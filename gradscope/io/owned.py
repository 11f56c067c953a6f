"""Whether a file at an output's path is one gradscope wrote, of the kind the run writes there:
a run replaces its own earlier output, never a file of the user's that happens to lie there
(a notes file, another tool's Parquet, a report edited by hand)."""

from __future__ import annotations

from pathlib import Path

from .parquet import METADATA_KEY

# what each kind of output is called in a refusal
KINDS = {
    "parquet": "gradscope Parquet file",
    "json": "gradscope validate JSON",
    "factors": "gradscope factors file",
    "html": "gradscope report",
}
HEAD = 512  # bytes a JSON or HTML output is told by


def written_by_gradscope(path: Path, kind: str) -> bool:
    """Whether the file ``path`` is a ``kind`` output gradscope wrote: Parquet with its metadata
    key in the footer, a factors file, a report's or validate's JSON's first bytes."""
    try:
        if kind == "parquet":
            import pyarrow.parquet as pq

            return METADATA_KEY in (pq.read_metadata(path).metadata or {})
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
