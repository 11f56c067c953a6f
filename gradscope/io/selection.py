"""The configured columns of a source's rows, made into a ``Batch``: each input a column, a
glob of them or a list of them stacked in order, list columns padded; every name checked once."""

from __future__ import annotations

import contextlib
import fnmatch
import functools
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ..errors import DataError, GradscopeError
from .batch import Batch, Columns
from .convert import as_tensor, check_ragged, pad_rows, row_arrays


def _ids(values: Any, name: str, start: int, where: str) -> np.ndarray:
    """The ids of a run of rows; a missing one (a null, read as NaN or None) is an error here,
    not a column of another type at assembly."""
    ids = np.asarray(values)
    if ids.ndim != 1:
        raise DataError(
            f"column {name!r} for data.ids holds {ids.shape[1:]} values a row, not one", where
        )
    if ids.dtype.kind == "f":
        missing = np.isnan(ids)
    elif ids.dtype == object:
        if any(isinstance(v, (list, tuple, np.ndarray)) for v in ids):  # a list column
            raise DataError(
                f"column {name!r} for data.ids holds a list a row, not one value", where
            )
        missing = np.array([v is None for v in ids], dtype=bool)
    else:
        return ids
    if missing.any():
        row = start + int(np.flatnonzero(missing)[0])
        raise DataError(f"column {name!r} for data.ids has no value at row {row}", where)
    return ids


def is_glob(spec: str) -> bool:
    return any(c in spec for c in "*?[")


Spec = str | tuple[str, ...]  # one input: a column, a glob, or columns stacked in order


def _label(spec: Spec) -> str:
    """A spec as the config writes it: ``'x*'``, ``['age', 'blood pressure']``."""
    return repr(spec) if isinstance(spec, str) else f"[{', '.join(map(repr, spec))}]"


