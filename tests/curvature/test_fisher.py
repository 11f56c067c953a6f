"""The true Fisher is the Gauss-Newton matrix: for mse the sampled targets' output gradients
have the output Hessian's second moment (2/D I, mean over D elements; 2 I, sum), and on one
Linear layer with one output K-FAC's S (x) A is the dense GGN exactly; for a mean over positions
(causal_lm, per-position classes, bce over several outputs) the sampled gradients' second
moment is the output Hessian too, not 1/T of it."""

from __future__ import annotations

import pytest
import torch
from exact_oracle import curvature_matrix
from torch import nn
from torch.func import grad, hessian

from gradscope.curvature.factors import fit
from gradscope.curvature.fisher import SampledLoss
from gradscope.engine import Engine
from gradscope.losses import resolve_loss


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("shape", [(1,), (3,), (2, 3)], ids=["one", "three", "2x3"])
def test_sampled_output_gradients_have_the_output_hessian(shape, reduction) -> None:
    loss = resolve_loss("mse", token_reduction=reduction)
    out = torch.randn(4000, *shape, dtype=torch.float64)
    sampled = SampledLoss("mse", loss, {}, -1, seed=7, token_reduction=reduction)
    targets = sampled.sample(out, torch.zeros_like(out))
    g = torch.stack(
        [grad(lambda o, i=i: loss(o[None], targets[i : i + 1])[0])(out[i]) for i in range(8)]
    )
    d = out[0].numel()
    h = hessian(lambda o: loss(o[None], targets[:1])[0])(out[0]).reshape(d, d)
    scale = 2 / d if reduction == "mean" else 2.0
    torch.testing.assert_close(h, scale * torch.eye(d, dtype=torch.float64))
    # g = scale x (random signs): g g^T has the Hessian's diagonal on every draw, and its
    # expectation is scale x E[r r^T] = the Hessian (independent fair signs)
    torch.testing.assert_close(g.square(), torch.full_like(g, scale))
    signs = (targets - out).flatten(1).sign()  # (N, D)
    assert torch.equal(signs.abs(), torch.ones_like(signs))
    second = signs.T @ signs / len(signs)  # -> I
    torch.testing.assert_close(second, torch.eye(d, dtype=torch.float64), atol=0.06, rtol=0)


@pytest.mark.parametrize("whole", [True, False], ids=["whole-blocks", "kfac"])
def test_kfac_of_one_layer_is_the_dense_ggn(monkeypatch, whole: bool) -> None:
    """One output: the sampled Fisher is the GGN with no noise, so each parameter's whole block
    and K-FAC's S (x) A of the weight (its parameters too many for a whole block) equal the
    GGN's blocks."""
    if not whole:
        monkeypatch.setattr("gradscope.curvature.factors.FULL_ELEMENTS", 1)
    torch.manual_seed(0)
    model = nn.Linear(4, 1).double()
    x, y = torch.randn(30, 4, dtype=torch.float64), torch.randn(30, 1, dtype=torch.float64)
    loss = resolve_loss("mse")
    engine = Engine(model, SampledLoss("mse", loss, {}, -1))
    with engine:
        blocks, _, _ = fit(engine.contributions, lambda: [((x[:13],), y[:13]), ((x[13:],), y[13:])])
    names = ["weight", "bias"]
    ggn = curvature_matrix(model, loss, names, x, y, "gn")  # (5, 5)
    w = blocks["weight"].tensors
    got = w["F"] if whole else torch.kron(w["S"][0], w["A"][0])
    torch.testing.assert_close(got, ggn[:4, :4], rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(blocks["bias"].tensors["F"], ggn[4:, 4:])


def _second_moment_and_hessian(name: str, out: torch.Tensor, targets: torch.Tensor, **kwargs):
    """Over many copies of one example's output: the mean outer product of the sampled loss's
    output gradients, and the true loss's output Hessian (the Gauss-Newton matrix's middle)."""
    loss = resolve_loss(name, class_dim=kwargs.get("class_dim", -1))
    copies = 40000
    many = out.expand(copies, *out.shape[1:]).clone().requires_grad_(True)
    sampled = SampledLoss(name, loss, {}, kwargs.get("class_dim", -1), seed=3)
    (g,) = torch.autograd.grad(
        sampled(many, targets.expand(copies, *targets.shape[1:])).sum(), many
    )
    g = g.flatten(1)  # (copies, D): each copy's own gradient
    h = hessian(lambda o: loss(o[None], targets)[0])(out[0]).reshape(g.shape[1], g.shape[1])
    return g.T @ g / copies, h


@pytest.mark.parametrize(
    ("name", "shape", "class_dim"),
    [("causal_lm", (1, 4, 3), -1), ("cross_entropy", (1, 3, 5), 1),
     ("bce_with_logits", (1, 6), -1)],
    ids=["causal_lm", "per-position", "bce"],
)  # fmt: skip
def test_sampled_fisher_of_a_mean_over_positions_is_the_gauss_newton(name, shape, class_dim):
    """A mean over T positions: the sampled gradients' second moment is the output Hessian,
    not 1/T of it (positions' draws are independent; each sampled loss is scaled by sqrt(T))."""
    torch.manual_seed(0)
    out = torch.randn(*shape, dtype=torch.float64)
    if name == "bce_with_logits":
        targets = torch.rand(*shape, dtype=torch.float64)
    elif name == "causal_lm":
        targets = torch.tensor([[0, 2, -100, 1]])  # one position ignored: T = 2 that count
    else:
        targets = torch.randint(0, 3, (1, 5))
    moment, h = _second_moment_and_hessian(name, out, targets, class_dim=class_dim)
    scale = h.abs().max()  # Monte Carlo error over 40000 draws: about 1% of it
    torch.testing.assert_close(moment, h, atol=0.05 * scale, rtol=0)
    assert (moment / 2 - h).abs().max() > 0.2 * scale  # T >= 2: 1/T of it would fail


class Shortcut(nn.Module):
    """A causal LM over embeddings that skips its mask where nothing is padded, as
    transformers' ``if mask.all()`` does: an example with nothing padded, alone, takes the
    other way, and the engine runs it alone to check its loss."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 5)

    def forward(self, x, mask):
        return self.fc(x if mask.all() else x * mask[..., None])


def test_true_fisher_labels_hold_for_an_example_run_alone(tmp_path) -> None:
    """The labels were drawn inside the loss, per call: the example run alone drew others than
    in its batch, and the true-Fisher factors of the bundled LM (configs/lm.yaml) were refused
    as a model that branches on the batch. They are drawn for the batch before its pass now."""
    import gradscope

    torch.manual_seed(0)
    n, t = 6, 5
    mask = torch.ones(n, t)
    mask[::2, 3:] = 0  # examples 0, 2, 4 padded; 1, 3, 5 not: alone they skip the mask
    data = {"x": torch.randn(n, t, 4), "mask": mask,
            "y": torch.where(mask.bool(), torch.randint(0, 5, (n, t)), -100)}  # fmt: skip
    made = gradscope.factors(
        Shortcut().double(), data, out=tmp_path / "f.safetensors", ekfac=True,
        inputs={"x": "x", "mask": "mask"}, targets="y", loss="causal_lm", batch_size=n,
    )  # fmt: skip
    assert made.meta["examples"] == n
