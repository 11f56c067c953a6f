"""YAML config -> frozen, validated dataclasses; every bad value is named by its key path."""

from __future__ import annotations

import dataclasses
import math
import os
import re
import reprlib
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union, get_args, get_origin, get_type_hints

from .errors import ConfigError
from .yamlfile import read_yaml

DEVICES = ("auto", "cpu", "cuda", "mps")
DTYPES = ("float32", "float64", "bfloat16", "float16")


@dataclass(frozen=True)
class CheckpointConfig:
    """One checkpoint of a TracIn sum: its state dict (or peft adapter folder) and the weight of
    its scores."""

    path: str
    """A state dict, as ``model.checkpoint`` takes."""
    weight: float = 1.0
    """Its weight ``w_k`` in the sums over checkpoints (>= 0), e.g. the learning rate around it."""


@dataclass(frozen=True)
class ModelConfig:
    """``model``: how to build the model and which weights to load into it."""

    factory: str
    """``file.py:Name`` or ``package.module:Name``, called with ``kwargs``; or a Hugging Face
    class, e.g. ``transformers:AutoModelForCausalLM``. Importing it runs code: see Security."""
    kwargs: dict = field(default_factory=dict)
    """Keyword arguments of the factory, e.g. ``{hidden: 64}``."""
    checkpoint: str | None = None
    """A state dict: ``.pt``/``.pth`` (``torch.load(weights_only=True)``) or ``.safetensors``."""
    checkpoints: list[CheckpointConfig] = field(default_factory=list)
    """Instead of ``checkpoint``: ``[{path, weight}]``, several checkpoints: state dicts, or peft
    adapter folders loaded in turn onto the same base. ``influence`` sums over them (TracIn);
    ``norms`` adds ``loss@k``, ``grad_norm@k`` and ``self_influence``."""
    state_dict_key: str | None = None
    """Take ``checkpoint[key]`` first, e.g. ``state_dict`` (Lightning) or ``model``."""
    strip_prefix: str | None = None
    """Drop this prefix from every key of the state dict, e.g. ``module.`` or ``model.``."""
    output: str | int | None = None
    """The forward returns a tuple, dict or object: which item, key or attribute is the output
    the loss reads. Unset: a result with ``logits`` (a Hugging Face ``ModelOutput``) gives them."""
    config: dict | None = None
    """Hugging Face class only: a mapping for its config class (an ``Auto*`` class needs
    ``model_type``); the model is randomly initialised, ``checkpoint`` may then load weights."""
    pretrained: str | None = None
    """Hugging Face class only: a local ``save_pretrained`` folder, loaded with
    ``from_pretrained`` (no download)."""
    adapter: str | None = None
    """A local peft adapter folder (``adapter_config.json`` and its weights) loaded onto the
    model after its checkpoint, e.g. LoRA; needs ``peft``."""


@dataclass(frozen=True)
class DataConfig:
    """``data``: the examples to score, and which columns feed the model and the loss."""

    path: str | list[str]
    """``.pt``/``.pth`` dict of tensors, ``.npz``, ``.parquet``, ``.csv``, ``.arrow``, a
    ``datasets`` ``save_to_disk`` folder, or ``file.py:make_dataset``; or a glob or a list of
    files (shards), read in order as one dataset."""
    targets: str
    """The column the loss compares the output with."""
    inputs: list[str | list[str]] | dict[str, str | list[str]] = field(
        default_factory=lambda: ["x"]
    )
    """A column, a list of columns passed to ``forward`` in that order, or a mapping
    ``{forward_argument: column}`` passed by keyword. An entry with ``*`` (``feature_*``), or a
    list of columns (``[age, blood pressure, "lab_*"]``), stacks those columns, in file or list
    order, into one (B, K) tensor."""
    ids: str | None = None
    """A column copied to the output as ``id``."""
    pad: dict[str, float] = field(default_factory=dict)
    """``{column: value}``: list columns of uneven length, padded per batch to the batch's
    longest. Unset, ``attention_mask`` pads with 0 and, under ``causal_lm``, the targets with
    -100 (positions the loss skips)."""
    show: str | None = None
    """A text column the report shows for each example."""
    classes: list[str] | None = None
    """Names of the class ids, e.g. ``[cat, dog]``: the tables and the report show them."""
    batch_size: int = 256
    """Examples per forward and backward pass."""
    limit: int | None = None
    """Score only the first N examples."""


