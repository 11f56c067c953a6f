"""per_example_norms on Linear models against the float64 per-example loop."""

from __future__ import annotations

import pytest
import torch
from oracle import Case, assert_case_matches_loop, assert_rel_close, reference_norms
from torch import nn

import gradscope


class TwoInputs(nn.Module):
    """Two inputs, a dict output: the loss reads one key."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.head = nn.Linear(3, 4), nn.Linear(2, 4), nn.Linear(4, 3)

    def forward(self, x, z):
        h = torch.tanh(self.a(x) + self.b(z))
        return {"logits": self.head(h), "hidden": h}


def mlp(bias: bool = True) -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8, bias=bias), nn.ReLU(), nn.Linear(8, 3, bias=bias))


def labels(out: torch.Tensor) -> torch.Tensor:
    return torch.randint(0, out.shape[-1], out.shape[:-1])


CASES = [
    Case("mlp", mlp, lambda b: (torch.randn(b, 6),), labels, "cross_entropy"),
    Case(
        "mlp-no-bias", lambda: mlp(False), lambda b: (torch.randn(b, 6),), labels, "cross_entropy"
    ),
    Case("mlp-mse", mlp, lambda b: (torch.randn(b, 6),), torch.randn_like, "mse"),
    Case("mlp-batch-1", mlp, lambda b: (torch.randn(b, 6),), labels, "cross_entropy", batch=1),
    # (B, T, in): a per-position loss reduced per example; tokens are the sequence
    Case("sequence", mlp, lambda b: (torch.randn(b, 7, 6),), labels, "cross_entropy"),
    Case("sequence-sum", mlp, lambda b: (torch.randn(b, 7, 6),), torch.randn_like, "mse", {}),
    Case("rank-4", mlp, lambda b: (torch.randn(b, 2, 3, 6),), torch.randn_like, "l1"),
    Case(
        "bce", mlp, lambda b: (torch.randn(b, 6),), lambda o: torch.rand_like(o), "bce_with_logits"
    ),
    Case(
        "dict-output",
        TwoInputs,
        lambda b: (torch.randn(b, 3), torch.randn(b, 2)),
        labels,
        "cross_entropy",
        output="logits",
    ),
    Case(
        "tuple-output",
        lambda: nn.Sequential(mlp(), nn.Unflatten(1, (1, 3))),
        lambda b: (torch.randn(b, 6),),
        lambda o: torch.randn_like(o),
        "mse",
    ),
]


@pytest.mark.parametrize("case", CASES, ids=repr)
def test_norms_match_loop_float64(case: Case, tmp_path):
    assert_case_matches_loop(case, torch.float64, 1e-5, cli=tmp_path)


@pytest.mark.parametrize("case", CASES[:5], ids=repr)
def test_norms_match_loop_float32(case: Case, tmp_path):
    assert_case_matches_loop(case, torch.float32, 1e-4, cli=tmp_path)


@pytest.mark.parametrize(
    ("include", "exclude"),
    [(["*"], ["0.*"]), (["2.weight"], []), (["*.bias"], []), (["*"], ["*.weight"])],
)
def test_selected_parameters(include, exclude):
    model, inputs, targets = CASES[0].build()
    got = gradscope.per_example_norms(model, inputs, targets, include=include, exclude=exclude)
    _, expected = reference_norms(model, inputs, targets, "cross_entropy", include, exclude)
    assert_rel_close(got, expected, 1e-5)


def test_token_reduction_and_ignore_index():
    torch.manual_seed(0)
    model = mlp().double()
    x = torch.randn(4, 5, 6, dtype=torch.float64)
    y = torch.randint(0, 3, (4, 5))
    y[0, :3] = -100  # ignored positions do not count toward the mean
    y[1] = -100  # an example with nothing to score has zero loss and zero gradient
    for reduction in ("mean", "sum"):
        loss = gradscope.losses.resolve_loss("cross_entropy", token_reduction=reduction)
        got = gradscope.per_example_norms(model, x, y, loss)
        _, expected = reference_norms(model, (x,), y, loss)
        assert_rel_close(got, expected, 1e-5)
        assert got[1] == 0


@pytest.mark.parametrize("class_dim", [-1, 1])
def test_class_probabilities_over_positions(class_dim):
    """Soft targets of a sequence's logits, classes last or at dim 1: each position's cross
    entropy against its distribution (with classes last, the targets were not moved with the
    logits: the batch was refused)."""
    torch.manual_seed(0)
    model = mlp().double()
    x = torch.randn(4, 5, 6, dtype=torch.float64)
    y = torch.softmax(torch.randn(4, 5, 3, dtype=torch.float64), -1)
    loss = gradscope.losses.resolve_loss("cross_entropy", class_dim=class_dim)

    def moved(out):
        return out if class_dim == -1 else out.movedim(-1, 1)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, x):
            return moved(self.inner(x))

    targets = moved(y)
    got = gradscope.per_example_norms(Model(), x, targets, loss)

    def by_hand(out, t):  # each position's cross entropy, then their mean
        return -(t * out.log_softmax(class_dim)).sum(class_dim).mean(-1)

    _, expected = reference_norms(Model(), (x,), targets, by_hand)
    assert_rel_close(got, expected, 1e-10)


def test_callable_loss():
    model, inputs, targets = CASES[2].build()

    def huber(out, target):
        return nn.functional.huber_loss(out, target, reduction="none").sum(1)

    got = gradscope.per_example_norms(model, inputs, targets, huber)
    _, expected = reference_norms(model, inputs, targets, huber)
    assert_rel_close(got, expected, 1e-5)


def test_inplace_activation_after_linear_is_exact():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(6, 8), nn.ReLU(inplace=True), nn.Linear(8, 3), nn.ReLU(inplace=True)
    ).double()
    x, y = torch.randn(5, 6, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)
    got = gradscope.per_example_norms(model, x, y, "mse")
    _, expected = reference_norms(model, (x,), y, "mse")
    assert_rel_close(got, expected, 1e-5)


def test_model_state_left_as_found():
    model, inputs, targets = CASES[0].build()
    model.train()
    model[0].weight.requires_grad_(False)
    model[2].weight.grad = torch.ones_like(model[2].weight)
    hooks_before = [len(m._forward_hooks) for m in model.modules()]
    gradscope.per_example_norms(model, inputs, targets)
    assert model.training and all(m.training for m in model.modules())
    assert not model[0].weight.requires_grad and model[2].weight.requires_grad
    assert torch.equal(model[2].weight.grad, torch.ones_like(model[2].weight))
    assert model[0].bias.grad is None
    assert [len(m._forward_hooks) for m in model.modules()] == hooks_before


def test_hooks_removed_after_an_error():
    model, inputs, _ = CASES[0].build()
    with pytest.raises(gradscope.errors.GradscopeError):
        gradscope.per_example_norms(model, inputs, torch.zeros(2, dtype=torch.long))
    assert all(not m._forward_hooks for m in model.modules())


@pytest.mark.parametrize(
    ("second", "named"),
    [(1, "int"), (torch.tensor(1), r"of shape \(\)"), (torch.zeros(3, 6), r"of shape \(3, 6\)")],
)
def test_an_input_not_batched_is_refused_naming_it(second, named: str):
    """An input that is not a tensor of the batch's examples (a setting passed as an input, a
    tensor shared by the examples) is named, before any example is cut from it wrongly."""
    model, (x,), y = CASES[0].build()
    with pytest.raises(gradscope.errors.ModelError, match=f"input 1 is {named} where the targets"):
        gradscope.per_example_norms(model, (x, second), y)
    with pytest.raises(gradscope.errors.ModelError, match="the targets must be a tensor"):
        gradscope.per_example_norms(model, x, y[0])


def test_nonfinite_example_leaves_others_exact():
    model, (x,), y = CASES[0].build()
    x[2, 0] = float("nan")
    got = gradscope.per_example_norms(model, x, y)
    _, expected = reference_norms(model, (x[[0, 1, 3, 4]],), y[[0, 1, 3, 4]], "cross_entropy")
    assert got[2].isnan()
    assert_rel_close(got[[0, 1, 3, 4]], expected, 1e-5)
