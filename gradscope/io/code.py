"""The Python code a config's ``file.py:Name`` and ``package.module:Name`` specs run, as files:
what a result made from them depends on beyond the named file itself (the modules a model's
factory imports from beside it), found from their import statements, so that every process
finds the same (not from what a process happens to have loaded)."""

from __future__ import annotations

import ast
import importlib.util
import os
import sysconfig
from pathlib import Path
from typing import TYPE_CHECKING

from .files import file_sha256

if TYPE_CHECKING:
    from ..config import Config

# where installed code lives: a module found there is a library's, not the project's
_INSTALLED = tuple(
    os.path.realpath(sysconfig.get_paths()[k])
    for k in ("stdlib", "platstdlib", "purelib", "platlib")
)


def config_code(cfg: Config) -> dict[str, str]:
    """The sha256 of each file of ``code_files``, by its path under the folder it was found
    from."""
    return {name: file_sha256(path) for name, path in code_files(cfg).items()}


def code_files(cfg: Config) -> dict[str, str]:
    """Each Python file the config's code (its factory, a ``file.py`` data loader or loss,
    ``train.fn``) imports from beside it, transitively, by its path under the folder it was
    found from: its real path; not the ``file.py`` files the config names itself (its inputs
    hold those), a ``package.module``'s own file too."""
    paths = cfg.data.path if isinstance(cfg.data.path, list) else [cfg.data.path]
    specs = [cfg.model.factory, cfg.loss.name, cfg.train.fn if cfg.train is not None else None]
    specs += [p for p in paths if isinstance(p, str) and ".py:" in p]
    found: dict[str, str] = {}
    for spec in specs:
        start, root = _file(spec) if isinstance(spec, str) and ":" in spec else (None, "")
        if start is None:
            continue
        seen: set[str] = set()
        _imports(start, root, seen)
        named = {start} if ".py:" in spec else set()  # a package module's: no input holds it
        for file in seen - named:
            found[os.path.relpath(file, root)] = file
    return dict(sorted(found.items()))


def _file(spec: str) -> tuple[str | None, str]:
    """The file of a spec's code and the folder its absolute imports are found from: a
    ``file.py`` and its folder, or a ``package.module``'s file and the folder holding its top
    package, where it is not installed (None where it is, or is not found)."""
    target = spec.rpartition(":")[0]
    if target.endswith(".py"):
        real = os.path.realpath(target)
        return (real, os.path.dirname(real)) if os.path.isfile(real) else (None, "")
    try:
        origin = importlib.util.find_spec(target).origin  # the parent packages are imported
    except (ImportError, AttributeError, ValueError):
        return None, ""
    if not isinstance(origin, str) or not origin.endswith(".py"):
        return None, ""
    real = os.path.realpath(origin)
    if any(real.startswith(top + os.sep) for top in _INSTALLED):
        return None, ""
    root = os.path.dirname(real)  # up one folder for each package above the module
    for _ in range(target.count(".") + (os.path.basename(real) == "__init__.py")):
        root = os.path.dirname(root)
    return real, root


def _imports(file: str, root: str, seen: set[str]) -> None:
    """Add ``file`` and, transitively, the files under ``root`` its import statements name."""
    if file in seen:
        return
    seen.add(file)
    try:
        tree = ast.parse(Path(file).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return  # importing it fails the run anyway, or it is not ours to read
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names, base = [a.name for a in node.names], root
        elif isinstance(node, ast.ImportFrom):
            base = root
            if node.level:  # relative: from the file's package, levels up
                base = os.path.dirname(file)
                for _ in range(node.level - 1):
                    base = os.path.dirname(base)
            module = node.module or ""
            names = [module, *(f"{module}.{a.name}".lstrip(".") for a in node.names)]
        else:
            continue
        for name in filter(None, names):
            parts = name.split(".")
            for k in range(1, len(parts) + 1):  # a package's __init__ runs before its modules
                path = os.path.join(base, *parts[:k])
                for candidate in (path + ".py", os.path.join(path, "__init__.py")):
                    if os.path.isfile(candidate):
                        _imports(os.path.realpath(candidate), root, seen)
