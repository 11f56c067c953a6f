"""The generated parts of the pages: between a line ``<!-- generated: NAME -->`` and the line
``<!-- end generated: NAME -->`` stands what NAME renders from the code or from
benchmarks/results/ (see reference.py and benchmark_pages.py), committed, so that a page read
as a file (on a code host, in an editor) holds its tables too.

    python docs/hooks/generate.py    # rewrite every page's generated parts; after a change

As an mkdocs hook it renders them afresh into the site; tests/docs/test_doc_reference.py fails
while a committed page differs from what its generators render now."""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # run as a script: its neighbours import
import benchmark_pages  # noqa: E402
import reference  # noqa: E402

DOCS = Path(__file__).resolve().parents[1]

GENERATORS: dict[str, Callable[[], str]] = {
    "config": reference.config_reference,
    "config-skeleton": reference.config_skeleton,
    "commands": reference.command_reference,
    "columns": reference.column_reference,
    "versions": reference.tested_versions,
    "bench": benchmark_pages.bench_results,
    "bench-gpu": lambda: benchmark_pages.bench_results("cuda"),
    "cuda-check": benchmark_pages.cuda_checks,
    "cuda-check-bf16": lambda: benchmark_pages.harness_summary("*-check-bf16.md"),
    "hf-sweep": lambda: benchmark_pages.harness_summary("*-hf-sweep.md"),
    "layers": lambda: benchmark_pages.harness_summary("*-layers.md"),
    "lds": lambda: benchmark_pages.harness_summary("lds-*.md"),
    "detection": lambda: benchmark_pages.harness_summary("*-detection.md"),
    **{
        name: (lambda path=path: reference.api_entry(path))
        for name, path in reference.API_ENTRIES.items()
    },
}
MARKER = re.compile(
    r"^<!-- generated: (?P<name>[\w-]+) -->\n(?:.*?\n)??<!-- end generated: (?P=name) -->$"
    r"|^<!-- generated: (?P<lone>[\w-]+) -->$",
    re.M | re.S,
)


def refresh(markdown: str, where: str = "page") -> str:
    """``markdown`` with each generated part rendered anew (a lone opening line gets its part
    and its closing line)."""

    def render(match: re.Match) -> str:
        name = match["name"] or match["lone"]
        if name not in GENERATORS:
            raise KeyError(f"{where}: no generator named {name!r}")
        body = GENERATORS[name]().rstrip("\n")
        return f"<!-- generated: {name} -->\n{body}\n<!-- end generated: {name} -->"

    return MARKER.sub(render, markdown)


def pages() -> list[Path]:
    """The pages that have generated parts."""
    return [p for p in sorted(DOCS.rglob("*.md")) if "<!-- generated: " in p.read_text()]


def on_page_markdown(markdown: str, page, **_) -> str:
    from mkdocs.exceptions import PluginError

    try:
        return refresh(markdown, page.file.src_uri)
    except KeyError as e:
        raise PluginError(str(e.args[0])) from None


if __name__ == "__main__":
    for path in pages():
        text = path.read_text()
        fresh = refresh(text, str(path))
        if fresh != text:
            path.write_text(fresh)
            print(f"rewrote {path.relative_to(DOCS.parent)}")
