"""The typer app and its one error boundary: where errors become exit codes, and the commands
that run a model log their start and end off a terminal."""

from __future__ import annotations

import os
import warnings
from contextlib import nullcontext
from typing import Annotated

import typer
from rich.console import Console
from typer.core import TyperCommand, TyperGroup

from .. import terminal
from ..errors import GradscopeError, Interrupted

# transformers, when a config names it: no "Loading weights" bar, no advice on every run
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
if not os.environ.get("GRADSCOPE_DEBUG"):  # torch's C++ log lines (c10d's retries print stacks)
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")


# commands that run a model
LOGGED = ("norms", "influence", "factors", "check", "train", "index", "query", "validate")


def _subcommands(ctx: typer.Context | None) -> list[str]:
    """The command's names after the program's, however it was run (``gradscope``, ``python -m
    gradscope``, whose program name is ``-m gradscope``)."""
    names = []
    while ctx is not None and ctx.parent is not None:
        names.append(ctx.info_name or "")
        ctx = ctx.parent
    return names[::-1]


class _ErrorBoundary(TyperGroup):
    """The one place errors become exit codes: a user-fixable error, a bad command line
    included, is one line and status 2."""

    def parse_args(self, ctx: typer.Context, args: list[str]) -> list[str]:
        ctx.meta["argv"] = list(args)  # the command line as given, for the log's first line
        return super().parse_args(ctx, args)

    def invoke(self, ctx: typer.Context):
        try:
            try:
                with warnings.catch_warnings():
                    if not os.environ.get("GRADSCOPE_DEBUG"):  # torch's, libraries': none ours
                        warnings.simplefilter("ignore")
                    return super().invoke(ctx)
            except KeyboardInterrupt:  # before any example was saved (loading the model, REF)
                raise Interrupted(Interrupted.BEFORE_START) from None
            except typer.TyperException as e:  # a missing option, an unknown one, a bad value
                if getattr(e, "exit_code", None) != 2 or not hasattr(e, "format_message"):
                    raise
                what = e.format_message().rstrip(".")
                command = " ".join(["gradscope", *_subcommands(getattr(e, "ctx", None))])
                raise GradscopeError(what[:1].lower() + what[1:], f"{command} --help") from None
        except GradscopeError as e:
            if os.environ.get("GRADSCOPE_DEBUG"):
                raise
            Console(stderr=True).print(f"error: {e}", markup=False, highlight=False, soft_wrap=True)
            raise typer.Exit(e.exit_code) from None


class Logged(TyperCommand):
    """A command; off a terminal, one that runs a model logs its start and its elapsed time,
    once its command line has parsed (not for --help, nor for a command line it refuses)."""

    def invoke(self, ctx: typer.Context):
        argv = ctx.find_root().meta.get("argv", [])
        logged = self.name in LOGGED
        with terminal.logged(argv) if logged else nullcontext():
            return super().invoke(ctx)


app = typer.Typer(
    cls=_ErrorBoundary,
    no_args_is_help=True,
    rich_markup_mode=None,  # click's help: flags shown as flags, not as <bool>
)


def _version(value: bool) -> None:
    if value:
        from .. import __version__

        terminal.console.print(f"gradscope {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="Print the version."),
    ] = False,
) -> None:
    """Per-example gradient diagnostics for PyTorch models. GRADSCOPE_DEBUG=1 shows tracebacks."""