@dataclass(frozen=True)
class LossConfig:
    """``loss``: the per-example loss ``l_i`` whose gradient is scored."""

    name: str = "cross_entropy"
    """``cross_entropy``, ``nll``, ``mse``, ``l1``, ``bce_with_logits``, ``causal_lm``, or
    ``file.py:fn``: called as ``fn(outputs, targets)``, it returns one loss per example (B,)."""
    kwargs: dict = field(default_factory=dict)
    """Passed to the loss, e.g. ``ignore_index`` or ``label_smoothing``."""
    class_dim: int = -1
    """``cross_entropy``/``nll`` on outputs with more than 2 dimensions: where the classes are
    (-1: (B, T, C) as language models return; 1: (B, C, H, W) segmentation). Class-id targets
    must have the outputs' shape without this dimension, or the run exits 2 naming the one
    that fits."""
    token_reduction: str = "mean"
    """How one example's loss reduces its extra dimensions: ``mean`` or ``sum`` (positions for
    ``cross_entropy``/``nll``/``causal_lm``, skipping ``ignore_index``; elements for
    ``mse``/``l1``/``bce_with_logits``)."""


@dataclass(frozen=True)
class ParamsConfig:
    """``params``: which parameters the gradient is taken over."""

    include: list[str] | None = None
    """Globs over ``model.named_parameters()`` names, frozen or not. Unset: the parameters that
    require grad (all of them if none does), so a frozen base under LoRA adapters is left out."""
    exclude: list[str] = field(default_factory=list)
    """Globs of parameter names left out of what ``include`` selects."""


@dataclass(frozen=True)
class DistributedConfig:
    """``distributed``: how torchrun processes hold the model."""

    shard: str | None = None
    """``null``: each torchrun process holds the whole model; ``fsdp``: the model is sharded
    with FSDP2 block by block."""
    wrap: list[str] | None = None
    """``fsdp`` only: class names sharded as units. Unset: a Hugging Face model's
    ``_no_split_modules`` (its blocks), else the items of each ``nn.ModuleList``."""
    join_timeout: float = 300.0
    """Seconds a torchrun process waits for the others to join before it stops with an error
    (a process that inherited a launcher's ``WORLD_SIZE`` would otherwise wait 30 minutes)."""


@dataclass(frozen=True)
class OutputConfig:
    """``output``: the Parquet file a run writes."""

    path: str = "scores.parquet"
    """The scores file (``--out`` overrides it); relative to the config's folder."""
    per_layer: bool = False
    """Add a ``grad_norm/<module>`` column per module (``--per-layer``)."""
    metadata: str = "full"
    """``full`` or ``minimal``: ``minimal`` keeps the config's values and every absolute path
    out of the file's metadata; versions, hashes and the plan stay."""


@dataclass(frozen=True)
class SummaryConfig:
    """``summary``: the outlier tables printed after a run."""

    top_k: int = 20
    """Rows per outlier table, in the terminal and in the report (``--top-k`` overrides it)."""


@dataclass(frozen=True)
class ReportConfig:
    """``report``: how the HTML report shows each example."""

    tokenizer: str | None = None
    """A local tokenizer folder: the report decodes token ids with it (needs ``transformers``)."""
    image_shape: list[int] | None = None
    """E.g. ``[8, 8]`` or ``[3, 32, 32]``: the report draws flat inputs as images of this shape;
    (B, H, W) and (B, C, H, W) inputs need none."""


