"""The reference pages' tables, generated from the code: config keys from the config dataclasses
and their attribute docstrings, commands from the typer app, output columns from
``gradscope.columns``, tested versions from requirements.lock. Nothing here is written twice."""

from __future__ import annotations

import ast
import dataclasses
import html
import inspect
import re
import textwrap
from pathlib import Path
from typing import Any, get_args, get_origin, get_type_hints

import click
import yaml

import gradscope

ROOT = Path(__file__).resolve().parents[2]


def markdown(docstring: str) -> str:
    """A docstring's reStructuredText literals as Markdown code, on one line."""
    return " ".join(inspect.cleandoc(docstring).replace("``", "`").split())


def cell(text: str) -> str:
    """Text safe inside a Markdown table cell."""
    return text.replace("|", "\\|")


# ---------------------------------------------------------------- config keys


def field_docs(cls: type) -> dict[str, str]:
    """The attribute docstring under each field of dataclass ``cls`` (the string literal that
    follows the field, as PEP 257 and griffe read it), by field name."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    docs = {}
    for field, after in zip(body, body[1:], strict=False):
        if (
            isinstance(field, ast.AnnAssign)
            and isinstance(field.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[field.target.id] = markdown(after.value.value)
    return docs


def _keys(cls: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if f.name != "source"]  # source: not a YAML key


def _item(hint: Any) -> type | None:
    """The dataclass of a ``list[SomeConfig]`` hint, else None."""
    if get_origin(hint) is list and dataclasses.is_dataclass(get_args(hint)[0]):
        return get_args(hint)[0]
    return None


def _default_of(f: dataclasses.Field) -> Any:
    """A field's default value, or ``dataclasses.MISSING`` for a required key."""
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def config_keys(cls: type | None = None, prefix: str = "") -> list[tuple[str, Any, Any, str]]:
    """(key path, type hint, default, doc) of every key of the config file, depth first; a list
    of mappings contributes ``key[].field`` rows after its own."""
    from gradscope.config import Config
    from gradscope.config.typed import section

    cls = cls or Config
    hints, docs, rows = get_type_hints(cls), field_docs(cls), []
    for f in _keys(cls):
        key, hint = f"{prefix}{f.name}", hints[f.name]
        if section(hint):  # a section, also one that may be left out (train)
            rows += config_keys(section(hint), f"{key}.")
            continue
        rows.append((key, hint, _default_of(f), docs.get(f.name, "")))
        if _item(hint):
            rows += config_keys(_item(hint), f"{key}[].")
    return rows


def _type(hint: Any) -> str:
    from gradscope.config.typed import type_name  # the words the config's own errors use

    return "a list of mappings" if _item(hint) else type_name(hint)


def _default(value: Any) -> str:
    if value is dataclasses.MISSING:
        return "required"
    return f"`{yaml.safe_dump(value, default_flow_style=True).strip().removesuffix('...').strip()}`"


def config_reference() -> str:
    """One table per section of the config file, in the dataclasses' order."""
    from gradscope.config import Config
    from gradscope.config.typed import section as of

    sections: dict[str, list[str]] = {"": []}  # the top-level keys first
    for key, hint, default, doc in config_keys():
        section = key.split(".")[0] if "." in key else ""
        sections.setdefault(section, []).append(
            f"| `{key}` | {cell(_type(hint))} | {cell(_default(default))} | {cell(doc)} |"
        )
    hints = get_type_hints(Config)
    out = []
    for section, rows in sections.items():
        if section:
            about = markdown(of(hints[section]).__doc__ or "").split(": ", 1)[-1]
            out += [f"### `{section}`", "", about[:1].upper() + about[1:]]
        else:
            out += ["### Top-level keys", ""]
        out += ["", "| key | type | default | meaning |", "|---|---|---|---|", *rows, ""]
    return "\n".join(out)


def config_skeleton() -> str:
    """Every key of the config file with its default, as YAML (required keys marked)."""
    from gradscope.config import Config
    from gradscope.config.typed import section

    def mapping(cls: type) -> dict:
        hints, out = get_type_hints(cls), {}
        for f in _keys(cls):
            if section(hints[f.name]):
                out[f.name] = mapping(section(hints[f.name]))
            else:
                default = _default_of(f)
                out[f.name] = "REQUIRED" if default is dataclasses.MISSING else default
        return out

    text = yaml.safe_dump(mapping(Config), sort_keys=False)
    return "```yaml\n" + text + "```"


# ---------------------------------------------------------------- commands


def _metavar(param: click.Parameter) -> str:
    if param.param_type_name == "argument":
        return param.metavar or param.name.upper()
    if getattr(param, "is_flag", False):
        return ""
    return param.metavar or param.type.name.upper()


def _spelled(param: click.Parameter) -> str:
    if param.param_type_name == "argument":
        return _metavar(param)
    return " ".join(filter(None, [", ".join(param.opts), _metavar(param)]))


def _wrapped(items: list[str], indent: int, width: int = 96) -> str:
    """Items joined by spaces in lines of at most ``width``, never breaking one item."""
    lines = [items[0]]
    for item in items[1:]:
        if len(lines[-1]) + 1 + len(item) > width:
            lines.append(" " * indent + item)
        else:
            lines[-1] += " " + item
    return "\n".join(lines)


def commands() -> dict[str, click.Command]:
    """The app's commands by name, the top level under ``gradscope``."""
    from typer.main import get_command

    from gradscope.cli import app

    group = get_command(app)
    return {"gradscope": group, **group.commands}


