"""One self-contained HTML page from a scores file: charts, and the top-k examples shown."""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, replace
from pathlib import Path

import jinja2
import numpy as np
import pyarrow.parquet as pq

from .. import __version__
from ..config import Config
from ..errors import INDEX_FOLDER, ConfigError, DataError, check_file
from ..inputs import check_output, metadata_inputs, run_inputs
from ..io.atomic import replace_atomically
from ..io.data import data_identity
from ..io.parquet import nested, read_metadata
from ..io.scorefile import column
from ..outliers import Outliers, is_labels, rank
from ..summary import cell
from ..tables import fmt
from . import charts, datamap
from .examples import Shown, check_image_shape, check_shown, show_examples

TEMPLATE = "report.html.j2"


@dataclass(frozen=True)
class Cell:
    text: str
    sort: str  # the value the table sorts by: a number, or text


@dataclass(frozen=True)
class Row:
    cells: list[Cell]
    shown: list[Shown]


@dataclass(frozen=True)
class Section:
    """One end of the ranking as a table: its title, column names and rows."""

    title: str
    header: list[str]
    rows: list[Row]


def _cell(found: Outliers, name: str, value: object) -> Cell:
    number = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(
        value, (bool, np.bool_)
    )
    return Cell(
        cell(found, name, value),
        _sort_key(float(value)) if number else fmt(value) if value is not None else "",
    )


def _sort_key(value: float) -> str:
    """A number as the page's script reads it back: ``Infinity`` (not ``inf``), NaN empty."""
    if math.isnan(value):
        return ""
    return ("Infinity" if value > 0 else "-Infinity") if math.isinf(value) else repr(value)


def _ids(found: Outliers, scores: Path) -> list[int]:
    """The example ids of the rows shown: row numbers, else one line (text, a NaN)."""
    ids = [i for end in found.ends for i in end.rows.get("example_id", ())]
    try:
        return [operator.index(i) for i in ids]
    except TypeError:
        bad = next(i for i in ids if not isinstance(i, (int, np.integer)))
        bad = bad.item() if isinstance(bad, np.generic) else bad  # 195.0, not np.float64(...)
        raise DataError(
            f"the scores' example_id holds {bad!r}, not a row number", str(scores)
        ) from None


def _sections(found: Outliers, cfg: Config | None, ids: list[int]) -> list[Section]:
    shown = show_examples(cfg, ids) if cfg and ids else {}  # no example_id: nothing to look up
    sections = []
    for end in found.ends:
        header = list(end.rows)
        examples = end.rows.get("example_id", [None] * len(end.top))
        rows = [
            Row(
                [_cell(found, name, v) for name, v in zip(header, record, strict=True)],
                shown.get(None if example is None else int(example), []),
            )
            for example, record in zip(examples, zip(*end.rows.values(), strict=True), strict=True)
        ]
        title = f"Top {len(rows)} by {found.score}, {end.label}"
        sections.append(Section(title, header, rows))
    return sections


def _module_chart(found: Outliers) -> str | None:
    prefix = "grad_norm/"
    modules = [n for n in found.names if n.startswith(prefix)]
    if not modules:
        return None
    medians, top_medians = [], []
    for name in modules:  # one column at a time: memory stays one column wide
        values = column(found.file, name).astype(np.float64)
        medians.append(np.nanmedian(values[found.ok]) if found.ok.any() else np.nan)
        top_medians.append(np.nanmedian(values[found.top]) if len(found.top) else np.nan)
    names = [n.removeprefix(prefix) for n in modules]
    return charts.modules(names, np.array(medians), np.array(top_medians))


def _charts(found: Outliers) -> list[tuple[str, str]]:
    """(title, inline SVG) for each view the file's columns allow."""
    each = " at each end" if len(found.ends) > 1 else ""
    marked = f"top {len(found.ends[0].top)}{each} marked"
    views = [(f"{found.score}: histogram, {marked}", charts.histogram(found))]
    if is_labels(found.target):
        views.append(("per class", charts.classes(found)))
    names = ("grad_norm", "influence", "cosine")
    if set(names) <= set(found.names):
        grad_norm, influence, cosine = (column(found.file, n).astype(np.float64) for n in names)
        views.append(
            ("influence and cosine", charts.influence(grad_norm, influence, cosine, found.top))
        )
    per_module = _module_chart(found)
    if per_module is not None:
        views.append(("per module (--per-layer)", per_module))
    return views


