"""mkdocs hook: a line ``<!-- generated: NAME -->`` in a page is replaced by the table NAME
renders from the code or from benchmarks/results/ (see reference.py and benchmark_pages.py)."""

from __future__ import annotations

import re
from collections.abc import Callable

import benchmark_pages
import reference
from mkdocs.exceptions import PluginError

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
}
MARKER = re.compile(r"^<!-- generated: ([\w-]+) -->$", re.M)


def on_page_markdown(markdown: str, page, **_) -> str:
    def render(match: re.Match) -> str:
        name = match[1]
        if name not in GENERATORS:
            raise PluginError(f"{page.file.src_uri}: no generator named {name!r}")
        return GENERATORS[name]()

    return MARKER.sub(render, markdown)
