"""What the command line prints to: the console (whole tables off a terminal) and the progress bar."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
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

console = Console()
if not console.is_terminal:  # a log, a pipe, CI: every number and name whole, not cut to 80
    console.width = WIDE


class _Rate(ProgressColumn):
    """Rows scored per second."""

    def render(self, task: Task) -> Text:
        return Text(f"{task.speed:,.0f} rows/s" if task.speed else "", style="progress.data.speed")


@contextmanager
def progress(command: str) -> Iterator[tuple[Callable, Callable]]:
    """``(on_start, on_batch)`` for a run: a bar shown once the row count is known (a running
    count when it cannot be), with rows/s and ETA. Under torchrun only rank 0 draws one, and output
    that is not a terminal gets none."""
    from .distributed import world

    bar = Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        _Rate(),
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


def wrote(path: Path) -> None:
    """``wrote PATH``: relative to the working folder when inside it, else absolute."""
    path = Path(path).resolve()
    cwd = Path.cwd().resolve()
    console.print(f"wrote {path.relative_to(cwd) if path.is_relative_to(cwd) else path}")
