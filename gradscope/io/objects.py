"""Rows held in Python as a ``Source``: what a ``file.py:fn`` returns or a caller passes, a dict
of columns, a DataLoader (read only where it reads its rows once, in order), a Hugging Face
``datasets.Dataset``, a map-style Dataset or an IterableDataset."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from ..errors import DataError, GradscopeError, one_line, raised
from .batch import Columns
from .model import import_object
from .selection import Selection
from .sources import Source


def collate(items: list[Any], wanted: Selection, where: str, first_row: int = 0) -> Columns:
    """Items of a torch Dataset -> columns: a dict per item, or a tuple (*inputs, target);
    ``first_row`` the first item's row, for an item that lacks a key to be named by it."""
    first, n_inputs = items[0], wanted.n_inputs
    if isinstance(first, dict):
        names = wanted.names(list(first))
        missing = [n for n in names if n not in first]
        if missing:
            raise DataError(
                f"dataset items have no key {missing[0]!r} (keys: {', '.join(map(str, first))})",
                where,
            )
        keys: list[Any] = names
    elif isinstance(first, (tuple, list)):
        if len(first) != n_inputs + 1:
            raise DataError(
                f"dataset items are tuples of {len(first)}; expected {n_inputs + 1} "
                "(the data.inputs in order, then the target) or dicts keyed by column name",
                where,
            )
        keys = list(range(n_inputs + 1))
        names = [*wanted.specs, wanted.targets]  # ids come only from dict items
    else:
        raise DataError(
            f"dataset items are {type(first).__name__}; expected dicts or tuples of tensors", where
        )
    columns: Columns = {}
    for name, key in zip(names, keys, strict=True):
        values = _values(items, key, first_row, where)
        if all(isinstance(v, (Tensor, int, float, bool)) for v in values):
            tensors = [torch.as_tensor(v) for v in values]
            if len({t.shape for t in tensors}) == 1:
                columns[name] = torch.stack(tensors)
            else:  # ragged rows (token ids): padded as a list column's are
                columns[name] = [t.numpy() for t in tensors]
        else:
            columns[name] = values
    return columns


def function_source(spec: str, columns: Selection, key: str = "data.path") -> Source:
    """``file.py:fn`` returning a dict of columns, a map-style Dataset or an IterableDataset."""
    try:
        made = import_object(spec, key)()
    except GradscopeError:
        raise
    except Exception as e:  # the function's own code: its error, on one line
        raise DataError(
            f"the data function raised {raised(e)} (GRADSCOPE_DEBUG=1 shows where)",
            key,
        ) from e
    return object_source(made, columns, spec, f"{spec} returned")


def object_source(made: Any, columns: Selection, where: str, what: str = "got") -> Source:
    """Rows held in Python: a dict of columns, a DataLoader (its batches, in order), a pandas
    DataFrame or a Hugging Face ``datasets.Dataset`` (their Arrow rows), a map-style Dataset
    or an IterableDataset.
    ``what`` begins the error that refuses anything else."""
    if isinstance(made, dict):
        odd = next((k for k, v in made.items() if not hasattr(v, "__len__")), None)
        if odd is not None:
            raise DataError(
                f"{what} a dict whose {odd!r} is not a column (a tensor, an array or a list "
                f"of rows) but of type {type(made[odd]).__name__}",
                where,
            )
        return Source(where, len(next(iter(made.values()), [])), lambda _: iter([made]))
    if isinstance(made, torch.utils.data.DataLoader):
        return _loader_source(made, columns, where)
    if type(made).__name__ == "DataFrame" and hasattr(made, "to_records"):  # pandas': a table
        return _table_rows(made, where)
    if hasattr(made, "with_format") and hasattr(made, "column_names") and hasattr(made, "__len__"):
        # a datasets.Dataset (its IterableDataset has no length: read as an iterable)
        return _arrow_rows(made, where)
    if _one_shot(made):  # "the dataset is empty" at its second read
        raise DataError(
            f"{what} an iterator (a generator), which reads its rows once; a run reads them "
            "more than once (their sha256, their scores): pass a list, a Dataset, or a function",
            where,
        )
    if isinstance(made, torch.utils.data.IterableDataset) or (
        hasattr(made, "__iter__") and not hasattr(made, "__getitem__")
    ):

        def read_iterable(rows: int) -> Iterator[Columns]:
            items: list[Any] = []
            done = 0  # rows before this batch's
            for item in made:
                items.append(item)
                if len(items) == rows:
                    yield collate(items, columns, where, done)
                    items, done = [], done + rows
            if items:
                yield collate(items, columns, where, done)

        return Source(where, None, read_iterable)  # an iterable's len() is only a hint
    if hasattr(made, "__getitem__") and hasattr(made, "__len__"):
        n = len(made)

        def read_map(rows: int) -> Iterator[Columns]:
            for lo in range(0, n, rows):
                items = [_item(made, i, n, where) for i in range(lo, min(lo + rows, n))]
                yield collate(items, columns, where, lo)

        return Source(where, n, read_map)
    raise DataError(
        f"{what} a {type(made).__name__}; expected a dict of columns, a DataLoader, "
        "a torch Dataset or an IterableDataset",
        "data.path",
    )


