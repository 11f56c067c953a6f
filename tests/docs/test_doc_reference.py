"""The reference pages are generated from the code; these tests fail when something a user meets
has no documentation: a config key, a command, argument or option, an output column."""

from __future__ import annotations

import dataclasses
import sys

import pyarrow.parquet as pq
import pytest
import torch
from project import make_project
from snippets import ROOT
from typer.testing import CliRunner

import gradscope
from gradscope.cli import app
from gradscope.columns import COLUMNS, describe

sys.path.insert(0, str(ROOT / "docs" / "hooks"))
import benchmark_pages  # noqa: E402
import generate  # noqa: E402
import reference  # noqa: E402


@pytest.mark.parametrize("page", generate.pages(), ids=lambda p: p.name)
def test_committed_pages_hold_what_the_code_generates(page):
    """A page read as a file holds its tables, as they are now: after a change to a config key,
    an option, a column or a results file, ``python docs/hooks/generate.py`` rewrites them."""
    text = page.read_text()
    assert "<!-- end generated: " in text, f"{page}: a generated part was never rendered"
    assert generate.refresh(text) == text, (
        f"{page.relative_to(ROOT)} is stale: run python docs/hooks/generate.py"
    )


def test_every_config_key_is_documented():
    keys = reference.config_keys()
    assert {"model.factory", "data.path", "model.checkpoints[].weight", "device"} <= {
        k for k, *_ in keys
    }
    undocumented = [key for key, _, _, doc in keys if not doc]
    assert not undocumented, (
        f"config keys without a docstring in gradscope/config.py: {undocumented}"
    )


def test_every_config_section_says_what_it_is():
    from gradscope.config import Config

    sections = [f.type for f in dataclasses.fields(Config) if dataclasses.is_dataclass(f.type)]
    assert all(cls.__doc__ for cls in sections)


def test_a_field_without_a_docstring_is_found():
    @dataclasses.dataclass
    class Section:
        documented: int = 1
        """What it is."""
        bare: int = 2

    assert reference.field_docs(Section) == {"documented": "What it is."}


@pytest.mark.parametrize("name", gradscope.API)
def test_every_api_function_has_an_example_the_api_page_runs(name):
    """Its docstring's ``Example:`` is a pycon block of the API page, which
    test_doc_examples.py runs with the page's other blocks."""
    entry = reference.api_entry(f"gradscope.api.{name}")
    assert "\nExample:\n\n```pycon\n>>> " in entry, (
        f"gradscope.{name}: no Example: in its docstring"
    )
    assert entry in (ROOT / "docs" / "reference" / "api.md").read_text()


def test_an_example_section_is_a_pycon_block():
    def documented():
        """What it does.

        Example:
            >>> 1 + 1
            2
        """

    assert (
        reference._prose(documented.__doc__)
        == "What it does.\n\nExample:\n\n```pycon\n>>> 1 + 1\n2\n```"
    )


def test_every_command_option_and_argument_is_documented():
    missing = [
        f"{name} {param.name}"
        for name, command in reference.commands().items()
        for param in command.params
        if not param.help
    ]
    missing += [name for name, command in reference.commands().items() if not command.help]
    assert not missing, f"commands and options without help text: {missing}"
    assert "`--precondition FILE`" in reference.command_reference()


def _written_columns(tmp_path) -> set[str]:
    """The columns of a norms run and an influence run that between them write every kind."""
    config = make_project(
        tmp_path,
        data__ids="name",
        model={
            "factory": "model.py:Net",
            "checkpoints": [{"path": "net.pt", "weight": 1.0}, {"path": "net.pt", "weight": 0.5}],
        },
    )
    runner, names = CliRunner(), set()
    for args in (
        ["norms", str(config), "--per-layer", "--out", str(tmp_path / "n.parquet")],
        ["influence", str(config), "--ref", str(tmp_path / "data.pt"), "--per-ref",
         "--out", str(tmp_path / "i.parquet")],
    ):  # fmt: skip
        result = runner.invoke(app, args)
        assert result.exit_code == 0, result.output
        names |= set(pq.read_schema(args[-1]).names)
    return names


