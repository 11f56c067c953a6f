"""The configured columns of a run of rows, made into batches: globs stacked, list columns padded."""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import itertools
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ..errors import DataError, GradscopeError, one_line

Columns = dict[str, Any]  # name -> tensor, array or list, for a run of consecutive rows


@dataclass
class Batch:
    """One batch: ``index`` holds each row's 0-based position in the dataset.

    Columns named in ``data.pad`` stay lists of row arrays until the batch is cut, then are padded.
    """

    index: Tensor  # (B,) int64
    inputs: tuple[Tensor, ...]
    targets: Tensor
    ids: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.index)


def _as_tensor(values: Any, name: str, where: str) -> Tensor:
    if isinstance(values, Tensor):
        return values
    array = np.asarray(values)
    if array.dtype == object:
        try:  # a column of equal-length lists (Parquet list<...>)
            array = np.stack([np.asarray(v) for v in array])
        except ValueError as e:
            raise DataError(
                f"column {name!r} holds lists of different lengths; set data.pad.{name} to pad "
                "them per batch",
                where,
            ) from e
    if array.dtype.kind not in "biuf":
        raise DataError(f"column {name!r} is {array.dtype}, not numbers", where)
    if not array.flags.writeable:  # Arrow's zero-copy buffers; torch wants memory it may write
        array = array.copy()
    return torch.from_numpy(np.ascontiguousarray(array))


def _is_ragged(values: Any) -> bool:
    """Whether a column holds lists of different lengths (an object array or a Python list)."""
    if isinstance(values, Tensor) or (isinstance(values, np.ndarray) and values.dtype != object):
        return False
    try:
        return len({len(v) for v in values}) > 1
    except TypeError:  # scalars: not lists
        return False


def _check_ragged(columns: Columns, names: list[str], where: str) -> None:
    """Every ragged column without a pad value named in one error, not one run at a time."""
    ragged = [n for n in dict.fromkeys(names) if _is_ragged(columns[n])]
    if not ragged:
        return
    listed = " and ".join(", ".join(repr(n) for n in ragged).rsplit(", ", 1))
    keys = " and ".join(", ".join(f"data.pad.{n}" for n in ragged).rsplit(", ", 1))
    what = "column" if len(ragged) == 1 else "columns"
    holds = "holds" if len(ragged) == 1 else "hold"
    raise DataError(
        f"{what} {listed} {holds} lists of different lengths; set {keys} to pad them per batch",
        where,
    )


def _rows(values: Any, name: str, where: str) -> list[np.ndarray]:
    """A column to pad, as one array per row (a list column read from Arrow, or a tensor)."""
    rows = [np.asarray(v) for v in values]
    for row in rows:
        if row.dtype.kind not in "biuf" or row.ndim == 0:
            raise DataError(
                f"column {name!r} is in data.pad but does not hold lists of numbers", where
            )
    return rows


def _padded(rows: list[np.ndarray], value: float, name: str) -> Tensor:
    """(B, T, ...) with each row's (T_i, ...) values first and ``value`` after, T the longest."""
    dtype = functools.reduce(np.promote_types, {r.dtype for r in rows})
    if dtype.kind in "biu":
        dtype = np.dtype(
            np.int64
        )  # token ids and masks (datasets stores int32, int8): torch's index type
    if dtype.kind in "biu" and value != int(value):
        raise DataError(
            f"column {name!r} holds integers; its pad value {value} is not one", "data.pad"
        )
    tails = {r.shape[1:] for r in rows}
    if len(tails) > 1:
        raise DataError(
            f"column {name!r} holds rows of shapes {sorted(tails)} after the first dim", "data.pad"
        )
    out = np.full((len(rows), max(len(r) for r in rows), *tails.pop()), value, dtype=dtype)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return torch.from_numpy(out)


def _join(parts: list[Any]) -> Any:
    """Tensors concatenated along rows; rows of a column to pad, one list."""
    if isinstance(parts[0], list):
        return list(itertools.chain.from_iterable(parts))
    return torch.cat(parts)


