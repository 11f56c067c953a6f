"""The top-k examples read back from the configured data and shown as what they are.

2-D/3-D inputs are drawn as images (flat ones too, with ``report.image_shape``), token ids are
decoded with ``report.tokenizer``, ``data.show`` names a text column, anything else is its values.
"""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from matplotlib.image import imsave

from ..config import Config
from ..errors import ConfigError
from ..io.data import open_dataset
from ..io.sources import read_source

MAX_VALUES = 24  # a tabular row or a token list shows at most this many values
READ_ROWS = 4096
CHANNELS = (1, 3, 4)  # gray, RGB, RGBA


@dataclass(frozen=True)
class Shown:
    """One input of one example: an image (PNG data URI) or text."""

    name: str
    image: str | None = None
    text: str | None = None


def _png(array: np.ndarray) -> str:
    """(H, W) or (H, W, C) numbers -> a PNG data URI, each image scaled to its own min..max."""
    array = array.astype(np.float64)
    low, high = np.nanmin(array), np.nanmax(array)
    scaled = (array - low) / (high - low) if high > low else np.zeros_like(array)
    buffer = io.BytesIO()
    if scaled.ndim == 3 and scaled.shape[2] == 1:
        scaled = scaled[..., 0]  # one channel, (1, H, W) or (H, W, 1): gray as (H, W) is
    if scaled.ndim == 2:
        imsave(buffer, scaled, cmap="gray_r", vmin=0.0, vmax=1.0, format="png")
    else:
        imsave(buffer, scaled, format="png")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def _as_image(x: np.ndarray, shape: list[int] | None) -> np.ndarray | None:
    """An image (H, W) or (H, W, C) from one example's input, or None when it is not one."""
    if shape is not None and x.ndim == 1 and x.size == int(np.prod(shape)):
        x = x.reshape(shape)
    if x.ndim == 2:
        return x
    if x.ndim != 3:
        return None
    channels, *_, last = x.shape
    if channels in CHANNELS and channels <= min(x.shape[1:]):  # (C, H, W), PyTorch's layout
        return np.moveaxis(x, 0, -1)
    return x if last in CHANNELS else None  # (H, W, C)


def _runs(x: np.ndarray) -> str:
    """A mask or segment ids as runs of equal values: ``1 ×37, 0 ×4``."""
    starts = np.flatnonzero(np.diff(x, prepend=x[0] - 1))
    lengths = np.diff(np.append(starts, len(x)))
    return ", ".join(f"{x[s]} ×{n}" for s, n in zip(starts, lengths, strict=True))


def _values(x: np.ndarray) -> str:
    flat = x.reshape(-1)
    text = ", ".join(f"{v:.4g}" if x.dtype.kind == "f" else str(v) for v in flat[:MAX_VALUES])
    return text + (f", … ({flat.size} values)" if flat.size > MAX_VALUES else "")


class Renderer:
    """Turns one example's input tensors into ``Shown`` parts, by their shape and dtype."""

    def __init__(self, cfg: Config):
        self.names = _input_names(cfg)
        self.shape = cfg.report.image_shape
        self.tokenizer = _tokenizer(cfg.report.tokenizer) if cfg.report.tokenizer else None

    def __call__(self, inputs: tuple[torch.Tensor | np.ndarray, ...]) -> list[Shown]:
        return [self._one(name, np.asarray(x)) for name, x in zip(self.names, inputs, strict=True)]

    def _one(self, name: str, x: np.ndarray) -> Shown:
        # token ids; a column of 0s and 1s is a mask or segment ids (attention_mask), not text
        if x.dtype.kind in "iu" and x.ndim == 1 and len(x) and np.isin(x, (0, 1)).all():
            return Shown(name, text=_runs(x))
        if x.dtype.kind in "iu" and x.ndim == 1:
            if self.tokenizer is not None:
                return Shown(name, text=self.tokenizer.decode(x.tolist(), skip_special_tokens=True))
            return Shown(name, text="token ids: " + _values(x))
        image = _as_image(x, self.shape)
        if image is not None and x.dtype.kind in "biuf":
            return Shown(name, image=_png(image))
        return Shown(name, text=_values(x))


def _input_names(cfg: Config) -> list[str]:
    """The data's inputs, as the page names them: forward arguments, or columns (a stack by
    its columns)."""
    inputs = cfg.data.inputs
    names = list(inputs) if isinstance(inputs, dict) else inputs
    return [n if isinstance(n, str) else ", ".join(n) for n in names]


def _tokenizer(folder: str) -> Any:
    try:
        from transformers import AutoTokenizer
    except ImportError as e:
        raise ConfigError(
            "report.tokenizer needs the transformers package (pip install transformers)",
            "report.tokenizer",
        ) from e
    try:
        return AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except Exception as e:  # transformers raises OSError, ValueError, ... for a bad folder
        raise ConfigError(f"cannot load a tokenizer from the folder: {e}", folder) from e


def check_shown(cfg: Config) -> None:
    """What the page reads back from the data, before a run whose report needs it: the
    tokenizer loads, ``report.image_shape`` fits an input, and ``data.show`` is a column of the
    data's first source."""
    if cfg.report.tokenizer:
        _tokenizer(cfg.report.tokenizer)
    check_image_shape(cfg)
    if cfg.data.show is None:
        return
    first = open_dataset(cfg.data).sources[0]
    names = first.names if first.names is not None else list(next(read_source(first, 1), {}))
    if cfg.data.show not in names:
        raise ConfigError(f"no column {cfg.data.show!r} for data.show", first.where)


def check_image_shape(cfg: Config) -> None:
    """``report.image_shape``, where set, fits a flat input of the data's first row: where it
    fits none, every example would be shown as its values, the shape read by nothing."""
    shape = cfg.report.image_shape
    if shape is None:
        return
    first = next(iter(open_dataset(cfg.data).batches(1, pad=False)), None)
    if first is None:  # no rows: nothing to draw
        return
    rows = [np.asarray(x[0]) for x in first.inputs]
    size = int(np.prod(shape))
    if any(x.ndim == 1 and x.size == size for x in rows):
        return
    held = ", ".join(
        f"{name} {list(x.shape)}" for name, x in zip(_input_names(cfg), rows, strict=True)
    )
    raise ConfigError(
        f"report.image_shape {shape} fits no input: it draws a flat input of {size} values, "
        f"and a row's inputs are {held}",
        "report.image_shape",
    )


def show_examples(cfg: Config, example_ids: list[int]) -> dict[int, list[Shown]]:
    """Each wanted example's inputs (and its ``data.show`` text), read back from the data."""
    wanted, found = set(example_ids), {}
    render = Renderer(cfg)
    dataset = open_dataset(cfg.data)
    for batch in dataset.batches(READ_ROWS, pad=False):  # each row as stored, not padded
        for row, index in enumerate(batch.index.tolist()):
            if index in wanted:
                found[index] = render(tuple(x[row] for x in batch.inputs))
        if len(found) == len(wanted):
            break
    if cfg.data.show is not None:
        texts = dataset.values_at(cfg.data.show, "data.show", wanted)
        for index, text in texts.items():
            found.setdefault(index, []).append(Shown(cfg.data.show, text=str(text)))
    return found
