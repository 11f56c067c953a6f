"""``python -m gradscope``: the command line, as torchrun launches it (``-m gradscope``)."""

import signal
import sys


def _terminated(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM ends a run as Ctrl-C does: lock released, parts kept


def main() -> None:
    """The command line; Ctrl-C (or SIGTERM) while it loads (torch takes seconds) is one line,
    status 130."""
    signal.signal(signal.SIGTERM, _terminated)
    from .errors import Interrupted

    try:
        from .cli import main as cli_main
    except KeyboardInterrupt:
        error = Interrupted(Interrupted.BEFORE_START)
        sys.stderr.write(f"error: {error}\n")
        raise SystemExit(error.exit_code) from None
    cli_main()


if __name__ == "__main__":
    main()