@dataclass(frozen=True)
class Config:
    """A gradscope config file. Relative paths are relative to the folder holding it."""

    model: ModelConfig
    """How to build the model and which weights to load into it."""
    data: DataConfig
    """The examples to score."""
    loss: LossConfig = field(default_factory=LossConfig)
    """The per-example loss."""
    device: str = "auto"
    """``auto`` (cuda, then mps, then cpu), ``cpu``, ``cuda``, ``cuda:N`` or ``mps``."""
    dtype: str | None = None
    """``float32``, ``float64``, ``bfloat16`` or ``float16``; unset keeps the checkpoint's. Norms
    and inner products accumulate in float32 under half precision."""
    params: ParamsConfig = field(default_factory=ParamsConfig)
    """Which parameters the gradient is taken over."""
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    """How torchrun processes hold the model."""
    output: OutputConfig = field(default_factory=OutputConfig)
    """The Parquet file a run writes."""
    summary: SummaryConfig = field(default_factory=SummaryConfig)
    """The outlier tables printed after a run."""
    report: ReportConfig = field(default_factory=ReportConfig)
    """How the HTML report shows each example."""
    source: str = ""  # the config file, for error messages; not a YAML key

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


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


def _type_name(hint: Any) -> str:
    names = {int: "an integer", float: "a number", str: "a string", bool: "true/false",
             dict: "a mapping", type(None): "null"}  # fmt: skip
    if get_origin(hint) in (Union, types.UnionType):
        return " or ".join(_type_name(h) for h in get_args(hint))
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
    return _type_name(hint).split(" ", 1)[1].replace("list of", "lists of", 1) + (
        "" if get_origin(hint) is list else "s"
    )


def _takes_list(hint: Any) -> bool:
    if get_origin(hint) in (Union, types.UnionType):
        return any(_takes_list(h) for h in get_args(hint))
    return get_origin(hint) is list


def _build(cls: type, raw: Any, path: str, source: str) -> Any:
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
        if dataclasses.is_dataclass(hint):
            values[f.name] = _build(hint, value, key, source)
            continue
        if isinstance(value, str) and not _type_ok(value, hint) and _takes_list(hint):
            value = [value]  # a single name is a list of one
        item = get_args(hint)[0] if get_origin(hint) is list else None
        if dataclasses.is_dataclass(item):
            if not isinstance(value, list):
                raise ConfigError(
                    f"'{key}' must be a list of mappings, got {_shown(value)}", source
                )
            values[f.name] = [_build(item, v, f"{key}[{n}]", source) for n, v in enumerate(value)]
            continue
        if not _type_ok(value, hint):
            raise ConfigError(f"'{key}' must be {_type_name(hint)}, got {_shown(value)}", source)
        values[f.name] = value
    return cls(**values)


def _resolve(spec: str | None, base: Path) -> str | None:
    """Make a path, or the file of a 'file.py:Name' spec, absolute relative to ``base``."""
    if spec is None:
        return None
    if ".py:" in spec:
        file, name = spec.rsplit(":", 1)
        return f"{(base / Path(file).expanduser()).resolve()}:{name}"
    if ":" in spec:
        return spec  # "package.module:Name" is imported, not read from a path
    return str((base / Path(spec).expanduser()).resolve())


def output_path(spec: str | Path, base: Path, where: str) -> str:
    """An output file's absolute path, relative to ``base``; a name that ends with a separator
    names a folder and is refused."""
    if str(spec).endswith(("/", os.sep)):
        raise ConfigError(
            f"the output path {str(spec)!r} ends with '/', which names a folder; give a file name",
            where,
        )
    return str((base / Path(spec).expanduser()).resolve())


