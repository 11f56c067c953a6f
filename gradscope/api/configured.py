"""What one API call runs on: a config (a ``Config``, or a YAML file's path), with the model,
data and references the caller holds named in it and the config's keys given as keywords on
top; the command line runs on the same config, read from its file."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import re
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch
from torch import nn

from ..config import Config, config_from_dict, load_config, output_path, padded_by_default
from ..config.load import resolve
from ..errors import ConfigError, GradscopeError, Interrupted
from ..io.held import holding

if TYPE_CHECKING:
    from ..curvature import Factors

# the keyword each config key is given by: its own name, but for the three that other
# sections share a name with (loss.name, model.output, loss.kwargs)
KEYS = {
    "batch_size": ("data", "batch_size"),
    "limit": ("data", "limit"),
    "inputs": ("data", "inputs"),
    "targets": ("data", "targets"),
    "ids": ("data", "ids"),
    "pad": ("data", "pad"),
    "show": ("data", "show"),
    "classes": ("data", "classes"),
    "loss": ("loss", "name"),
    "loss_kwargs": ("loss", "kwargs"),
    "class_dim": ("loss", "class_dim"),
    "token_reduction": ("loss", "token_reduction"),
    "include": ("params", "include"),
    "exclude": ("params", "exclude"),
    "output": ("model", "output"),
    "per_layer": ("output", "per_layer"),
    "metadata": ("output", "metadata"),
    "top_k": ("summary", "top_k"),
    "device": (None, "device"),
    "dtype": (None, "dtype"),
}
# the config keys an API function's keywords set, by keyword: those of a section, and the two
# its model and data arguments name
NAMED = {k: v for k, v in KEYS.items() if v[0]} | {
    "model": ("model", "factory"),
    "data": ("data", "path"),
}
# what a model passed as an object leaves of the config's model: how its output is read
MODEL_OBJECT_KEYS = ("output",)

Model = nn.Module | Config | str | Path
F = TypeVar("F", bound=Callable)
Data = Any  # a path, a dict of tensors, a Dataset, a DataLoader, a DataFrame, a datasets.Dataset


class Call:
    """The objects one API call holds, named while it runs; its temporary folder."""

    def __init__(
        self, stack: contextlib.ExitStack, words: dict[str, str], more: tuple[str, ...] = ()
    ):
        self.stack, self.more = stack, more  # ``more``: its keywords beside the config's keys
        self.words = words  # ``keywords``'s, and each held object's spec as its keyword
        self._folder: Path | None = None
        self.unkept = False  # whether an output of the call is in its temporary folder

    def spec(self, value: Any, keyword: str | None = None) -> str:
        """A path or ``file.py:fn`` as the config writes it (relative to the working folder), or
        the spec naming an object held for the call (an error says where by ``keyword``)."""
        if isinstance(value, str | Path):
            return resolve(str(value), Path.cwd())
        spec = self.stack.enter_context(holding(value))
        if keyword is not None:
            self.words[spec] = f"{keyword}="
        return spec

    def data(self, value: Any, keyword: str = "data") -> str | list[str]:
        """``spec`` of rows: a list of paths is a list of shards, as ``data.path`` takes it."""
        if isinstance(value, list | tuple) and all(isinstance(v, str | Path) for v in value):
            return [self.spec(v) for v in value]
        return self.spec(value, keyword)

    def precondition(self, value: str | Path | Factors | dict | None, resume: bool) -> str | None:
        """A preconditioner's file: a path as given, or what is held in memory (the factors
        ``factors`` returned, an optimizer's ``state_dict()``) written to the call's folder,
        for a run that reads files."""
        from ..curvature import Factors

        if not isinstance(value, Factors | dict):
            return None if value is None else str(value)
        if resume:  # a file of this call's own: the run it resumes read another one
            raise ConfigError(
                "resume needs precondition= as a file: the one factors(out=...) wrote",
                "precondition",
            )
        if isinstance(value, dict):  # an Adam state_dict(), as per_example_influence takes it
            path = self._temporary("adam.pt")
            torch.save(value, path)
            return path
        path = self._temporary("precondition.safetensors")
        value.save(path)
        return path

    def out(self, out: str | Path | None, name: str, resume: bool = False) -> str:
        """``out`` made absolute, or ``name`` in a folder removed when the call returns (where
        ``resume`` asks for none: it continues the run an earlier call wrote to its ``out``)."""
        if out is not None:
            if not isinstance(out, str | Path):
                raise TypeError(f"out= must be a path (str or Path), got {type(out).__name__}")
            return output_path(out, Path.cwd(), "out")
        if resume:
            raise ConfigError(
                "resume=True continues the run an interrupted call wrote to its out=: give "
                "that out= (a call without one keeps no rows to resume)",
                "resume",
            )
        self.unkept = True
        return self._temporary(name)

    def _temporary(self, name: str) -> str:
        """``name`` in the call's folder, removed when the call returns."""
        if self._folder is None:
            self._folder = Path(self.stack.enter_context(tempfile.TemporaryDirectory()))
        return str(self._folder / name)


@contextlib.contextmanager
def called(fn: Callable, options: type | None = None) -> Iterator[Call]:
    """The scope of a call of the API function ``fn`` (``options``: ``keywords``'s); the
    caller's random state is left as it was (a DataLoader draws its base seed from it each time
    it is read, and a run reads the rows more than once)."""
    words = keywords(fn, options)
    more = tuple(f.name for f in dataclasses.fields(options)) if options else ()
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.random.fork_rng(devices=[]))
        call = Call(stack, words, more)
        try:
            with in_api_words(words):
                yield call
        except Interrupted as e:  # Ctrl-C stays a KeyboardInterrupt: no `except Exception` eats it
            text = api_words(str(e), words).replace("command", "call")
            if call.unkept:  # the saved rows went with the call's temporary folder
                text = (
                    f"{e.what.split(';')[0]} to out=None's temporary folder, which went with "
                    "the call: give out= to keep them for resume=True"
                )
            raise KeyboardInterrupt(text) from e


