"""A frozen dataclass built from a YAML mapping, its values checked against the fields' type
hints; a bad value is named by its key path, in the words ``type_name`` gives its type. And
``at_least``, the bound the sections' own checks share."""

from __future__ import annotations

import dataclasses
import reprlib
import types
from typing import Any, Union, get_args, get_origin, get_type_hints

from ..errors import ConfigError


def _shown(value: Any) -> str:
    """A value for an error message, cut short: YAML aliases can nest a few lines into megabytes."""
    shown = reprlib.Repr()
    shown.maxlevel, shown.maxlist, shown.maxdict, shown.maxstring = 3, 4, 4, 60
    return shown.repr(value)


def _type_ok(value: Any, hint: Any) -> bool:
    origin = get_origin(hint)
    if origin in (Union, types.UnionType):
        return any(_type_ok(value, h) for h in get_args(hint))
    if hint is type(None):
        return value is None
    if origin is list:
        (item,) = get_args(hint)
        return isinstance(value, list) and all(_type_ok(v, item) for v in value)
    if origin is dict:
        key, item = get_args(hint)
        return isinstance(value, dict) and all(
            _type_ok(k, key) and _type_ok(v, item) for k, v in value.items()
        )
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint in (int, str, dict, bool):
        return isinstance(value, hint) and not (hint is int and isinstance(value, bool))
    return isinstance(value, hint)


def type_name(hint: Any) -> str:
    names = {int: "an integer", float: "a number", str: "a string", bool: "true/false",
             dict: "a mapping", type(None): "null"}  # fmt: skip
    if get_origin(hint) in (Union, types.UnionType):
        return " or ".join(type_name(h) for h in get_args(hint))
    if get_origin(hint) is list:
        return f"a list of {_plural(get_args(hint)[0])}"
    if get_origin(hint) is dict:
        key, item = (_plural(h) for h in get_args(hint))
        return f"a mapping of {key} to {item}"
    return names.get(hint, getattr(hint, "__name__", str(hint)))


def _plural(hint: Any) -> str:
    """``strings``, ``lists of strings``, ``strings or lists of strings``."""
    if get_origin(hint) in (Union, types.UnionType):
        return " or ".join(_plural(h) for h in get_args(hint))
    return type_name(hint).split(" ", 1)[1].replace("list of", "lists of", 1) + (
        "" if get_origin(hint) is list else "s"
    )


def section(hint: Any) -> type | None:
    """The dataclass a key holds, also where it is optional (``TrainConfig | None``)."""
    if get_origin(hint) in (Union, types.UnionType):
        found = [h for h in get_args(hint) if dataclasses.is_dataclass(h)]
        return found[0] if found else None
    return hint if dataclasses.is_dataclass(hint) else None


def _takes_list(hint: Any) -> bool:
    if get_origin(hint) in (Union, types.UnionType):
        return any(_takes_list(h) for h in get_args(hint))
    return get_origin(hint) is list


def at_least(minimum: int, values: dict[str, int | None], source: str) -> None:
    """Each of ``{key: value}`` unset or ``minimum`` or more: the one check many keys share."""
    for key, value in values.items():
        if value is not None and value < minimum:
            raise ConfigError(f"'{key}' must be at least {minimum}, got {value}", source)


def build(cls: type, raw: Any, path: str, source: str) -> Any:
    """Build dataclass ``cls`` from a YAML mapping, naming the key path of any bad value."""
    where = path or "top level"
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be a mapping, got {type(raw).__name__}", source)
    hints = get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls) if f.name != "source"}
    unknown = sorted(set(raw) - known)
    if unknown:
        key = f"{path}.{unknown[0]}" if path else str(unknown[0])
        raise ConfigError(
            f"unknown key '{key}'; expected one of {', '.join(sorted(known))}", source
        )
    values = {}
    for f in dataclasses.fields(cls):
        if f.name == "source":
            continue
        key = f"{path}.{f.name}" if path else f.name
        if f.name not in raw:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ConfigError(f"missing required key '{key}'", source)
            continue
        value, hint = raw[f.name], hints[f.name]
        holds = section(hint)
        if holds is not None and (value is not None or holds is hint):
            values[f.name] = build(holds, value, key, source)
            continue
        if isinstance(value, str) and not _type_ok(value, hint) and _takes_list(hint):
            value = [value]  # a single name is a list of one
        item = get_args(hint)[0] if get_origin(hint) is list else None
        if dataclasses.is_dataclass(item):
            if not isinstance(value, list):
                raise ConfigError(
                    f"'{key}' must be a list of mappings, got {_shown(value)}", source
                )
            values[f.name] = [build(item, v, f"{key}[{n}]", source) for n, v in enumerate(value)]
            continue
        if not _type_ok(value, hint):
            raise ConfigError(f"'{key}' must be {type_name(hint)}, got {_shown(value)}", source)
        values[f.name] = value
    return cls(**values)
