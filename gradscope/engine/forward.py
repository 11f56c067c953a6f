"""How a model is called on a batch's tensors, and which part of its result the loss reads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..errors import ModelError


def select_output(outputs: Any, spec: str | int | None, where: str = "model.output") -> Tensor:
    """Pick the tensor the loss reads from a tuple, dict or object returned by forward; with no
    ``spec``, a result with ``logits`` (a Hugging Face ModelOutput) gives its logits.

    ``where`` is how errors name the setting: the config key, or the API's keyword argument.
    """
    if isinstance(spec, int) and hasattr(outputs, "to_tuple"):  # a ModelOutput: by position
        outputs = outputs.to_tuple()
    if spec is None:
        selected = outputs
        if isinstance(outputs, dict) and "logits" in outputs:  # ModelOutput is a dict too
            selected = outputs["logits"]
        elif hasattr(outputs, "logits"):
            selected = outputs.logits
    elif isinstance(outputs, dict):
        if spec not in outputs:
            raise ModelError(
                f"forward returned a dict without key {spec!r} (keys: {', '.join(map(str, outputs))})",
                where,
            )
        selected = outputs[spec]
    elif isinstance(outputs, (tuple, list)):
        try:
            selected = outputs[int(spec)]
        except (ValueError, IndexError) as e:
            raise ModelError(
                f"forward returned {len(outputs)} items; {spec!r} does not pick one", where
            ) from e
    elif isinstance(spec, str) and hasattr(outputs, spec):
        selected = getattr(outputs, spec)
    else:
        raise ModelError(
            f"forward returned a {type(outputs).__name__}, which has no {spec!r}", where
        )
    if not isinstance(selected, torch.Tensor):
        raise ModelError(
            f"forward returned a {type(selected).__name__}; set {where} to pick a tensor", where
        )
    return selected


@dataclass(frozen=True)
class Forward:
    """Runs ``model`` on a tuple of tensors and returns the output the loss reads.

    The last ``len(keywords)`` tensors are passed by keyword under those names, the rest
    positionally; ``output`` picks the tensor from a tuple, dict or object result.
    """

    keywords: tuple[str, ...] = ()
    output: str | int | None = None
    where: str = "model.output"

    def split(self, inputs: tuple[Tensor, ...]) -> tuple[tuple[Tensor, ...], dict[str, Tensor]]:
        """The positional and the keyword arguments of the call."""
        n = len(inputs) - len(self.keywords)
        return inputs[:n], dict(zip(self.keywords, inputs[n:], strict=True))

    def select(self, outputs: Any) -> Tensor:
        return select_output(outputs, self.output, self.where)

    def __call__(self, model: nn.Module, inputs: tuple[Tensor, ...]) -> Tensor:
        args, kwargs = self.split(inputs)
        return self.select(model(*args, **kwargs))


def batched(inputs: tuple[Tensor, ...], targets: Tensor) -> None:
    """Each input a tensor whose first dimension is the batch's examples, as the targets': one
    that is not would be cut into examples wrongly where examples are run alone."""
    if not isinstance(targets, Tensor) or targets.dim() == 0:
        raise ModelError("the targets must be a tensor with one entry per example", "data.targets")
    b = targets.shape[0]
    for k, t in enumerate(inputs):
        if not isinstance(t, Tensor) or t.dim() == 0 or t.shape[0] != b:
            what = f"of shape {tuple(t.shape)}" if isinstance(t, Tensor) else type(t).__name__
            raise ModelError(
                f"input {k} is {what} where the targets hold {b} examples: each input must be "
                "a tensor whose first dimension is the batch's examples, as the targets'",
                "data.inputs, data.targets",
            )
