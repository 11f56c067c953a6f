"""The config file's keys: frozen dataclasses, each field's docstring the key's reference."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

DEVICES = ("auto", "cpu", "cuda", "mps")
DTYPES = ("float32", "float64", "bfloat16", "float16")
OPTIMIZERS = ("sgd", "adam", "adamw")
SCHEDULES = ("constant", "linear", "cosine")


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
class TrainConfig:
    """``train``: how the model was trained, so that gradscope can train it again
    (``gradscope train``, and the retrains ``gradscope validate`` measures scores against)."""

    optimizer: str = "sgd"
    """``sgd``, ``adam`` or ``adamw``, with PyTorch's update rules."""
    lr: float = 0.1
    """The peak learning rate."""
    momentum: float = 0.0
    """``sgd`` only: the momentum factor."""
    nesterov: bool = False
    """``sgd`` only: Nesterov momentum."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """``adam``/``adamw`` only: the decay rates of the first and second moments."""
    eps: float = 1e-8
    """``adam``/``adamw`` only: added to the second moment's square root."""
    weight_decay: float = 0.0
    """``sgd``/``adam``: an L2 term added to the gradient; ``adamw``: decoupled decay."""
    schedule: str = "constant"
    """``constant``, ``linear`` (to 0 at the last step) or ``cosine`` (to 0 at the last step),
    after the warm-up."""
    warmup: int = 0
    """Steps of linear warm-up from 0 to ``lr``."""
    epochs: int | None = None
    """Passes over the training rows; unset with ``steps`` unset: 1."""
    steps: int | None = None
    """Optimizer steps instead of ``epochs``; the rows are passed over as often as that takes."""
    batch_size: int | None = None
    """Rows per optimizer step; unset: ``data.batch_size``. The last batch of a pass may be
    smaller."""
    seed: int = 0
    """Seeds the initialisation, the order of the rows and any dropout the model draws."""
    shuffle: bool = True
    """A new order of the rows for each pass, drawn from ``seed``; false: the data's order."""
    clip: float | None = None
    """Clip the gradient's global L2 norm to this before each step."""
    init: str | None = None
    """A state dict to start from (fine-tuning), as ``model.checkpoint`` takes; unset: the
    factory's own initialisation under ``seed`` (a Hugging Face ``model.pretrained`` folder's
    weights, when it names one). ``model.checkpoint`` is never read: it is what training makes."""
    save_every: int | None = None
    """Also write a checkpoint every K epochs beside the final one (``model.epochK.pt``), for
    TracIn over ``model.checkpoints``."""
    fn: str | None = None
    """``file.py:train``: your own loop instead of the recipe, for loops gradscope does not know
    (a Hugging Face ``Trainer``, Lightning). Called as ``fn(model, rows, seed)`` with the freshly
    built model, the 0-based positions in ``data.path`` of the rows to train on (a sorted int64
    array) and the seed; it trains the model in place (returning None) or returns the trained
    model. The other keys but ``seed`` and ``init`` are then unused."""


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
    train: TrainConfig | None = None
    """How to train the model again: ``gradscope train`` and ``gradscope validate``."""
    source: str = ""  # the config file, for error messages; not a YAML key

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
