"""A YAML file read strictly: safe tags only, no key given twice, string keys, bounded size."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from .errors import ConfigError

MAX_VALUES = 100_000  # a config holds far fewer; nested YAML aliases can expand to billions


class _Loader(yaml.SafeLoader):
    """Safe YAML that refuses a key given twice and a key that is not a string."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # <<: *anchor
                continue
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, str):
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r:.60} is not a string; quote it", key_node.start_mark
                )
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key '{key}' is given twice", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep)


def _count_values(raw: Any, source: str) -> None:
    """Refuse a config that expands (through aliases) to more than MAX_VALUES values, before
    anything copies it: each alias is walked again, so the walk stops at the limit."""
    stack, count = [raw], 0
    while stack:
        value = stack.pop()
        count += 1
        if count > MAX_VALUES:
            raise ConfigError(
                f"the config expands to more than {MAX_VALUES} values (YAML aliases nested in "
                "aliases?)",
                source,
            )
        if isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)


def read_yaml(path: Path) -> Any:
    """The YAML document in ``path``; every way it can be unreadable is a ConfigError naming the
    file (and the line, where YAML knows it)."""
    try:
        raw = yaml.load(path.read_text(encoding="utf-8"), Loader=_Loader)  # a SafeLoader
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"the config is not UTF-8 text: {e.reason} at byte {e.start}", str(path)
        ) from e
    except RecursionError as e:  # [[[[...]]]] thousands deep: PyYAML composes recursively
        raise ConfigError("the config nests too deeply to read", str(path)) from e
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}, line {mark.line + 1}" if mark else str(path)
        raise ConfigError(f"malformed YAML: {getattr(e, 'problem', e)}", where) from e
    _count_values(raw, str(path))
    return raw
