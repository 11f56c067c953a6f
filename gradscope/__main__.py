"""``python -m gradscope``: the command line, as torchrun launches it (``-m gradscope``)."""

from .cli import main

if __name__ == "__main__":
    main()