def _values(items: list[Any], key: Any, first_row: int, where: str) -> list[Any]:
    """Each item's value at ``key`` (a column name, or a position in a tuple)."""
    values = []
    for row, item in enumerate(items, first_row):
        try:
            values.append(item[key])
        except (KeyError, IndexError, TypeError) as e:
            raise DataError(
                f"dataset item {row} has no {key!r}, as the first item of its batch has "
                f"({raised(e)})",
                where,
            ) from e
    return values


def _item(made: Any, row: int, length: int, where: str) -> Any:
    """The dataset's item at ``row``; what its ``__getitem__`` raised, named with the row (and
    with the ``len()`` it gave, where an index past its items is the likely cause)."""
    try:
        return made[row]
    except GradscopeError:
        raise
    except Exception as e:  # the user's code: any error type
        said = f" (its len() is {length})" if isinstance(e, IndexError) else ""
        raise DataError(f"the dataset's item {row} raised {raised(e)}{said}", where) from e


def _loader_source(loader: torch.utils.data.DataLoader, columns: Selection, where: str) -> Source:
    """A DataLoader's batches as runs of rows: a dict of columns each, or a tuple (*inputs,
    target) as its dataset's items are; one that reads its dataset in order (``_in_order``)."""
    _in_order(loader, where)

    def read_loader(_: int) -> Iterator[Columns]:
        for batch in loader:
            if isinstance(batch, (tuple, list)):  # collated items: one tensor per position
                keys = [*columns.specs, columns.targets]
                if len(batch) != len(keys):
                    raise DataError(
                        f"the DataLoader's batches are tuples of {len(batch)}; expected "
                        f"{len(keys)} (the data.inputs in order, then the target) or dicts",
                        where,
                    )
                batch = dict(zip(keys, batch, strict=True))
            yield batch

    return Source(where, None, read_loader)


def _in_order(loader: torch.utils.data.DataLoader, where: str) -> None:
    """Refuse a loader that would not give each row of its dataset once, in order: any sampler
    but a sequential one (a shuffle, a random subset, weighted draws: other example_ids each
    pass, rows repeated or left out), the last batch dropped, or no batches at all. An
    IterableDataset's order is its own."""
    data = torch.utils.data
    if isinstance(loader.dataset, data.IterableDataset):
        return
    batches = loader.batch_sampler
    if batches is None:
        raise DataError(
            "the DataLoader has batch_size=None: its items are rows, not batches; pass one that "
            "batches them",
            where,
        )
    drawn = getattr(batches, "sampler", batches)
    if not isinstance(batches, data.BatchSampler) or not isinstance(drawn, data.SequentialSampler):
        raise DataError(
            f"the DataLoader draws its rows by a {type(drawn).__name__}: each pass could give "
            "them other example_ids, repeat some or leave some out; pass one that reads its "
            "dataset in order (shuffle=False, no sampler)",
            where,
        )
    if batches.drop_last:
        raise DataError(
            "the DataLoader drops its last batch (drop_last=True): those rows would go "
            "unscored; pass one with drop_last=False",
            where,
        )


def _one_shot(made: Any) -> bool:
    """Whether ``made`` is an iterator that reads its rows once (a generator, ``iter(rows)``):
    not a Dataset, which may be its own iterator and begin again at each ``iter()``."""
    if isinstance(made, torch.utils.data.Dataset) or hasattr(made, "__getitem__"):
        return False
    return hasattr(made, "__next__") and iter(made) is made


def _table_rows(frame: Any, where: str) -> Source:
    """A pandas DataFrame's rows, as its Arrow table (list columns as row arrays), as a
    Parquet file of it reads (its index left out); read as a Dataset, row i was column i."""
    import pyarrow as pa

    from .arrow import record_columns

    try:
        table = pa.Table.from_pandas(frame, preserve_index=False)
    except (pa.ArrowException, TypeError, ValueError) as e:  # a column of tensors, of objects
        raise DataError(f"the DataFrame's columns are not Arrow's: {one_line(e)}", where) from e

    def read_rows(rows: int) -> Iterator[Columns]:
        for record in table.to_batches(max_chunksize=max(1, rows)):
            yield record_columns(record)

    return Source(where, table.num_rows, read_rows, list(table.column_names))


def _arrow_rows(made: Any, where: str) -> Source:
    """A ``datasets.Dataset``'s rows in runs, read as its Arrow table (list columns as row
    arrays, as a ``save_to_disk`` folder reads)."""
    from .arrow import record_columns

    arrow, n = made.with_format("arrow"), len(made)

    def read_rows(rows: int) -> Iterator[Columns]:
        for lo in range(0, n, rows):
            for record in arrow[lo : min(lo + rows, n)].to_batches():
                yield record_columns(record)

    return Source(where, n, read_rows, list(made.column_names))
