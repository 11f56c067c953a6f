"""The config file's keys: frozen dataclasses, each field's docstring the key's reference and
each section's ``check`` the values its keys take one by one (``train`` in train.py; the keys
that must agree with each other in validate.py)."""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..io.held import is_held  # a loss the API's caller passed
from .train import TrainConfig
from .typed import at_least

DEVICES, DEVICE = ("auto", "cpu", "cuda", "mps"), r"auto|(cpu|cuda|mps)(:\d+)?"  # cuda:N
DTYPES = ("float32", "float64", "bfloat16", "float16")


@dataclass(frozen=True)
class CheckpointConfig:
    """One checkpoint of a TracIn sum: its state dict (or peft adapter folder) and weight."""

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
    the loss reads (a ``ModelOutput``'s item by position too). Unset: its ``logits``, if any."""
    config: dict | None = None
    """Hugging Face class only: a mapping for its config class (an ``Auto*`` class needs
    ``model_type``); the model is randomly initialised, ``checkpoint`` may then load weights."""
    pretrained: str | None = None
    """Hugging Face class only: a local ``save_pretrained`` folder, loaded with
    ``from_pretrained`` (no download)."""
    adapter: str | None = None
    """A local peft adapter folder (``adapter_config.json`` and its weights) loaded onto the
    model after its checkpoint, e.g. LoRA; needs ``peft``."""

    def check(self, source: str) -> None:
        folders = [Path(c.path).is_dir() for c in self.checkpoints]
        if any(folders) and not all(folders):
            raise ConfigError(
                "'model.checkpoints' mixes adapter folders and state dict files; list one kind",
                source,
            )
        weights = [c.weight for c in self.checkpoints]
        if any(not math.isfinite(w) or w < 0 for w in weights) or (weights and not any(weights)):
            # cosine over checkpoints is a cosine in the sqrt(weight)-scaled space: weights >= 0
            raise ConfigError(
                f"'model.checkpoints' weights must be finite, >= 0 and not all 0, got {weights}",
                source,
            )


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
    """A column copied to the output as ``id`` (a CSV's as text, ``007``, if no input reads it)."""
    pad: dict[str, float] = field(default_factory=dict)
    """``{column: value}``: list columns of uneven length, padded per batch to the batch's
    longest. Unset, ``attention_mask`` pads with 0 and, under ``causal_lm``, the targets with
    -100 (positions the loss skips). A model given no mask sees the padding (a BERT fed
    ``input_ids`` alone: its rows' numbers move with the batch); name the mask as an input."""
    pad_targets: float | None = None
    """What the targets pad with where their column pads: unset, its ``data.pad`` value; under
    causal_lm, cross_entropy or nll, where they are an input's column (``targets: input_ids``),
    -100 (``loss.kwargs.ignore_index``): the positions the loss skips, not class 0."""
    show: str | None = None
    """A text column the report shows for each example."""
    classes: list[str] | None = None
    """Names of the class ids, e.g. ``[cat, dog]``: the tables and the report show them."""
    batch_size: int = 256
    """Examples per forward and backward pass."""
    limit: int | None = None
    """Score only the first N examples."""

    def check(self, source: str) -> None:
        if self.path == []:
            raise ConfigError("'data.path' must name at least one file", source)
        specs = self.inputs.values() if isinstance(self.inputs, dict) else self.inputs
        if not self.inputs or [] in specs:  # an input of no column: nothing to stack
            raise ConfigError("'data.inputs' must name at least one input, each a column", source)
        for name in self.inputs if isinstance(self.inputs, dict) else ():
            if not name.isidentifier():
                raise ConfigError(
                    f"'data.inputs' keys are forward arguments; {name!r} is not a Python name",
                    source,
                )
        pads = {f"pad.{column}": value for column, value in self.pad.items()}
        for key, value in (pads | {"pad_targets": self.pad_targets or 0}).items():
            if not math.isfinite(value):
                raise ConfigError(f"'data.{key}' must be a finite number, got {value}", source)
        at_least(1, {"data.batch_size": self.batch_size, "data.limit": self.limit}, source)


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

    def check(self, source: str) -> None:
        from ..losses import NAMES  # imports torch: not for --help, --version, summary

        if ".py:" not in self.name and self.name not in NAMES and not is_held(self.name):
            raise ConfigError(
                f"'loss.name' must be one of {', '.join(NAMES)} or file.py:fn, got {self.name!r}",
                source,
            )
        if self.token_reduction not in ("mean", "sum"):
            raise ConfigError(
                f"'loss.token_reduction' must be mean or sum, got {self.token_reduction!r}",
                source,
            )


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

    def check(self, source: str) -> None:
        if not (math.isfinite(self.join_timeout) and self.join_timeout > 0):
            raise ConfigError(
                f"'distributed.join_timeout' must be a positive number of seconds, got "
                f"{self.join_timeout}",
                source,
            )
        if self.shard not in (None, "fsdp"):
            raise ConfigError(
                f"'distributed.shard' must be null or fsdp, got {self.shard!r}", source
            )


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

    def check(self, source: str) -> None:
        if self.metadata not in ("full", "minimal"):
            raise ConfigError(
                f"'output.metadata' must be full or minimal, got {self.metadata!r}", source
            )


@dataclass(frozen=True)
class SummaryConfig:
    """``summary``: the outlier tables printed after a run."""

    top_k: int = 20
    """Rows per outlier table, in the terminal and in the report (``--top-k`` overrides it)."""

    def check(self, source: str) -> None:
        at_least(1, {"summary.top_k": self.top_k}, source)


@dataclass(frozen=True)
class ReportConfig:
    """``report``: how the HTML report shows each example."""

    tokenizer: str | None = None
    """A local tokenizer folder: the report decodes token ids with it (needs ``transformers``)."""
    image_shape: list[int] | None = None
    """E.g. ``[8, 8]`` or ``[3, 32, 32]``: the report draws flat inputs of its size as images of
    this shape (one must fit); (B, H, W) and (B, C, H, W) inputs need none."""

    def check(self, source: str) -> None:
        shape = self.image_shape
        if shape is not None and not (len(shape) in (2, 3) and all(n >= 1 for n in shape)):
            raise ConfigError(
                f"'report.image_shape' must be [H, W] or [C, H, W] of positive sizes, got {shape}",
                source,
            )


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
    """``float32``, ``float64``, ``bfloat16`` or ``float16``; unset keeps the checkpoint's (of
    several, one that holds them all). Half precision: norms and products accumulate in float32."""
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
    train: TrainConfig | None = None
    """How to train the model again: ``gradscope train`` and ``gradscope validate``."""
    source: str = ""  # the config file, for error messages; not a YAML key

    def check(self, source: str) -> None:
        """The top-level keys; each section checks its own."""
        if not re.fullmatch(DEVICE, self.device):
            raise ConfigError(
                f"'device' must be one of {', '.join(DEVICES)} or cuda:N, got {self.device!r}",
                source,
            )
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ConfigError(
                f"'dtype' must be one of {', '.join(DTYPES)}, got {self.dtype!r}", source
            )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