def test_every_output_column_is_documented_and_every_entry_is_written(tmp_path):
    written = _written_columns(tmp_path)
    assert {"grad_norm/fc1", "loss@1", "ref_id", "id", "class_z"} <= written
    missing = sorted(n for n in written if describe(n) is None)
    assert not missing, f"columns written but not described in gradscope/columns.py: {missing}"
    never = [c.name for c in COLUMNS if not any(c.matches(n) for n in written)]
    assert not never, f"columns.py describes columns no run wrote: {never}"


@pytest.mark.parametrize(("name", "entry"), [("grad_norm/net.0", "grad_norm/<module>"),
                                              ("loss@12", "loss@<k>"), ("loss", "loss")])  # fmt: skip
def test_column_families_match_their_entry(name, entry):
    assert describe(name).name == entry
    assert describe("loss@x") is None and describe("grad_norms") is None


def test_tested_versions_are_the_installed_ones():
    python, packages = reference.locked()
    assert python.startswith("3.")
    version, direct = packages["torch"]
    assert direct and version == torch.__version__
    assert f"| torch | {torch.__version__} |" in reference.tested_versions()


def test_benchmark_pages_render_every_results_file():
    files = benchmark_pages.bench_files()
    assert files, "no bench.py results in benchmarks/results"
    text = benchmark_pages.bench_results()
    for path in files:
        assert f"`{path.name}`" in text
    assert "| norms:gradscope |" in text and "| target | measured | |" in text
    assert "cases:" in benchmark_pages.harness_summary("*-hf-sweep.md")
    assert "cases:" in benchmark_pages.harness_summary("*-layers.md")


def test_a_target_names_the_workloads_that_miss_it():
    results = [
        {"workload": "W5", "method": "norms:gradscope", "time_ratio": 1.004},
        {"workload": "W5", "method": "norms:loop", "time_ratio": 1.2},
        {"workload": "W7", "method": "norms:gradscope", "time_ratio": 1.15},
        {"workload": "W7", "method": "norms:loop", "time_ratio": 1.03},
    ]
    table = benchmark_pages.targets(results)
    assert (
        "| norms ≤ 1.3× and faster than the loop on W5–W8 | W5 1.00 (loop 1.20), W7 1.15 " in table
    )
    assert table.endswith("| missed on W7 |")


def test_a_target_against_another_method_divides_by_its_time():
    """Issue 49's targets are multiples of another method on the same workload (the Linear-only
    hooks, norms), not of the floor; the methods sharing a task are named by the rest."""
    results = [
        {"workload": "H1", "method": "floor:linear hooks", "time_ratio": 1.2},
        {"workload": "H1", "method": "norms:gradscope", "time_ratio": 1.5},
        {"workload": "H1", "method": "influence:gradscope hooks", "time_ratio": 1.5},
        {"workload": "H1", "method": "influence:gradscope jvp", "time_ratio": 1.8},
    ]
    rows = benchmark_pages.targets(results).splitlines()
    hooks = next(r for r in rows if "Linear-only hooks" in r)
    assert "| H1 1.25 | missed on H1 |" in hooks  # 1.5 / 1.2
    influence = next(r for r in rows if "≤ 1.1× norms" in r)
    assert "gradscope hooks: H1 1.00; gradscope jvp: H1 1.20 | missed on H1 (gradscope jvp) |" in (
        influence
    )


def test_earlier_runs_of_a_set_are_one_line_each(tmp_path, monkeypatch):
    """The newest file of a set of workloads is shown in full, an earlier one of the same set as
    a row naming its commit and the targets it missed: the page grew by two tables a run."""
    names = ["cpu-2core-2026-12-07b-host-tiny.json", "cpu-2core-2026-12-07c-host-tiny.json"]
    for name in names:
        (tmp_path / name).write_text((benchmark_pages.RESULTS / name).read_text())
    monkeypatch.setattr(benchmark_pages, "RESULTS", tmp_path)
    text = benchmark_pages.bench_results()
    assert text.count("### `") == 1 and f"### `{names[1]}`" in text
    (row,) = [line for line in text.splitlines() if line.startswith(f"| `{names[0]}`")]
    assert row.startswith(f"| `{names[0]}` | `ece1b4c` | T1, T2, T3, T4, H1, H2, H3, H4 | ")
    assert "(issue 49): H1, H4, T1, T2, T3, T4;" in row
