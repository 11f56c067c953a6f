"""Hugging Face ``Conv1D`` (GPT-2's ``c_attn``, ``c_fc``, ``c_proj``): a Linear whose weight is
stored (in, out), ``y = x @ W + b``. Recognised by qualified name or by structure, never imported.
"""

from __future__ import annotations

from torch import Tensor, nn

from .base import Contribution
from .linear import affine_parts, shaped
from .registry import register_rule


def looks_like_conv1d(module: nn.Module) -> bool:
    """A leaf named ``Conv1D`` holding ``nf`` outputs and an (in, nf) weight, bias (nf,) or None."""
    weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
    return (
        type(module).__name__ == "Conv1D"
        and isinstance(getattr(module, "nf", None), int)
        and isinstance(weight, nn.Parameter)
        and weight.dim() == 2
        and weight.shape[1] == module.nf
        and (bias is None or (isinstance(bias, nn.Parameter) and bias.shape == (module.nf,)))
        and {n for n, _ in module.named_parameters(recurse=False)} <= {"weight", "bias"}
        and next(module.children(), None) is None
    )


@register_rule(
    name="hf_conv1d",
    qualnames=("transformers.pytorch_utils.Conv1D",),
    match=looks_like_conv1d,
    rows=lambda module: 1,
    alike=shaped,
)
def hf_conv1d(
    module: nn.Module, inputs: tuple[Tensor, ...], grad_output: Tensor
) -> dict[str, Contribution]:
    return affine_parts(inputs[0], grad_output, module.weight, module.bias, transposed=True)
