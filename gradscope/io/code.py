"""The Python code a config's ``file.py:Name`` and ``package.module:Name`` specs run, as files:
what a result made from them depends on beyond the named file itself (the modules a model's
factory imports from beside it)."""

from __future__ import annotations

import os
import sys
import sysconfig
from collections.abc import Iterable

from .files import file_sha256

# where installed code lives: a package imported from there is a library, not the project's
_INSTALLED = tuple(
    os.path.realpath(sysconfig.get_paths()[k])
    for k in ("stdlib", "platstdlib", "purelib", "platlib")
)


def loaded_code(specs: Iterable[str | None]) -> dict[str, str]:
    """The sha256 of each Python file this process loaded from the folders of ``specs``'s code
    (a ``file.py``'s folder; a package's, where it is not installed), by its path there, sorted:
    load the specs' objects first (the modules they import are those found)."""
    folders = {f for f in map(_folder, specs) if f is not None}
    found: dict[str, str] = {}
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None)
        if not isinstance(file, str) or not file.endswith(".py"):
            continue
        real = os.path.realpath(file)
        for folder in folders:
            if real.startswith(folder + os.sep) and os.path.isfile(real):
                found[os.path.relpath(real, folder)] = file_sha256(real)
    return dict(sorted(found.items()))


def _folder(spec: str | None) -> str | None:
    """The folder of a spec's code: a ``file.py``'s, or an imported package's not installed."""
    if not isinstance(spec, str) or ":" not in spec:
        return None
    target = spec.rpartition(":")[0]
    if target.endswith(".py"):
        return os.path.dirname(os.path.realpath(target))
    file = getattr(sys.modules.get(target.split(".")[0]), "__file__", None)
    if not isinstance(file, str):
        return None
    folder = os.path.dirname(os.path.realpath(file))
    installed = any(folder == top or folder.startswith(top + os.sep) for top in _INSTALLED)
    return None if installed else folder
