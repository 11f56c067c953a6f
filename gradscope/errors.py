"""Errors a user can fix: the CLI prints them as one line and exits with status 2."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


class GradscopeError(Exception):
    """Something wrong with the user's input, named with where it is (a file, key or module)."""

    exit_code = 2

    def __init__(self, what: str, where: str | None = None):
        super().__init__(what)
        self.what = what
        self.where = where

    def __str__(self) -> str:
        return f"{self.what} ({self.where})" if self.where else self.what


class ConfigError(GradscopeError):
    """A missing, malformed or invalid configuration value."""


class DataError(GradscopeError):
    """A data file that is missing, unreadable or lacks the named columns."""


class ModelError(GradscopeError):
    """A model factory, checkpoint or forward pass that does not fit."""


class Interrupted(GradscopeError):
    """Ctrl-C during a run: the finished batches are kept for ``--resume``."""

    exit_code = 130
    BEFORE_START = "interrupted before any example was saved"


def one_line(e: BaseException) -> str:
    """An exception's message on one line (library errors often span several)."""
    return " ".join(str(e).split())


@contextlib.contextmanager
def reading(source: str) -> Iterator[None]:
    """Errors about the data's columns or the loss on them (``data.targets``, ``data.inputs``,
    ``loss``) raised inside are about ``source``'s rows (REF is read with the data's names),
    and say so."""
    try:
        yield
    except GradscopeError as e:
        if e.where and e.where.startswith(("data.", "loss")):
            e.where = f"{e.where}, in {source}"
        raise
