"""The gradscope command line: thin commands over the library, registered here in the order
``--help`` lists them, on the app that holds the one error boundary (``app.py``)."""

import sys

from .app import Logged, app
from .checking import check
from .indexing import index, query
from .reports import report, summary
from .scoring import factors, influence, norms
from .training import train
from .validation import validate

for command in (norms, influence, check, factors, index, query, summary, report, train, validate):
    app.command(cls=Logged)(command)

__all__ = ["app", "main"]


def main() -> None:
    for stream in (sys.stdout, sys.stderr):  # a locale that cannot show a character: '?', not
        if hasattr(stream, "reconfigure"):  # a traceback (the histogram's bars, a path's é)
            stream.reconfigure(errors="replace")
    app()
