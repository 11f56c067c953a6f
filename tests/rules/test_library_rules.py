"""Which modules the library-layer rules recognise, and the norm rule's xhat bit for bit.

The numbers themselves are cases of tests/rules/test_rules.py, against the float64 loop.
"""

from __future__ import annotations

import families as fam
import pytest
import torch
import torch.nn.functional as F
from oracle import assert_rel_close, reference_norms
from torch import Tensor, nn

from gradscope.engine import Engine, total
from gradscope.losses import resolve_loss
from gradscope.rules import find_rule
from gradscope.rules.library_norm import unit_forward


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm scales by (1 + weight)."""

    def __init__(self, d: int):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.zeros(d)), 1e-6

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x, (x.shape[-1],), None, self.eps) * (1.0 + self.weight)


class SquaredRMSNorm(GemmaRMSNorm):
    """Named like a norm, but its weight enters squared: not weight * xhat."""

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x, (x.shape[-1],), None, self.eps) * self.weight**2


class InputScaledRMSNorm(GemmaRMSNorm):
    """Muse Spark's: the input scaled by (1 + weight), then normalised: not weight * xhat."""

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x * (1.0 + self.weight), (x.shape[-1],), None, self.eps)


class LargeWeightRMSNorm(GemmaRMSNorm):
    """weight * xhat at the probe's weights (within 1.5), its weight scaled by its largest
    entry beyond: recognised, wrongly, for the first batch's self-check to catch."""

    def forward(self, x: Tensor) -> Tensor:
        top = self.weight.abs().max()
        w = self.weight * top if top > 1.5 else self.weight
        return F.rms_norm(x, (x.shape[-1],), None, self.eps) * w


class LayerNormWithChild(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.weight, self.inner = nn.Parameter(torch.ones(d)), nn.Linear(d, d)


class Conv1DOtherShape(fam.Conv1D):
    """Named Conv1D, but nf disagrees with the weight: not recognised."""

    def __init__(self):
        super().__init__(3, 4)
        self.nf = 5


class ScaledLayerNorm(nn.LayerNorm):
    def forward(self, x: Tensor) -> Tensor:
        return 2 * super().forward(x)


class InputDtypeLayerNorm(nn.LayerNorm):
    """transformers' EsmcLayerNorm: its output in its input's dtype."""

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x).to(x.dtype)


@pytest.mark.parametrize(
    ("build", "rule"),
    [
        (lambda: fam.Conv1D(3, 4), "hf_conv1d"),
        (lambda: fam.Conv1D(3, 4, bias=False), "hf_conv1d"),
        (lambda: fam.LlamaRMSNorm(4), "library_norm"),
        (lambda: fam.T5LayerNorm(4), "library_norm"),
        (lambda: fam.LayerNorm(4), "library_norm"),
        (lambda: fam.LayerNorm2d(4), "library_norm"),
        (lambda: fam.NanoGPTLayerNorm(4, bias=False), "library_norm"),
        (lambda: nn.LayerNorm(4), "layer_norm"),  # exact types first
        (lambda: GemmaRMSNorm(4), "library_norm"),
        (lambda: ScaledLayerNorm(4), "library_norm"),
        # named like norms, but a probe at a random weight shows the weight is not a scale of
        # xhat: the tap serves them
        (lambda: SquaredRMSNorm(4), None),
        (lambda: InputScaledRMSNorm(4), None),
        (lambda: LayerNormWithChild(4), None),
        (Conv1DOtherShape, None),
        (lambda: nn.Bilinear(2, 2, 2), None),
    ],
    ids=lambda v: v if isinstance(v, str) or v is None else "",
)
def test_recognised_by_name_and_structure(build, rule) -> None:
    found = find_rule(build())
    assert (found.name if found else None) == rule


