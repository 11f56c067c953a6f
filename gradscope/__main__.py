"""``python -m gradscope``: the command line, as torchrun launches it (``-m gradscope``)."""

import sys


def main() -> None:
    """The command line; Ctrl-C while it loads (torch takes seconds) is one line, status 130."""
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
