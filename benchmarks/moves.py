"""The moves of a config's walk from ``score_dataset`` to the written file, on the bundled
example (``gradscope norms configs/digits.yaml``, the README's quick start), counted in one
process with ``sys.setprofile``:

- ``depth``: the gradscope frames on the call stack between ``score_dataset`` and
  ``pyarrow.parquet.write_table`` writing a part file (neither counted);
- ``config``: the distinct gradscope functions, called under ``score_dataset``, that take the
  config or one of its sections as an argument (``self`` included);
- ``path``: the distinct gradscope functions, called under ``score_dataset``, that take the
  output path (``output.path``, as a string or a ``Path``) as an argument.

    python benchmarks/moves.py [--root PATH]

``--root`` (default: this checkout) is the checkout whose package is imported, so that an older
commit, checked out in a worktree of its own, is measured by the same script.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import runpy
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _arguments(frame) -> list:
    code = frame.f_code
    count = code.co_argcount + code.co_kwonlyargcount
    return [frame.f_locals.get(name) for name in code.co_varnames[:count]]


class Walk:
    """The frames and functions of the walk of runs to ``out`` while the block runs, by
    gradscope's modules (those of the package imported)."""

    def __init__(self, out: str):
        import gradscope

        self.package = str(Path(gradscope.__file__).parent) + os.sep
        self.out = out
        self.depths: set[int] = set()
        self.config: set[str] = set()
        self.path: set[str] = set()

    def __enter__(self) -> Walk:
        sys.setprofile(self)
        return self

    def __exit__(self, *_) -> None:
        sys.setprofile(None)

    def _ours(self, frame) -> bool:
        return frame.f_code.co_filename.startswith(self.package)

    def _under(self, frame) -> bool:
        """Whether ``score_dataset`` is on the stack; the gradscope frames above it."""
        while frame is not None:
            if frame.f_code.co_name == "score_dataset" and self._ours(frame):
                return True
            frame = frame.f_back
        return False

    def _name(self, frame) -> str:
        module = os.path.relpath(frame.f_code.co_filename, self.package)
        return f"{module}:{frame.f_code.co_qualname}"

    def __call__(self, frame, event: str, _arg) -> None:
        if event != "call":
            return
        code = frame.f_code
        if code.co_name == "write_table" and "pyarrow" in code.co_filename:
            self._write(frame)
        if not self._ours(frame) or code.co_name == "score_dataset":
            return
        values = _arguments(frame)
        config = any(type(v).__module__.startswith("gradscope.config") for v in values)
        path = any(isinstance(v, str | Path) and str(v) == self.out for v in values)
        if (config or path) and self._under(frame.f_back):
            (self.config if config else self.path).add(self._name(frame))
            if config and path:
                self.path.add(self._name(frame))

    def _write(self, frame) -> None:
        where = frame.f_locals.get("where")
        name = getattr(where, "name", where)
        if isinstance(name, int):  # a file opened from a descriptor: its path
            name = os.readlink(f"/proc/self/fd/{name}")
        if "part-" not in str(name):
            return
        depth, up = 0, frame.f_back
        while up is not None and not (up.f_code.co_name == "score_dataset" and self._ours(up)):
            depth += self._ours(up)
            up = up.f_back
        if up is not None:
            self.depths.add(depth)


def measure(root: Path) -> Walk:
    """Run the quick start's ``norms`` with the package under ``root`` and count its moves."""
    sys.path.insert(0, str(root))  # the checkout named, not the installed one
    with tempfile.TemporaryDirectory() as folder:
        out = str(Path(folder).resolve() / "scores.parquet")
        sys.argv = ["gradscope", "norms", str(root / "configs" / "digits.yaml"), "--out", out]
        quiet = contextlib.redirect_stdout(io.StringIO())
        with Walk(out) as walk, quiet, contextlib.suppress(SystemExit):
            runpy.run_module("gradscope", run_name="__main__")
        if not Path(out).is_file():
            raise SystemExit(f"the run wrote no {out}")
    return walk


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=ROOT)
    root = parser.parse_args().root.resolve()
    import torch

    torch.set_num_threads(1)
    walk = measure(root)
    print(f"root: {root}")
    print(f"depth: {sorted(walk.depths)}")
    print(f"config: {len(walk.config)}  " + " ".join(sorted(walk.config)))
    print(f"path: {len(walk.path)}  " + " ".join(sorted(walk.path)))


if __name__ == "__main__":
    main()
