"""A config file read, resolved (paths relative to its folder) and validated; command-line
overrides on top of it; a config read back from a scores file's metadata."""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..yamlfile import read_yaml
from .schema import DEVICE, DEVICES, Config, DataConfig
from .typed import build
from .validate import validate


def resolve(spec: str | None, base: Path, importable: bool = False) -> str | None:
    """Make a path, or the file of a 'file.py:Name' spec, absolute relative to ``base``; an
    ``importable`` key's "package.module:Name" (``model.factory``, ``train.fn``) as it is.
    Elsewhere a ':' is a path's (a folder named ``run-10:00``), read beside the config."""
    if spec is None:
        return None
    if ".py:" in spec:
        file, name = spec.rsplit(":", 1)
        return f"{(base / Path(file).expanduser()).resolve()}:{name}"
    if importable and ":" in spec:
        return spec  # "package.module:Name" is imported, not read from a path
    return str((base / Path(spec).expanduser()).resolve())


def output_path(spec: str | Path, base: Path, where: str) -> str:
    """An output file's absolute path, relative to ``base``; a name that ends with a separator
    names a folder and is refused. Its folder is resolved, not the name: a link planted there is
    replaced by the output, its target left as it is."""
    if str(spec).endswith(("/", os.sep)):
        raise ConfigError(
            f"the output path {str(spec)!r} ends with '/', which names a folder; give a file name",
            where,
        )
    path = base / Path(spec).expanduser()
    if path.name in ("", ".", ".."):  # a folder: the checks after refuse it by its resolved name
        return str(path.resolve())
    return str(path.parent.resolve() / path.name)


def load_config(path: str | Path) -> Config:
    """Read, validate and resolve a YAML config; relative paths are relative to its folder."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError("config file not found", str(path))
    raw = read_yaml(path)
    cfg = build(Config, raw if raw is not None else {}, "", str(path))
    base = path.resolve().parent
    loss_name = cfg.loss.name
    cfg = dataclasses.replace(
        cfg,
        source=str(path),
        model=dataclasses.replace(
            cfg.model,
            factory=resolve(cfg.model.factory, base, importable=True),
            pretrained=resolve(cfg.model.pretrained, base),
            adapter=resolve(cfg.model.adapter, base),
            checkpoint=resolve(cfg.model.checkpoint, base),
            checkpoints=[
                dataclasses.replace(c, path=resolve(c.path, base)) for c in cfg.model.checkpoints
            ],
        ),
        data=dataclasses.replace(
            cfg.data,
            path=resolve(cfg.data.path, base)
            if isinstance(cfg.data.path, str)
            else [resolve(p, base) for p in cfg.data.path],
        ),
        loss=dataclasses.replace(
            cfg.loss, name=resolve(loss_name, base) if ".py:" in loss_name else loss_name
        ),
        output=dataclasses.replace(cfg.output, path=output_path(cfg.output.path, base, str(path))),
        report=dataclasses.replace(cfg.report, tokenizer=resolve(cfg.report.tokenizer, base)),
        train=cfg.train
        and dataclasses.replace(
            cfg.train, init=resolve(cfg.train.init, base), fn=resolve(cfg.train.fn, base, True)
        ),
    )
    validate(cfg)
    return padded_by_default(cfg)


def config_from_dict(raw: dict, where: str) -> Config:
    """A resolved config read back from ``Config.to_dict()`` (a file's metadata: its paths are
    absolute already), validated as a loaded one is."""
    cfg = build(Config, {k: v for k, v in raw.items() if k != "source"}, "", where)
    cfg = dataclasses.replace(cfg, source=raw.get("source") or where)
    validate(cfg)
    return cfg


def _named(data: DataConfig) -> dict[str, str]:
    """{forward argument: column} of the inputs that are one column each (a stack is none)."""
    given = data.inputs.items() if isinstance(data.inputs, dict) else [(c, c) for c in data.inputs]
    return {a: c for a, c in given if isinstance(c, str)}


def default_pad(cfg: Config) -> dict[str, int]:
    """Pad values no config needs to spell out: ``attention_mask`` pads with 0 and, under
    causal_lm, the targets with -100 (the positions the loss skips); ``data.pad`` overrides them.
    The resolved config in the output's metadata holds the values used; ``check`` prints them."""
    named = _named(cfg.data)
    pad = {column: 0 for argument, column in named.items()
           if "attention_mask" in (argument, column)}  # fmt: skip
    if cfg.loss.name == "causal_lm" and cfg.data.targets not in named.values():
        pad[cfg.data.targets] = cfg.loss.kwargs.get("ignore_index", -100)
    return pad


def padded_by_default(cfg: Config) -> Config:
    """``cfg`` with ``default_pad``'s values where ``data.pad`` sets none; and under causal_lm,
    cross_entropy or nll, where the targets are an input's column that pads (``targets:
    input_ids``, which pads as an input), ``data.pad_targets`` the loss's ignore_index (-100)
    unless set: a padded position is no token to predict (the input's pad value, 0, was class 0
    to cross_entropy). A column that does not pad keeps it unset (the truths made before it was
    a key stand)."""
    data = cfg.data
    pad = dict(data.pad)
    for column, value in default_pad(cfg).items():
        pad.setdefault(column, value)
    targets = data.pad_targets
    shared = data.targets in _named(data).values() and data.targets in pad  # padded, as an input
    if targets is None and cfg.loss.name in ("causal_lm", "cross_entropy", "nll") and shared:
        targets = cfg.loss.kwargs.get("ignore_index", -100)
    return dataclasses.replace(cfg, data=dataclasses.replace(data, pad=pad, pad_targets=targets))


def check_counts(**given: int | None) -> None:
    """Each count option given (``batch_size``, ``limit``, ``top_k``; None: not given) at least
    1, named as the command line names it: before any work."""
    for name, value in given.items():
        if value is not None and value < 1:
            option = "--" + name.replace("_", "-")
            raise ConfigError(f"{option} must be at least 1, got {value}", option)


def with_overrides(cfg: Config, **overrides: Any) -> Config:
    """Apply command-line options (None means "not given") on top of the config file."""
    o = {k: v for k, v in overrides.items() if v is not None}
    check_counts(**{name: o.get(name) for name in ("batch_size", "limit", "top_k")})
    if "device" in o and not re.fullmatch(DEVICE, o["device"]):  # named as the option, not the file
        devices = ", ".join(DEVICES)
        raise ConfigError(
            f"--device must be one of {devices} or cuda:N, got {o['device']!r}", "--device"
        )
    data = dataclasses.replace(cfg.data, **{k: o[k] for k in ("batch_size", "limit") if k in o})
    output = cfg.output
    if "out" in o:
        output = dataclasses.replace(output, path=output_path(o["out"], Path.cwd(), "--out"))
    if o.get("per_layer"):
        output = dataclasses.replace(output, per_layer=True)
    summary = dataclasses.replace(cfg.summary, top_k=o.get("top_k", cfg.summary.top_k))
    cfg = dataclasses.replace(
        cfg, data=data, output=output, summary=summary, device=o.get("device", cfg.device)
    )
    validate(cfg)
    return cfg
