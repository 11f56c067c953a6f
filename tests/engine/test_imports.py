"""The engine's import graph: its boxes (``analysis/``, ``replay/``, ``backward/``) and the modules
beside ``engine.py`` import one another in one direction, no circle, type-only imports included;
the analysis imports nothing of the replay; the rest of gradscope imports ``gradscope.engine``
alone. Read from the source with ``ast``, not by importing it."""

from __future__ import annotations

import ast
from pathlib import Path

import gradscope

PACKAGE = Path(gradscope.__file__).parent
ENGINE = PACKAGE / "engine"


def _module(path: Path) -> str:
    """``gradscope.engine.replay.session`` of ``.../gradscope/engine/replay/session.py``."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(path: Path) -> set[str]:
    """Every module ``path`` imports, anywhere in it (``TYPE_CHECKING`` blocks, functions)."""
    here = _module(path).split(".")
    if path.name != "__init__.py":
        here = here[:-1]  # the package the module is in
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = here[: len(here) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names)  # ``from . import x``
    return found


def _node(module: str) -> str | None:
    """The engine's part a module belongs to: its box, or the module itself beside engine.py;
    None outside the engine and for the engine's ``__init__``, which only re-exports."""
    parts = module.split(".")
    if parts[:2] != ["gradscope", "engine"] or len(parts) < 3:
        return None
    return parts[2]


def _graph() -> dict[str, set[str]]:
    """Part -> the parts it imports (a module imported by name only where it is a file)."""
    known = {_module(p) for p in ENGINE.rglob("*.py")}
    edges: dict[str, set[str]] = {}
    for path in ENGINE.rglob("*.py"):
        node = _node(_module(path))
        if node is None:
            continue
        targets = {_node(m) for m in _imported(path) if m in known}
        edges.setdefault(node, set()).update(t for t in targets if t not in (None, node))
    return edges


def _cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """A circle of imports, as the parts along it, or None."""
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [node, nxt] if nxt in path else [node, nxt]
            if nxt not in state and (found := visit(nxt, path + [node])):
                return found
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (found := visit(node, [])):
            return found
    return None


def test_the_engines_parts_import_one_another_in_one_direction():
    edges = _graph()
    assert {"analysis", "replay", "backward", "engine"} <= edges.keys()
    assert _cycle(edges) is None, " -> ".join(_cycle(edges))


def test_the_analysis_imports_nothing_of_the_replay():
    assert "replay" not in _graph()["analysis"]


def test_the_rest_of_gradscope_imports_the_engine_whole():
    known = {_module(p) for p in ENGINE.rglob("*.py")} - {"gradscope.engine"}
    inside = []
    for path in PACKAGE.rglob("*.py"):
        if ENGINE not in path.parents:
            deep = sorted(_imported(path) & known)
            inside += [f"{path.relative_to(PACKAGE)}: {m}" for m in deep]
    assert not inside, inside


def test_a_circle_is_found():
    """The check itself: a circle through three parts, and none in a chain."""
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) is not None
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
