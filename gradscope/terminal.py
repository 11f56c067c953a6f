"""What the command line prints to: the console (whole tables off a terminal) and the progress
bar; off a terminal (a batch job's log), a first and a last line and a progress line now and then."""

from __future__ import annotations

import contextlib
import os
import shlex
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    Task,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.text import Text

WIDE = 100_000  # columns of output that is not a terminal: no table is ever cut to fit
LOG_EVERY = 30.0  # seconds between progress lines off a terminal


class _Stdout:
    """``sys.stdout`` as it is at each write (a test's runner swaps it); once its reader has
    gone (``gradscope norms --report | head -3``), nothing: the run goes on to write its files
    and ends as it would have, its printed lines dropped."""

    gone = False

    def write(self, text: str) -> int:
        if not self.gone:
            try:
                return sys.stdout.write(text)
            except BrokenPipeError:
                self._gone()
        return len(text)

    def flush(self) -> None:
        if not self.gone:
            try:
                sys.stdout.flush()
            except BrokenPipeError:
                self._gone()

    def _gone(self) -> None:
        """Stdout's file made /dev/null, so that the interpreter's last flush finds no pipe."""
        self.gone = True
        with contextlib.suppress(OSError, ValueError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)

    def __getattr__(self, name: str):
        return getattr(sys.stdout, name)


console = Console(file=_Stdout())
if not console.is_terminal:  # a log, a pipe, CI: every number and name whole, not cut to 80
    console.width = WIDE


def _per_second(rate: float) -> str:
    """A rate as a person reads it: ``1,375``, ``12``, ``0.41``."""
    return f"{rate:,.0f}" if rate >= 10 else f"{rate:.2g}"


class _Rate(ProgressColumn):
    """Units (rows scored, models trained) per second."""

    def __init__(self, unit: str):
        super().__init__()
        self.unit = unit

    def render(self, task: Task) -> Text:
        speed = task.speed
        shown = f"{_per_second(speed)} {self.unit}/s" if speed else ""
        return Text(shown, style="progress.data.speed")


def _logs() -> bool:
    """Whether this process writes a log: output that is not a terminal, on rank 0."""
    from .distributed import world

    return not console.is_terminal and world().main


def duration(seconds: float) -> str:
    """``0.4 s``, ``42 s``, ``3 min 07 s``, ``2 h 05 min``."""
    if seconds < 10:
        return f"{seconds:.1f} s"
    whole = round(seconds)
    if whole < 60:
        return f"{whole} s"
    if whole < 3600:
        return f"{whole // 60} min {whole % 60:02d} s"
    return f"{whole // 3600} h {whole % 3600 // 60:02d} min"


def _now() -> str:
    return datetime.now().astimezone().strftime("%Y-%m-%d %H:%M:%S %z")


@contextmanager
def logged(argv: list[str]) -> Iterator[None]:
    """Off a terminal (a batch job's log), on rank 0: a first line with the start time, the
    command line and the working folder its paths are relative to, and a last line with the
    elapsed time, whether the command finished or stopped (its error follows on stderr)."""
    if not _logs():
        yield
        return
    console.print(f"started {_now()}: {shlex.join(['gradscope', *argv])} (in {os.getcwd()})")
    start = time.monotonic()
    try:
        yield
    except BaseException:
        console.print(f"stopped {_now()}, after {duration(time.monotonic() - start)}")
        raise
    console.print(f"finished {_now()}, in {duration(time.monotonic() - start)}")


class _LogLines:
    """Progress as a line every LOG_EVERY seconds: rows (or ``unit``), rate and time left, for
    a log."""

    def __init__(self, command: str, unit: str = "rows"):
        self.command, self.unit, self.total, self.rows = command, unit, None, 0
        self.start = self.last = time.monotonic()

    def on_start(self, total: int | None) -> None:
        self.total, self.start = total, time.monotonic()
        self.last = self.start

    def on_batch(self, rows: int) -> None:
        self.rows += rows
        now = time.monotonic()
        if now - self.last < LOG_EVERY:
            return
        self.last = now
        rate = self.rows / max(now - self.start, 1e-9)
        unit = self.unit
        if self.total:
            done = f"{self.rows:,} of {self.total:,} {unit} ({self.rows / self.total:.0%})"
        else:
            done = f"{self.rows:,} {unit}"
        line = f"{self.command}: {done} in {duration(now - self.start)}, "
        line += f"{_per_second(rate)} {unit}/s"
        if self.total and self.rows < self.total:
            line += f", about {duration((self.total - self.rows) / rate)} left"
        console.print(line)


@contextmanager
def progress(command: str, unit: str = "rows") -> Iterator[tuple[Callable, Callable]]:
    """``(on_start, on_batch)`` for a run: a bar shown once the count of rows (or ``unit``) is
    known (a running count when it cannot be), with rows/s and ETA. Under torchrun only rank 0 draws one; output
    that is not a terminal gets a progress line every LOG_EVERY seconds instead."""
    from .distributed import world

    if _logs():
        lines = _LogLines(command, unit)
        yield lines.on_start, lines.on_batch
        return
    bar = Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        _Rate(unit),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        console=console,
        transient=True,
        disable=not (world().main and console.is_terminal),
    )
    with bar:
        task = bar.add_task(command, total=None, visible=False)
        yield (
            lambda n: bar.update(task, total=n, visible=True),
            lambda n: bar.advance(task, n),
        )


def note(text: str) -> None:
    """``note: TEXT`` on stderr (rank 0 only under torchrun): what a run that goes on means."""
    from .distributed import world

    if world().main:
        Console(stderr=True).print(f"note: {text}", markup=False, highlight=False, soft_wrap=True)


def wrote(path: Path) -> None:
    """``wrote PATH``: relative to the working folder when inside it, else absolute."""
    path = Path(path).resolve()
    cwd = Path.cwd().resolve()
    console.print(f"wrote {path.relative_to(cwd) if path.is_relative_to(cwd) else path}")
