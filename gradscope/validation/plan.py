"""Which models a validation needs: each subset under each seed (the datamodel's ground truth)
and, for the removal test, the whole data and each reference's rows removed, top-K and at
random, under each seed."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .scores import ScoreFile
from .truth import RULE, Task, Truth, random_removal, subsets

SUBSETS, FRACTION, SEEDS = 100, 0.5, 1  # the field's defaults (dattri's LDS): see the guide


@dataclass(frozen=True)
class Design:
    """The ground truth's subsets: ``count`` subsets of ``fraction`` of the rows, each trained
    under ``seeds`` seeds ``train.seed + s``."""

    count: int
    fraction: float
    seeds: int

    def describe(self, rows: int) -> dict:
        size = round(self.fraction * rows)
        return {"subsets": self.count, "fraction": self.fraction, "size": size,
                "seeds": self.seeds, "rule": RULE}  # fmt: skip


def seeds(base: int, count: int) -> list[int]:
    """The seeds every subset (and every removal) is trained under: the same for all, so that
    the seeds' noise does not correlate with the subsets."""
    return [base + s for s in range(count)]


def subset_tasks(design: Design, base: int, rows: int, truth: Truth) -> list[Task]:
    """Each subset under each seed: the truth's own subsets when it has them, else drawn."""
    held = {m.task.subset: m.task.rows for m in truth.models if m.task.kind == "subset"}
    drawn = (
        [held[m] for m in range(design.count)]
        if len(held) >= design.count
        else subsets(base, rows, design.fraction, design.count)
    )
    return [
        Task("subset", m, -1, seed, kept)
        for m, kept in enumerate(drawn)
        for seed in seeds(base, design.seeds)
    ]


def removal_refs(file: ScoreFile, refs: int) -> list[int]:
    """The references a file's removal test runs on: the first ``refs`` of a per-ref file's;
    -1, the mean over REF, for a file scored against it."""
    return list(range(min(refs, file.refs))) if file.per_ref else [-1]


def top_rows(scores: np.ndarray, k: int) -> np.ndarray:
    """(N,) scores -> the ``k`` rows that help most (the largest scores), lowest row first on
    ties."""
    return np.sort(np.argsort(-scores, kind="stable")[:k])


def kept(rows: int, dropped: np.ndarray) -> np.ndarray:
    return np.setdiff1d(np.arange(rows), dropped)


def removal_tasks(
    file: ScoreFile, column: str, k: int, refs: int, base: int, count: int, rows: int
) -> list[Task]:
    """The full model, and for each reference its top-``k`` rows by ``column`` and ``k`` random
    rows removed, each under ``count`` seeds."""
    tasks = [Task("full", -1, -1, s, np.arange(rows)) for s in seeds(base, count)]
    for r in removal_refs(file, refs):
        top = top_rows(file.columns[column][max(r, 0)], k)
        for s in seeds(base, count):
            tasks.append(Task("removed", -1, r, s, kept(rows, top)))
            tasks.append(Task("random", -1, r, s, kept(rows, random_removal(base, rows, k, r))))
    return tasks