def _cat(parts: list[Batch]) -> Batch:
    if len(parts) == 1:
        return parts[0]
    try:
        return Batch(
            index=torch.cat([p.index for p in parts]),
            inputs=tuple(_join(list(ts)) for ts in zip(*(p.inputs for p in parts), strict=True)),
            targets=_join([p.targets for p in parts]),
            ids=None if parts[0].ids is None else np.concatenate([p.ids for p in parts]),
        )
    except (RuntimeError, ValueError) as e:  # shards whose rows differ in shape or kind
        raise DataError(
            f"row {int(parts[-1].index[0])} and the rows before it do not fit one batch: the "
            f"shards' columns differ in shape ({one_line(e)})",
            "data.path",
        ) from e


def _slice(batch: Batch, lo: int, hi: int) -> Batch:
    return Batch(
        index=batch.index[lo:hi],
        inputs=tuple(t[lo:hi] for t in batch.inputs),
        targets=batch.targets[lo:hi],
        ids=None if batch.ids is None else batch.ids[lo:hi],
    )


def take(batch: Batch, rows: Tensor) -> Batch:
    """The batch's rows at positions ``rows`` (0-based within the batch), in that order."""
    picked = rows.tolist()

    def pick(values: Any) -> Any:
        return [values[i] for i in picked] if isinstance(values, list) else values[rows]

    return Batch(
        index=batch.index[rows],
        inputs=tuple(pick(t) for t in batch.inputs),
        targets=pick(batch.targets),
        ids=None if batch.ids is None else batch.ids[rows.numpy()],
    )


def rebatch(chunks: Iterable[Batch], batch_size: int, limit: int | None) -> Iterator[Batch]:
    """Cut runs of rows of any length into batches of ``batch_size``; stop reading at ``limit``."""
    pending: list[Batch] = []
    rows = 0  # in pending
    seen = 0  # rows taken from the source so far
    for chunk in chunks:
        if limit is not None and seen + len(chunk) > limit:
            chunk = _slice(chunk, 0, limit - seen)
        seen += len(chunk)
        pending.append(chunk)
        rows += len(chunk)
        while rows >= batch_size:
            whole = _cat(pending)
            yield _slice(whole, 0, batch_size)
            pending = [_slice(whole, batch_size, rows)] if rows > batch_size else []
            rows -= batch_size
        if limit is not None and seen >= limit:
            break
    if rows:
        yield _cat(pending)


def _ids(values: Any, name: str, start: int, where: str) -> np.ndarray:
    """The ids of a run of rows; a missing one (a null, read as NaN or None) is an error here,
    not a column of another type at assembly."""
    ids = np.asarray(values)
    if ids.dtype.kind == "f":
        missing = np.isnan(ids)
    elif ids.dtype == object:
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
    ):
        specs = list(inputs.values()) if isinstance(inputs, dict) else list(inputs)
        self.specs: list[Spec] = [s if isinstance(s, str) else tuple(s) for s in specs]
        self.targets, self.ids, self.pad = targets, ids, dict(pad or {})
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
            return _rows(columns[name], name, where)
        return _as_tensor(columns[name], name, where)

    def _input(self, columns: Columns, spec: Spec, where: str) -> Tensor | list[np.ndarray]:
        if not self._stacks(spec, columns):
            return self._column(columns, spec, where)
        names = self.matched[spec]
        parts = [_as_tensor(columns[n], n, where) for n in names]
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
        _check_ragged(columns, [n for n in names if n not in self.pad and n != self.ids], where)
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

        def pad(values: Any, name: str) -> Tensor:
            return _padded(values, self.pad[name], name) if isinstance(values, list) else values

        inputs = tuple(pad(t, s) for t, s in zip(batch.inputs, self.specs, strict=True))
        return replace(batch, inputs=inputs, targets=pad(batch.targets, self.targets))