def _validate(cfg: Config) -> None:
    from .losses import NAMES as LOSS_NAMES  # imports torch: not for --help, --version, summary

    source = cfg.source
    if not re.fullmatch(r"auto|(cpu|cuda|mps)(:\d+)?", cfg.device):
        raise ConfigError(
            f"'device' must be one of {', '.join(DEVICES)} or cuda:N, got {cfg.device!r}", source
        )
    if cfg.dtype is not None and cfg.dtype not in DTYPES:
        raise ConfigError(f"'dtype' must be one of {', '.join(DTYPES)}, got {cfg.dtype!r}", source)
    if ".py:" not in cfg.loss.name and cfg.loss.name not in LOSS_NAMES:
        names = ", ".join(LOSS_NAMES)
        raise ConfigError(
            f"'loss.name' must be one of {names} or file.py:fn, got {cfg.loss.name!r}", source
        )
    if cfg.output.metadata not in ("full", "minimal"):
        raise ConfigError(
            f"'output.metadata' must be full or minimal, got {cfg.output.metadata!r}", source
        )
    if cfg.loss.token_reduction not in ("mean", "sum"):
        raise ConfigError(
            f"'loss.token_reduction' must be mean or sum, got {cfg.loss.token_reduction!r}", source
        )
    for key, value in (
        ("data.batch_size", cfg.data.batch_size),
        ("summary.top_k", cfg.summary.top_k),
    ):
        if value < 1:
            raise ConfigError(f"'{key}' must be at least 1, got {value}", source)
    if cfg.data.limit is not None and cfg.data.limit < 1:
        raise ConfigError(f"'data.limit' must be at least 1, got {cfg.data.limit}", source)
    if cfg.data.path == []:
        raise ConfigError("'data.path' must name at least one file", source)
    _validate_checkpoints(cfg)
    weights = [c.weight for c in cfg.model.checkpoints]
    if any(not math.isfinite(w) or w < 0 for w in weights) or (weights and not any(weights)):
        # cosine over checkpoints is a cosine in the sqrt(weight)-scaled space: weights must be >= 0
        raise ConfigError(
            f"'model.checkpoints' weights must be finite, >= 0 and not all 0, got {weights}", source
        )
    shape = cfg.report.image_shape
    if shape is not None and not (len(shape) in (2, 3) and all(n >= 1 for n in shape)):
        raise ConfigError(
            f"'report.image_shape' must be [H, W] or [C, H, W] of positive sizes, got {shape}",
            source,
        )
    if not cfg.data.inputs:
        raise ConfigError("'data.inputs' must name at least one input", source)
    _validate_hf(cfg)
    _validate_distributed(cfg)


def _validate_checkpoints(cfg: Config) -> None:
    """model.checkpoints: state dicts instead of model.checkpoint, or peft adapter folders loaded
    in turn onto the one base model (model.checkpoint, model.pretrained), instead of
    model.adapter."""
    model, source = cfg.model, cfg.source
    folders = [Path(c.path).is_dir() for c in model.checkpoints]
    if any(folders) and not all(folders):
        raise ConfigError(
            "'model.checkpoints' mixes adapter folders and state dict files; list one kind", source
        )
    if any(folders) and model.adapter is not None:
        raise ConfigError(
            "set model.adapter or adapter folders in model.checkpoints, not both", source
        )
    if model.checkpoints and not any(folders) and model.checkpoint is not None:
        raise ConfigError("set model.checkpoint or model.checkpoints, not both", source)


def _validate_distributed(cfg: Config) -> None:
    """distributed.shard: fsdp serves one model at a time, through the rules; joining takes time."""
    shard = cfg.distributed.shard
    if not (math.isfinite(cfg.distributed.join_timeout) and cfg.distributed.join_timeout > 0):
        raise ConfigError(
            f"'distributed.join_timeout' must be a positive number of seconds, got "
            f"{cfg.distributed.join_timeout}",
            cfg.source,
        )
    if shard not in (None, "fsdp"):
        raise ConfigError(f"'distributed.shard' must be null or fsdp, got {shard!r}", cfg.source)
    if shard and cfg.model.checkpoints:
        raise ConfigError(
            "'distributed.shard: fsdp' scores one checkpoint; model.checkpoints is not supported "
            "sharded",
            cfg.source,
        )


