"""An exclusive lock on an output path: a ``.NAME.lock`` file held with ``flock`` and naming its pid.

The kernel drops a ``flock`` when its process dies (kill -9 included), so a lock file left by a
dead run is simply taken over; the pid written inside is only there to name the holder.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from pathlib import Path
from stat import S_ISREG

from ..errors import ConfigError


def lock_path(path: str | Path) -> Path:
    """The lock file of the run that writes ``path``."""
    path = Path(path)
    return path.with_name(f".{path.name}.lock")


class OutputLock:
    """Held while a run writes ``path``; a second run on the same output is refused, naming us."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.file = lock_path(self.path)
        self._fd: int | None = None

    def __enter__(self) -> OutputLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def acquire(self) -> None:
        """Take the lock, or raise naming the pid of the run that holds it."""
        while self._fd is None:
            try:
                fd = os.open(
                    self.file, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644
                )
            except OSError as e:  # read-only, not ours, a full disk, or a symlink planted there
                planted = {errno.ELOOP: "a symbolic link", errno.EISDIR: "a folder"}
                if e.errno in planted:
                    raise _planted(self.file, planted[e.errno]) from None
                raise ConfigError(
                    f"cannot write in the output's folder: {e.strerror or e}", str(self.path.parent)
                ) from e
            stat = os.fstat(fd)
            if not S_ISREG(stat.st_mode) or stat.st_nlink != 1:  # a hard link to another file
                os.close(fd)
                raise _planted(self.file, "not a lock file of its own (a link or a device)")
            if not _lock_like(fd, stat.st_size):  # never truncated, never removed: not ours
                os.close(fd)
                raise _planted(self.file, "a file with other content (an earlier output?)")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                raise ConfigError(
                    f"another gradscope run (pid {holder}) is writing this output; wait for it "
                    "or choose another --out",
                    str(self.path),
                ) from None
            if _same_file(fd, self.file):  # not a file its last holder unlinked meanwhile
                os.ftruncate(fd, 0)
                os.write(fd, f"{os.getpid()}\n".encode())
                self._fd = fd
            else:
                os.close(fd)

    def release(self) -> None:
        if self._fd is not None:
            # before unlocking: a waiting run makes a new file; one put in its place meanwhile
            # is not ours, and a folder made read-only during the run keeps it (the kernel drops
            # the lock all the same)
            if _same_file(self._fd, self.file):
                with contextlib.suppress(OSError):
                    self.file.unlink(missing_ok=True)
            os.close(self._fd)
            self._fd = None


def _planted(file: Path, what: str) -> ConfigError:
    return ConfigError(
        f"the lock file is {what}, not one gradscope made; it is left as it is: remove it or "
        "choose another --out",
        str(file),
    )


def _lock_like(fd: int, size: int) -> bool:
    """Whether a file holds what a lock file holds: nothing yet, or its holder's pid."""
    text = os.pread(fd, 32, 0).strip() if size <= 32 else b"x"
    return not text or text.isdigit()


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False