@contextlib.contextmanager
def in_api_words(words: dict[str, str]) -> Iterator[None]:
    """Errors raised inside, with the command line's options as the API's keywords (``words``,
    ``keywords``'s): what to pass, as the API takes it."""
    try:
        yield
    except GradscopeError as e:
        e.what = api_words(e.what, words)
        e.where = e.where and (words.get(e.where) or api_words(e.where, words))
        raise


def in_api_words_of(fn: F) -> F:
    """The API function ``fn``, which runs in no ``called`` scope, with its errors in the
    API's words (``in_api_words``)."""
    words = keywords(fn)

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with in_api_words(words):
            return fn(*args, **kwargs)

    return cast(F, wrapped)


# the config's keys that the command line sets by a flag
KEY_FLAGS = ("per_layer",)


def keywords(fn: Callable, options: type | None = None) -> dict[str, str]:
    """The command-line options and config keys that the API function ``fn`` takes as
    keywords, each as an error should name it: ``--per-ref`` as ``per_ref=True`` (a flag: its
    default False), ``--ref`` as ``ref=``, ``data.batch_size`` as ``batch_size=``. Its
    parameters (``model`` and ``data`` for ``model.factory`` and ``data.path``); the config's
    keys (``KEYS``) where it takes ``**options``; the fields of the dataclass ``options``
    (``validate``'s measures)."""
    params = inspect.signature(fn).parameters.values()
    defaults = {p.name: p.default for p in params if p.kind is not p.VAR_KEYWORD}
    if any(p.kind is p.VAR_KEYWORD for p in params):
        defaults |= {key: False if key in KEY_FLAGS else None for key in KEYS}
    if options is not None:
        defaults |= {f.name: f.default for f in dataclasses.fields(options)}
    words = {
        f"--{name.replace('_', '-')}": f"{name}=True" if default is False else f"{name}="
        for name, default in defaults.items()
    }
    if "columns" in defaults:  # validate's, a list where the command line repeats --column
        words["--column"] = "columns="
    words |= {f"{s}.{n}": f"{k}=" for k, (s, n) in NAMED.items() if k in defaults}
    return words


# a config key in an error: ``data.batch_size``, ``'loss.name'``, ``config.data.path`` (a
# resume's difference), ``data.pad.x`` (an entry of a dict the key holds)
_KEY = re.compile(
    r"'?(?:config\.)?\b((?:data|loss|params|model|output|summary)\.[a-z_]+)\b'?(\.\w+)?"
)


def api_words(text: str, words: dict[str, str]) -> str:
    """``text`` with each command-line option and config key of ``words`` as the API's
    keyword (``data.pad.x`` as ``pad={'x': ...}``); one the API function does not take stays
    as it is."""
    text = re.sub(r"--[a-z][a-z-]*[a-z]", lambda m: words.get(m.group(0), m.group(0)), text)

    def keyword(m: re.Match) -> str:
        word = words.get(m.group(1))
        if word is None:
            return m.group(0)
        return f"{word}{{{m.group(2)[1:]!r}: ...}}" if m.group(2) else word

    return _KEY.sub(keyword, text)


def configured(
    call: Call,
    model: Model,
    data: Data = None,
    config: Config | str | Path | None = None,
    **options: Any,
) -> Config:
    """The config of ``model`` (an ``nn.Module``, or a config naming one) on ``data`` (default:
    the config's ``data.path``), ``options`` set by ``KEYS``, validated as a file is."""
    if not isinstance(model, nn.Module):
        if config is not None:
            raise ConfigError("give the config once: as the model, or as config=", "config")
        model, config = None, model
    if config is not None:  # what the config set, an error names as the config does
        given = {k for k, v in (("model", model), ("data", data)) if v is not None} | set(options)
        for key, (section, name) in NAMED.items():
            if key not in given:
                call.words.pop(f"{section}.{name}", None)
    raw = _base(config)
    if model is not None:
        raw["model"] = {k: v for k, v in raw.get("model", {}).items() if k in MODEL_OBJECT_KEYS}
        raw["model"]["factory"] = call.spec(model, "model")
        first = next(model.parameters(), None)  # scored as it is, unless device=, dtype= say
        raw["device"] = str(first.device) if first is not None else "cpu"
        raw["dtype"] = None
    if data is not None:
        raw["data"]["path"] = call.data(data)
        batch_size = getattr(data, "batch_size", None)  # a DataLoader's
        if isinstance(batch_size, int):
            raw["data"]["batch_size"] = batch_size
    for key, value in options.items():
        if key not in KEYS:
            known = ", ".join(call.more + tuple(KEYS))
            raise TypeError(
                f"unexpected keyword argument {key!r}; besides its named ones it takes: {known}"
            )
        section, name = KEYS[key]
        if key == "loss" and callable(value):
            value = call.spec(value, "loss")
        (raw.setdefault(section, {}) if section else raw)[name] = value
    if not raw["data"].get("path"):
        raise ConfigError("no data: pass the rows to score, or a config naming them", "data")
    return padded_by_default(config_from_dict(raw, raw.get("source") or "the API's arguments"))


def _base(config: Config | str | Path | None) -> dict[str, Any]:
    """The keys ``config`` sets (the config file read and resolved), else the defaults a model
    object needs: its input in column ``x`` (a tuple's first item), its target in ``y``."""
    if config is None:
        return {"data": {"targets": "y"}}
    cfg = config if isinstance(config, Config) else load_config(config)
    return cfg.to_dict()