def _validate_hf(cfg: Config) -> None:
    """The keys for Hugging Face models and tokenized data: keyword inputs, pad, config, pretrained."""
    source, data = cfg.source, cfg.data
    if cfg.model.config is not None and cfg.model.pretrained is not None:
        raise ConfigError(
            "set model.config (random init) or model.pretrained (a saved folder), not both", source
        )
    if isinstance(data.inputs, dict):
        for name in data.inputs:
            if not name.isidentifier():
                raise ConfigError(
                    f"'data.inputs' keys are forward arguments; {name!r} is not a Python name",
                    source,
                )
    columns = list(data.inputs.values() if isinstance(data.inputs, dict) else data.inputs)
    for column, value in data.pad.items():
        if column not in [*columns, data.targets]:
            raise ConfigError(
                f"'data.pad.{column}' names no column of data.inputs or data.targets", source
            )
        if not math.isfinite(value):
            raise ConfigError(f"'data.pad.{column}' must be a finite number, got {value}", source)


def load_config(path: str | Path) -> Config:
    """Read, validate and resolve a YAML config; relative paths are relative to its folder."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError("config file not found", str(path))
    raw = read_yaml(path)
    cfg = _build(Config, raw if raw is not None else {}, "", str(path))
    base = path.resolve().parent
    loss_name = cfg.loss.name
    cfg = dataclasses.replace(
        cfg,
        source=str(path),
        model=dataclasses.replace(
            cfg.model,
            factory=_resolve(cfg.model.factory, base),
            pretrained=_resolve(cfg.model.pretrained, base),
            adapter=_resolve(cfg.model.adapter, base),
            checkpoint=_resolve(cfg.model.checkpoint, base),
            checkpoints=[
                dataclasses.replace(c, path=_resolve(c.path, base)) for c in cfg.model.checkpoints
            ],
        ),
        data=dataclasses.replace(
            cfg.data,
            path=_resolve(cfg.data.path, base)
            if isinstance(cfg.data.path, str)
            else [_resolve(p, base) for p in cfg.data.path],
        ),
        loss=dataclasses.replace(
            cfg.loss, name=_resolve(loss_name, base) if ".py:" in loss_name else loss_name
        ),
        output=dataclasses.replace(cfg.output, path=output_path(cfg.output.path, base, str(path))),
        report=dataclasses.replace(cfg.report, tokenizer=_resolve(cfg.report.tokenizer, base)),
    )
    _validate(cfg)
    pad = dict(cfg.data.pad)
    for column, value in default_pad(cfg).items():
        pad.setdefault(column, value)
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, pad=pad))


def config_from_dict(raw: dict, where: str) -> Config:
    """A resolved config read back from ``Config.to_dict()`` (a file's metadata: its paths are
    absolute already), validated as a loaded one is."""
    cfg = _build(Config, {k: v for k, v in raw.items() if k != "source"}, "", where)
    cfg = dataclasses.replace(cfg, source=raw.get("source") or where)
    _validate(cfg)
    return cfg


def default_pad(cfg: Config) -> dict[str, int]:
    """Pad values no config needs to spell out: ``attention_mask`` pads with 0 and, under
    causal_lm, the targets with -100 (the positions the loss skips); ``data.pad`` overrides them.
    The resolved config in the output's metadata holds the values used; ``check`` prints them."""
    data = cfg.data
    given = data.inputs.items() if isinstance(data.inputs, dict) else [(c, c) for c in data.inputs]
    named = {a: c for a, c in given if isinstance(c, str)}  # a stack of columns is no mask
    pad = {column: 0 for argument, column in named.items()
           if "attention_mask" in (argument, column)}  # fmt: skip
    if cfg.loss.name == "causal_lm" and data.targets not in named.values():
        pad[data.targets] = -100
    return pad


def with_overrides(cfg: Config, **overrides: Any) -> Config:
    """Apply command-line options (None means "not given") on top of the config file."""
    o = {k: v for k, v in overrides.items() if v is not None}
    for name in ("batch_size", "limit", "top_k"):
        if name in o and o[name] < 1:
            option = "--" + name.replace("_", "-")
            raise ConfigError(f"{option} must be at least 1, got {o[name]}", option)
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
    _validate(cfg)
    return cfg