@pytest.mark.parametrize(
    ("path", "rule"),
    [
        ("pytorch_utils.Conv1D", "hf_conv1d"),
        ("models.llama.modeling_llama.LlamaRMSNorm", "library_norm"),
        ("models.mistral.modeling_mistral.MistralRMSNorm", "library_norm"),
        ("models.qwen2.modeling_qwen2.Qwen2RMSNorm", "library_norm"),
        ("models.t5.modeling_t5.T5LayerNorm", "library_norm"),
    ],
)
def test_transformers_layers_are_recognised(path: str, rule: str) -> None:
    import importlib

    pytest.importorskip("transformers")
    module, _, name = f"transformers.{path}".rpartition(".")
    assert find_rule(getattr(importlib.import_module(module), name)(4, 4)).name == rule


def _random(build, dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    module = build(4).to(dtype)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_()
    return module


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("build", [fam.LlamaRMSNorm, fam.T5LayerNorm], ids=lambda c: c.__name__)
def test_unit_forward_is_the_rmsnorms_own_xhat(build, dtype) -> None:
    """weight * xhat is the module's output bit for bit: HF's float32 upcast (which rounds a
    float64 input) and T5's float64 product both come out as the class computes them."""
    module, x = _random(build, dtype), torch.randn(3, 5, 4).to(dtype) * 3
    assert torch.equal(module.weight * unit_forward(module, x), module(x))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(
    "build", [fam.LayerNorm, fam.NanoGPTLayerNorm, fam.LayerNorm2d], ids=lambda c: c.__name__
)
def test_unit_forward_is_the_layernorms_own_xhat(build, dtype) -> None:
    """The same to rounding: F.layer_norm applies weight and bias inside one fused kernel."""
    module = _random(build, dtype)
    x = torch.randn(3, 4, 2, 2) if build is fam.LayerNorm2d else torch.randn(3, 5, 4)
    x = x.to(dtype) * 3
    xhat, w, b = unit_forward(module, x), module.weight, module.bias
    if build is fam.LayerNorm2d:
        w, b = w[:, None, None], b[:, None, None]  # channels of (B, C, H, W)
    torch.testing.assert_close(w * xhat + b, module(x))


@pytest.mark.parametrize("bias", [True, False])
def test_unit_forward_of_a_layernorm_subclass_with_or_without_bias(bias) -> None:
    """nn.LayerNorm(bias=False) registers its bias as None: the unit forward reads it so."""
    torch.manual_seed(0)
    module = InputDtypeLayerNorm(4, bias=bias).double()
    with torch.no_grad():
        for p in module.parameters():
            p.normal_()
    x = torch.randn(3, 5, 4, dtype=torch.float64) * 3
    b = module.bias if bias else 0
    torch.testing.assert_close(module.weight * unit_forward(module, x) + b, module(x))


def test_unit_forward_leaves_the_module_and_its_hooks_alone() -> None:
    module, calls = fam.LayerNorm(4), []
    module.register_forward_hook(lambda *_: calls.append(1))
    weight = module.weight.detach().clone()
    unit_forward(module, torch.randn(2, 4))
    assert not calls and torch.equal(module.weight, weight)
    assert isinstance(module.weight, nn.Parameter) and module.weight.requires_grad


@pytest.mark.parametrize(
    ("norm", "fallback"),
    [
        (GemmaRMSNorm, []),
        (SquaredRMSNorm, []),
        (InputScaledRMSNorm, []),
        (LargeWeightRMSNorm, ["1.weight"]),
    ],
)
def test_a_module_recognised_wrongly_goes_to_the_fallback(norm, fallback) -> None:
    """Gemma's (1 + weight) RMSNorm is served by its rule (xhat is its forward at weight 1 less
    at weight 0); one whose weight is not a scale of xhat is left to the tap; one that passes
    the probe but not the first batch's self-check goes to the fallback. The norms stay those
    of the loop."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), norm(6), nn.Tanh(), nn.Linear(6, 2)).double()
    with torch.no_grad():
        model[1].weight.normal_()
        model[1].weight[0] = 2.0
    x, y = torch.randn(5, 3, 4, dtype=torch.float64), torch.randn(5, 3, 2, dtype=torch.float64)
    with Engine(model, resolve_loss("mse")) as engine:
        norms = total(engine.norms((x,), y).norm_sq).sqrt()
    assert [p.name for p in engine.plan.fallback] == fallback
    assert_rel_close(norms, reference_norms(model, (x,), y, "mse")[1], rtol=1e-6)
