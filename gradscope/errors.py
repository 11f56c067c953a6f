"""Errors a user can fix: the CLI prints them as one line and exits with status 2."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType

_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


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


class RecordWarning(UserWarning):
    """A watched run's record that ``influence --through-training`` will refuse to replay, told
    as the run goes on (the watch file is unaffected), so that the training is not redone
    to learn it."""


class Interrupted(GradscopeError):
    """Ctrl-C during a run: the finished batches are kept for ``--resume``."""

    exit_code = 130
    BEFORE_START = "interrupted before any example was saved"


_signalled = False  # SIGTERM or Ctrl-C arrived: see ``on_signal``


def on_signal(signum: int, frame: object) -> None:
    """SIGTERM or Ctrl-C: a KeyboardInterrupt now, and remembered. Torch turns one raised
    inside an op it runs through TorchScript (a decomposition under ``torch.func``, a user's
    scripted function) into a RuntimeError, which a handler of the model's failures would
    take for the model's: ``stop_if_signalled`` raises it again there."""
    global _signalled
    _signalled = True
    raise KeyboardInterrupt


def stop_if_signalled() -> None:
    """The KeyboardInterrupt of a signal that torch may have turned into another error."""
    global _signalled
    if _signalled:
        _signalled = False
        raise KeyboardInterrupt


# what a folder given for a scores file may be
INDEX_FOLDER = " (an index folder is read by gradscope query, which writes a scores file)"


def check_file(path: str | Path, what: str, error: type[GradscopeError], folder: str = "") -> None:
    """``path`` must be a file: one line saying ``what`` is missing, or is a folder (then
    ``folder``, what such a folder may be, follows)."""
    if Path(path).is_file():
        return
    if Path(path).is_dir():
        raise error(f"{what} is a folder, not a file{folder}", str(path))
    raise error(f"{what} not found", str(path))


def one_line(e: BaseException) -> str:
    """An exception's message on one line (library errors often span several)."""
    return " ".join(str(e).split())


def raised(e: BaseException) -> str:
    """What an exception of the user's code or a library said: its type, then its message on
    one line where it has one (``KeyError: 'y'``; an ``EOFError`` of none, its type alone)."""
    text = one_line(e)
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


@contextlib.contextmanager
def models_backward() -> Iterator[None]:
    """A backward through the model: an error that the model's own code or torch raises in it
    (a custom autograd function's; ``torch.utils.checkpoint`` with ``use_reentrant=True``,
    which ``autograd.grad`` cannot run through) as one line naming it. One raised in
    gradscope's own code, whose hooks run inside the backward, goes on as it is."""
    try:
        yield
    except GradscopeError:
        raise
    except Exception as e:
        stop_if_signalled()
        if _ours(e.__traceback__):
            raise
        raise ModelError(_backward_reason(e), "model") from e


def _backward_reason(e: Exception) -> str:
    """What the model's backward raised, on one line; a checkpoint's recompute that saw other
    tensors (torch's tips after it left out) with the likely cause."""
    if type(e).__name__ != "CheckpointError" or "different metadata" not in str(e):
        return f"the model's backward raised {raised(e)}"
    return (
        f"the model's backward raised CheckpointError: {one_line(str(e).split('Tip:')[0])} A "
        "parameter read directly inside a non-reentrant torch.utils.checkpoint block (as in "
        "x * self.scale) is read per example in gradscope's forward, not in the block's "
        "recompute: read it outside the block, or checkpoint with use_reentrant=True"
    )


def _ours(tb: TracebackType | None) -> bool:
    """Whether a frame of gradscope's runs inside the call the traceback begins in (its first
    frames, up to the call into torch, are the caller's)."""
    while tb is not None and _in_package(tb):
        tb = tb.tb_next
    while tb is not None and not _in_package(tb):
        tb = tb.tb_next
    return tb is not None


def _in_package(tb: TracebackType) -> bool:
    return tb.tb_frame.f_code.co_filename.startswith(_PACKAGE)


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