class Selection:
    """Turns a source's named columns into Batch rows, checking the configured names once.

    An input given as a glob (``feature_*``) is every matching column, stacked in file order into
    one (B, K) tensor; one given as a list (``[age, blood pressure]``) is those columns (each glob
    among them expanded), stacked in that order. Columns named in ``pad`` are kept as rows until
    the batch is cut.
    """

    def __init__(
        self,
        inputs: Sequence[str | Sequence[str]] | dict[str, str | Sequence[str]],
        targets: str,
        ids: str | None,
        pad: dict[str, float] | None = None,
        pad_targets: float | None = None,
    ):
        specs = list(inputs.values()) if isinstance(inputs, dict) else list(inputs)
        self.specs: list[Spec] = [s if isinstance(s, str) else tuple(s) for s in specs]
        self.targets, self.ids, self.pad = targets, ids, dict(pad or {})
        self.pad_targets = pad_targets  # None: the targets' column's own value
        self.n_inputs, self.has_ids = len(self.specs), ids is not None
        self.matched: dict[Spec, list[str]] = {}  # stacked spec -> its columns in the first file
        self.patterns: dict[str, bool] = {}  # name -> whether it is a glob, decided once

    def _pattern(self, spec: str, available: Iterable[Any]) -> bool:
        """A spec holding ``*``, ``?`` or ``[`` is a glob, unless the first source it meets has a
        column of that very name (``x[1]``): then it names that column, in every source."""
        if spec not in self.patterns:
            self.patterns[spec] = is_glob(spec) and spec not in available
        return self.patterns[spec]

    def _stacks(self, spec: Spec, available: Iterable[Any]) -> bool:
        """Whether ``spec`` stacks columns: a glob, or a list (unless the source holds it as one
        column already: the items of a torch Dataset, by position)."""
        if isinstance(spec, tuple):
            return spec not in available
        return self._pattern(spec, available)

    def _matches(self, spec: str, available: Sequence[Any]) -> list[str]:
        others = (self.targets, self.ids)
        return [n for n in available if n not in others and fnmatch.fnmatchcase(str(n), spec)]

    def _expand(self, spec: Spec, available: Sequence[Any]) -> list[str]:
        """The columns a stacking spec takes from ``available``, in order."""
        names: list[str] = []
        for part in (spec,) if isinstance(spec, str) else spec:
            names += self._matches(part, available) if self._pattern(part, available) else [part]
        return names

    def names(self, available: Sequence[Any]) -> list[str]:
        """Every column the rows need, stacks expanded against ``available``, targets and ids
        last."""
        names: list[Any] = []
        for spec in self.specs:
            names += self._expand(spec, available) if self._stacks(spec, available) else [spec]
        return [*names, self.targets] + ([self.ids] if self.ids else [])

    def check(self, available: Iterable[str], where: str) -> None:
        available = list(available)
        listed = ", ".join(map(str, available))
        named = [(s, "data.inputs") for s in self.specs if not self._stacks(s, available)]
        for spec in self.specs:
            if not self._stacks(spec, available):
                continue
            for part in (spec,) if isinstance(spec, str) else spec:
                if self._pattern(part, available) and not self._matches(part, available):
                    raise DataError(
                        f"no column matches {part!r} for data.inputs (columns: {listed})", where
                    )
                if not self._pattern(part, available) and part not in available:
                    raise DataError(
                        f"no column {part!r} for data.inputs {_label(spec)} (columns: {listed})",
                        where,
                    )
            found = self._expand(spec, available)
            first = self.matched.setdefault(spec, found)
            if found != first:
                raise DataError(
                    f"{_label(spec)} matches {', '.join(found)} here but {', '.join(first)} in "
                    "the first file",
                    where,
                )
        named += [(self.targets, "data.targets")] + ([(self.ids, "data.ids")] if self.ids else [])
        for name, key in named:
            if name not in available:
                raise DataError(f"no column {name!r} for {key} (columns: {listed})", where)

    def stacked(self) -> str:
        """The stacked inputs and the columns each took: ``'x*' stacks 3 columns: x0, x1, x2``."""
        return "; ".join(
            f"{_label(spec)} stacks {len(names)} column{'s' * (len(names) != 1)}: "
            f"{', '.join(names)}"
            for spec, names in self.matched.items()
        )

    @contextlib.contextmanager
    def naming(self) -> Iterator[None]:
        """An error about the inputs (``where`` data.inputs: the model cannot take them) names
        the columns each stacked input took."""
        try:
            yield
        except GradscopeError as e:
            if e.where != "data.inputs" or not self.matched:
                raise
            raise type(e)(e.what, f"data.inputs: {self.stacked()}") from e

    def _column(self, columns: Columns, name: str, where: str) -> Tensor | list[np.ndarray]:
        if name in self.pad:
            return row_arrays(columns[name], name, where)
        return as_tensor(columns[name], name, where)

    def _input(self, columns: Columns, spec: Spec, where: str) -> Tensor | list[np.ndarray]:
        if not self._stacks(spec, columns):
            return self._column(columns, spec, where)
        names = self.matched[spec]
        parts = [as_tensor(columns[n], n, where) for n in names]
        if len({p.shape[1:] for p in parts}) > 1:
            shapes = ", ".join(
                f"{n} {tuple(p.shape[1:])}" for n, p in zip(names, parts, strict=True)
            )
            raise DataError(
                f"data.inputs {_label(spec)} stacks columns whose rows differ in shape: {shapes}",
                where,
            )
        dtype = functools.reduce(torch.promote_types, (p.dtype for p in parts))
        return torch.stack([p.to(dtype) for p in parts], 1)  # (B, K, ...)

    def batch(self, columns: Columns, start: int, where: str) -> Batch:
        """Rows ``start, start + 1, ...`` of the dataset from one source's ``columns``."""
        self.check(columns, where)
        names = self.names(list(columns))
        check_ragged(columns, [n for n in names if n not in self.pad and n != self.ids], where)
        inputs = tuple(self._input(columns, spec, where) for spec in self.specs)
        targets = self._column(columns, self.targets, where)
        ids = _ids(columns[self.ids], self.ids, start, where) if self.has_ids else None
        lengths = {len(t) for t in (*inputs, targets)} | ({len(ids)} if ids is not None else set())
        if len(lengths) != 1:
            raise DataError(f"columns have different numbers of rows: {sorted(lengths)}", where)
        n = lengths.pop()
        return Batch(torch.arange(start, start + n), inputs, targets, ids)

    def padded(self, batch: Batch) -> Batch:
        """The batch with each column to pad padded to its longest row."""

        def pad(values: Any, name: str, value: float | None = None) -> Tensor:
            if not isinstance(values, list):
                return values
            return pad_rows(values, self.pad[name] if value is None else value, name)

        inputs = tuple(pad(t, s) for t, s in zip(batch.inputs, self.specs, strict=True))
        targets = pad(batch.targets, self.targets, self.pad_targets)
        return replace(batch, inputs=inputs, targets=targets)
