"""The examples in README.md and docs/ run as written against the bundled examples, and every block
that shows a file shows it as it is (see snippets.py for what each kind of block must do)."""

from __future__ import annotations

import pytest
from snippets import PAGES, ROOT, blocks, run_page

RUN = [p for p in PAGES if any(b.lang in ("console", "pycon") for b in blocks(p))]
TITLED = [b for p in PAGES for b in blocks(p) if b.title]


@pytest.mark.parametrize("page", RUN, ids=lambda p: str(p.relative_to(ROOT)))
def test_page_examples_run(page, tmp_path):
    assert run_page(page, tmp_path) > 0


@pytest.mark.parametrize("block", TITLED, ids=lambda b: b.where)
def test_shown_file_is_the_file(block):
    shown = (ROOT / block.title).read_text()
    assert block.body == shown, f"{block.where} differs from {block.title}"


def test_the_readme_and_the_first_pages_have_examples_that_run():
    """A page whose blocks were all turned into plain text would pass the tests above unseen."""
    first = {"README.md", "docs/getting-started/install.md", "docs/getting-started/first-run.md"}
    assert {ROOT / page for page in first} <= set(RUN)
    assert TITLED, "no page shows a config file"