def render(scores: Path, cfg: Config | None, by: str | None, top_k: int) -> str:
    """The report page of a scores file as HTML text."""
    found = rank(scores, by, top_k, cfg.data.classes if cfg else None)
    if not len(found.values):
        raise DataError("the scores file has no rows: nothing to report", str(scores))
    finite = found.values[found.ok]
    if len(finite) and not np.isfinite(float(finite.max()) - float(finite.min())):
        raise DataError(
            f"the {found.score} values span more than the largest float ({finite.min():.3g} to "
            f"{finite.max():.3g}): no chart can draw them; report --by another column",
            str(scores),
        )
    sections = _sections(found, cfg, _ids(found, scores))
    meta = read_metadata(scores)
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("gradscope", "report"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
    )
    return env.get_template(TEMPLATE).render(
        title=scores.name,
        command=meta.get("command") if isinstance(meta.get("command"), str) else "?",
        version=__version__,
        found=found,
        n=len(found.values),
        non_finite=int((~found.ok).sum()),
        median=fmt(found.spread.median),
        mad=fmt(found.spread.mad),
        charts=_charts(found),
        sections=sections,
        shown=cfg is not None,
    )


def check_report(cfg: Config) -> None:
    """What ``--report`` needs, checked before the run makes the scores: its page (the scores'
    path with ``.html``) another file than the scores, one it may write, and what the page
    reads back from the data (``examples.check_shown``)."""
    scores = Path(cfg.output.path)
    if scores.suffix == ".html":
        raise ConfigError(
            "--report writes its page beside the scores, as .html: give the scores' output "
            "another suffix (.parquet)",
            str(scores),
        )
    check_output(scores.with_suffix(".html"), run_inputs(cfg), "html")
    check_shown(cfg)


def write_report(
    scores: str | Path,
    out: str | Path | None = None,
    cfg: Config | None = None,
    by: str | None = None,
    top_k: int = 20,
) -> Path:
    """Write the report of ``scores`` to ``out`` (default: beside it, ``.html``); returns ``out``.

    With ``cfg`` (the config that scored the file), the top-k examples are read back from its
    data and shown.
    """
    scores = Path(scores)
    check_file(scores, "scores file", DataError, INDEX_FOLDER)
    target = Path(out) if out is not None else scores.with_suffix(".html")
    meta = read_metadata(scores)
    inputs = [("scores file", str(scores)), *metadata_inputs(meta)]
    check_output(target, inputs + (run_inputs(cfg) if cfg else []), "html", recorded=meta)
    watched = meta.get("command") == "watch"  # a training run watched: its data map
    if watched and (by is not None or cfg is not None):
        option = "--by" if by is not None else "--config"
        raise ConfigError(f"a watch file's page is its data map, which reads no {option}", option)
    scored = meta.get("data_sha256")
    limit = nested(meta, "config", "data", "limit")  # the rows scored (data made by code); a
    if meta.get("command") == "query":  # query's are its index's (built with its own --limit)
        limit = meta.get("index_rows")
    limit = limit if isinstance(limit, int) and not isinstance(limit, bool) else None
    if cfg and not isinstance(scored, str):
        raise DataError(
            "the scores file records no data_sha256 (written by another tool, or by an older "
            "gradscope): the examples shown could be other rows than the ones scored; leave "
            "--config out",
            str(scores),
        )
    if cfg and scored != data_identity(replace(cfg.data, limit=limit)):
        raise DataError(
            "the data changed since it was scored (its sha256 differs from the one the scores "
            "file records): the examples shown would not be the ones scored; score it again",
            str(cfg.data.path),
        )
    if cfg and "example_id" not in pq.read_schema(scores).names:
        raise DataError(
            "the scores file has no example_id column (did another tool drop it?): --config "
            "cannot find the examples to show; restore it, or leave --config out",
            str(scores),
        )
    if cfg:  # (the tokenizer and data.show fail as the examples are read)
        check_image_shape(cfg)
    if watched:
        page = datamap.render(scores, meta, __version__, top_k).encode("utf-8")
    else:
        page = render(scores, cfg, by, top_k).encode("utf-8")
    replace_atomically(target, lambda f: f.write(page), "the report")
    return target
