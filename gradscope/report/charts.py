"""The report's charts, drawn by matplotlib as inline SVG: no pyplot state, no files, no fonts."""

from __future__ import annotations

import io
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
from matplotlib import rc_context
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter

from ..outliers import Outliers, per_class

BINS = 60
# a scatter draws at most this many of the ordinary rows, as a raster; a box plot of more rows
# draws its outliers as one (100k rows of a heavy tail: 1.5 MB of markers otherwise)
MAX_POINTS = 20_000
TOP = "#d62728"  # the top-k rows, in every chart
REST = "#1f77b4"
# text as written: a module named "a$b$" is not TeX (parse_math off); the same ids in each run
# of the same scores (a clip path's are salted at random otherwise)
STYLE = {"svg.fonttype": "none", "font.size": 9, "axes.spines.top": False,
         "axes.spines.right": False, "text.parse_math": False,
         "svg.hashsalt": "gradscope"}  # fmt: skip


@contextmanager
def _figure(width: float, height: float, rows: int = 1) -> Iterator[tuple[Figure, list[Axes]]]:
    with rc_context(STYLE):
        figure = Figure(figsize=(width, height), layout="constrained")
        yield figure, list(np.atleast_1d(figure.subplots(rows, 1)))


def _svg(figure: Figure) -> str:
    buffer = io.StringIO()
    with rc_context(STYLE):
        figure.savefig(buffer, format="svg", metadata={"Date": None})  # the same page each run
    text = buffer.getvalue()
    return text[text.index("<svg") :]  # inline: without the XML prolog and doctype


def histogram(found: Outliers) -> str:
    """The score's histogram, with each top-k row marked by a red tick under the bars."""
    with _figure(7, 2.2) as (figure, (ax,)):
        finite = found.values[found.ok]
        ax.hist(finite, bins=BINS, color=REST, log=len(finite) > 0)  # no log axis with no bars
        top = found.values[found.top]
        ax.plot(top, np.zeros_like(top), "|", color=TOP, markersize=14, mew=1.5, clip_on=False,
                transform=ax.get_xaxis_transform(),
                label=f"top {len(top)} row{'' if len(top) == 1 else 's'}")  # fmt: skip
        # counts as plain numbers: the default log labels are TeX (``$10^{2}$``), which
        # svg.fonttype none with parse_math off writes out as the raw string
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.set_xlabel(found.score)
        ax.set_ylabel("examples (log)")
        ax.legend(frameon=False, loc="upper right")
    return _svg(figure)


def classes(found: Outliers) -> str:
    """Per class: a box plot of the score (outliers drawn), and each class's share of the top-k
    of each end."""
    assert found.target is not None
    table = per_class(found)
    labels = table["target"].tolist()
    with _figure(7, 4.2, rows=2) as (figure, (box, share)):
        groups = [
            found.values[(found.target == label) & found.ok] for label in np.unique(found.target)
        ]
        many = sum(len(g) for g in groups) > MAX_POINTS
        fliers = {"markersize": 3, "alpha": 0.5, "rasterized": many}
        box.boxplot(groups, tick_labels=labels, flierprops=fliers)
        box.set_ylabel(found.score)
        shares = [c for c in table if c.startswith("share of ")]
        width = 0.8 / len(shares)
        x = np.arange(len(labels))
        for i, (name, color) in enumerate(zip(shares, (TOP, REST), strict=False)):
            offset = (i - (len(shares) - 1) / 2) * width
            share.bar(x + offset, 100 * table[name], width, color=color, label=name)
        share.set_xticks(x, labels)
        share.set_ylabel("% of the top rows")
        share.set_xlabel("target")
        if len(shares) > 1:
            share.legend(frameon=False)
    return _svg(figure)


def modules(names: list[str], medians: np.ndarray, top_medians: np.ndarray) -> str:
    """Per module (``--per-layer``): median grad_norm over all rows and over the top-k rows."""
    y = np.arange(len(names))
    with _figure(7, 0.9 + 0.28 * len(names)) as (figure, (ax,)):
        ax.barh(y - 0.2, medians, height=0.4, color=REST, label="all rows")
        ax.barh(y + 0.2, top_medians, height=0.4, color=TOP, label="top-k rows")
        ax.set_yticks(y, names)
        ax.invert_yaxis()
        ax.set_xlabel("median grad_norm of the module")
        ax.legend(frameon=False, loc="lower right")
    return _svg(figure)


def influence(grad_norm: np.ndarray, score: np.ndarray, cosine: np.ndarray, top: np.ndarray) -> str:
    """Influence files: influence against grad_norm (top-k in red), and the cosines' histogram."""
    rest = np.setdiff1d(np.flatnonzero(np.isfinite(score)), top)
    if len(rest) > MAX_POINTS:
        rest = np.random.default_rng(0).choice(rest, MAX_POINTS, replace=False)
    with _figure(7, 5, rows=2) as (figure, (scatter, hist)):
        scatter.scatter(grad_norm[rest], score[rest], s=4, color=REST, rasterized=True)
        scatter.scatter(grad_norm[top], score[top], s=12, color=TOP, label="top-k")
        scatter.axhline(0, color="grey", lw=0.5)
        scatter.set_xlabel("grad_norm")
        scatter.set_ylabel("influence")
        scatter.legend(frameon=False)
        hist.hist(cosine[np.isfinite(cosine)], bins=BINS, color=REST)
        hist.set_xlabel("cosine (gradient against the reference gradient)")
        hist.set_ylabel("rows")
    return _svg(figure)