def command_reference() -> str:
    """Per command: its synopsis, its summary and a table of its arguments and options."""
    out = []
    for name, command in commands().items():
        title = name if name == "gradscope" else f"gradscope {name}"
        synopsis = [title] + [
            _spelled(p) if getattr(p, "required", False) else f"[{_spelled(p)}]"
            for p in command.params
        ]
        usage = _wrapped(synopsis, indent=len(title) + 1)
        out += [f"### `{title}`", "", html.escape(markdown(command.help or ""), quote=False), ""]
        out += ["```", usage, "```", ""]
        out += ["| argument or option | default | meaning |", "|---|---|---|"]
        for p in command.params:
            default = p.default if p.default not in (None, False) else ""
            shown = f"`{default}`" if default != "" else ("required" if p.required else "")
            # help is plain text: grad_norm/<module> must show, not open a tag
            meaning = cell(html.escape(p.help or "", quote=False))
            out.append(f"| `{_spelled(p)}` | {cell(shown)} | {meaning} |")
        out.append("")
    return "\n".join(out)


# ---------------------------------------------------------------- output columns


def column_reference() -> str:
    from gradscope.columns import COLUMNS

    rows = [f"| `{c.name}` | {c.type} | {cell(c.written)} | {cell(c.meaning)} |" for c in COLUMNS]
    return "\n".join(["| column | type | written | meaning |", "|---|---|---|---|", *rows])


# ---------------------------------------------------------------- tested versions


def locked() -> tuple[str, dict[str, tuple[str, bool]]]:
    """The Python version requirements.lock was resolved with, and {package: (version, direct)},
    direct for gradscope's own dependencies (its extras included)."""
    text = (ROOT / "requirements.lock").read_text()
    python = re.search(r"autogenerated by pip-compile with Python (\S+)", text)
    packages = {}
    for block in re.split(r"\n(?=[A-Za-z0-9])", text):
        pin = re.match(r"([A-Za-z0-9_.-]+)==(\S+)", block)
        if pin:
            packages[pin[1]] = (pin[2], "gradscope (pyproject.toml)" in block)
    return (python[1] if python else "?"), packages


def tested_versions() -> str:
    python, packages = locked()
    rows = [f"| {name} | {version} |" for name, (version, direct) in packages.items() if direct]
    return "\n".join(
        [
            f"CI installs `requirements.lock` ({len(packages)} packages, each at one version and "
            f"hash) into a fresh environment and runs the whole suite there; the lock was "
            f"resolved with Python {python}. gradscope's own dependencies, its extras included:",
            "",
            "| package | version |",
            "|---|---|",
            *rows,
        ]
    )


# the Python API page's entries: "api-NAME" renders gradscope.api.NAME (shown as gradscope.NAME),
# "api-rules-NAME" gradscope.rules.NAME
API_ENTRIES = {
    **{f"api-{n}": f"gradscope.api.{n}" for n in gradscope.API},
    **{f"api-rules-{n}": f"gradscope.rules.{n}" for n in ("register_rule", "Dense", "Outer", "Rows")},
}  # fmt: skip


def _annotation(value: Any) -> str:
    return value if isinstance(value, str) else inspect.formatannotation(value)


def _parameters(sig: inspect.Signature) -> list[str]:
    """Each parameter as the source spells it, ``*`` before the keyword-only ones."""
    out, starred = [], False
    for p in sig.parameters.values():
        if p.kind is p.KEYWORD_ONLY and not starred:
            out.append("*")
        starred = starred or p.kind in (p.KEYWORD_ONLY, p.VAR_POSITIONAL)
        text = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "") + p.name
        if p.annotation is not p.empty:
            text += f": {_annotation(p.annotation)}"
        if p.default is not p.empty:
            text += f"{' = ' if p.annotation is not p.empty else '='}{p.default!r}"
        out.append(text)
    return out


def _signature(name: str, obj: Any) -> str:
    """``name(params) -> returns`` as the source spells it, a parameter a line when long."""
    sig = inspect.signature(obj)
    params = _parameters(sig)
    returns = (
        "" if sig.return_annotation is sig.empty else f" -> {_annotation(sig.return_annotation)}"
    )
    one = f"{name}({', '.join(params)}){returns}"
    if len(one) <= 96:
        return one
    return "\n".join([f"{name}(", *(f"    {p}," for p in params), f"){returns}"])


EXAMPLE = re.compile(r"^Example:\n((?:    .*\n?)+)", re.M)


def _prose(docstring: str | None) -> str:
    """A docstring as Markdown: its paragraphs kept, reStructuredText literals as code, its
    ``Example:`` a pycon block (which tests/docs runs as the page's other examples)."""
    text = inspect.cleandoc(docstring or "").replace("``", "`")
    return EXAMPLE.sub(
        lambda m: f"Example:\n\n```pycon\n{textwrap.dedent(m[1]).rstrip()}\n```", text
    )


def _entry(heading: str, name: str, obj: Any) -> list[str]:
    return [heading, "", "```python", _signature(name, obj), "```", "", _prose(obj.__doc__)]


def api_entry(path: str) -> str:
    """One public function or class of the API: its signature and its docstring (a class's
    public methods after it), read from the code."""
    import importlib

    module, _, name = path.rpartition(".")
    obj = getattr(importlib.import_module(module), name)
    shown = f"gradscope.{name}" if module == "gradscope.api" else path
    lines = _entry(f"### `{shown}`", name, obj)
    if inspect.isclass(obj):
        for member, value in vars(obj).items():
            if not member.startswith("_") and inspect.isfunction(value) and value.__doc__:
                lines += ["", *_entry(f"#### `{name}.{member}`", member, value)]
    return "\n".join(lines)
