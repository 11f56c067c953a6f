"""What a run writes, whole or not at all: a file written under a temporary name of its own,
fsync'd and renamed over its path (torch is not imported here: ``summary`` writes none)."""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import DataError


def _sync_folder(folder: Path) -> None:
    """Make the renames inside ``folder`` durable (a power loss keeps them)."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_atomically(path: Path, write: Callable[[Any], None], what: str = "the scores") -> None:
    """``write(file)`` to a new temporary name of this process's own (created with ``O_EXCL`` and
    ``O_NOFOLLOW``: nothing planted in a shared folder is followed or reused), fsync, rename over
    ``path``: readers see the old file or the whole new one. A failed write (a full disk, an
    interrupt) leaves nothing."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    try:
        with os.fdopen(os.open(tmp, flags, 0o644), "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _sync_folder(path.parent)
    except OSError as e:  # pyarrow's IO errors are OSErrors too
        _discard(tmp)
        raise DataError(f"cannot write {what}: {e.strerror or e}", str(path)) from e
    except BaseException:
        _discard(tmp)
        raise


def _discard(tmp: Path) -> None:
    """Remove a temporary file, if there is one: a folder that refuses (read-only, or made so
    meanwhile) must not turn the error being reported into another one."""
    with contextlib.suppress(OSError):
        tmp.unlink(missing_ok=True)
