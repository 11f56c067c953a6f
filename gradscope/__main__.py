"""``python -m gradscope``: the command line, as torchrun launches it (``-m gradscope``)."""

import signal
import sys


def main() -> None:
    """The command line; Ctrl-C (or SIGTERM) while it loads (torch takes seconds) is one line,
    status 130. SIGTERM ends a run as Ctrl-C does: lock released, parts kept."""
    from .errors import Interrupted, on_signal

    signal.signal(signal.SIGTERM, on_signal)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not where ignored
        signal.signal(signal.SIGINT, on_signal)

    try:
        from .cli import main as cli_main
    except KeyboardInterrupt:
        error = Interrupted(Interrupted.BEFORE_START)
        sys.stderr.write(f"error: {error}\n")
        raise SystemExit(error.exit_code) from None
    cli_main()


if __name__ == "__main__":
    main()
