"""A custom loss that mixes the examples of a batch has no per-example gradient: refused in one
line, not scored as each example alone (which gave every grad_norm 0); a model the trace only
loses track of is still scored exactly by the fallback."""

from __future__ import annotations

import torch
from oracle import assert_rel_close, reference_norms
from project import load_net, make_project
from typer.testing import CliRunner

import gradscope
from gradscope.cli import app
from gradscope.errors import ModelError

CENTRED = """
import torch.nn.functional as F


def centred(outputs, targets):
    losses = F.cross_entropy(outputs, targets, reduction="none")
    return losses - losses.mean()
"""


def test_a_loss_that_mixes_examples_is_refused_through_the_cli(tmp_path):
    (tmp_path / "losses.py").write_text(CENTRED)
    config = make_project(tmp_path, loss={"name": "losses.py:centred"})
    result = CliRunner().invoke(app, ["norms", str(config)])
    assert result.exit_code == 2, result.output
    (line,) = result.stderr.splitlines()
    assert line.startswith("error: example 0's loss is") and line.endswith("(loss)"), line
    assert "mixes the examples of a batch" in line
    assert not (tmp_path / "scores.parquet").exists()


def test_a_loss_that_mixes_examples_is_refused_through_the_api(tmp_path):
    make_project(tmp_path)
    net, x, y = load_net(tmp_path)

    def centred(outputs, targets):
        losses = torch.nn.functional.cross_entropy(outputs, targets, reduction="none")
        return losses - losses.mean()

    try:
        gradscope.per_example_norms(net, x, y, loss=centred)
    except ModelError as e:
        assert "mixes the examples" in str(e)
    else:
        raise AssertionError("a loss that mixes examples was scored")


def test_losses_the_trace_cannot_follow_are_still_exact(tmp_path):
    """A loss that reads the batch's sum at zero weight: the trace calls it a mix, yet each
    example alone gives its batch loss, and the fallback scores it exactly."""
    make_project(tmp_path)
    net, x, y = load_net(tmp_path)
    net = net.double()
    x = x.double()

    def per_example(outputs, targets):
        losses = torch.nn.functional.cross_entropy(outputs, targets, reduction="none")
        return losses * (losses.sum() * 0 + 1)  # the batch's sum: the trace calls it a mix

    norms = gradscope.per_example_norms(net, x, y, loss=per_example)
    expected = reference_norms(net, (x,), y, per_example)[1]
    assert_rel_close(norms, expected, 1e-9)


class _BatchStats(torch.nn.Module):
    """A conv, a batch norm on the batch's own statistics, a head; or F.batch_norm(training=True)
    on (B, C) rows, which an example alone cannot run."""

    def __init__(self, functional: bool = False):
        super().__init__()
        self.functional = functional
        self.conv = torch.nn.Conv2d(3, 5, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(5, track_running_stats=False)
        self.head = torch.nn.Linear(5, 4)

    def forward(self, x):
        if self.functional:
            h = self.conv(x).mean((2, 3))
            return self.head(torch.nn.functional.batch_norm(h, None, None, training=True))
        return self.head(torch.relu(self.bn(self.conv(x))).mean((2, 3)))


def test_batch_statistics_no_scored_parameter_owns_are_refused():
    """The batch norm's own rule refused it only where its parameters were scored: a frozen
    backbone's (or include= the head) scored every batch 10-12% off the loop, unsaid."""
    torch.manual_seed(0)
    x, y = torch.randn(8, 3, 4, 4, dtype=torch.float64), torch.randint(0, 4, (8,))
    frozen = _BatchStats().double()
    for p in [*frozen.conv.parameters(), *frozen.bn.parameters()]:
        p.requires_grad_(False)
    for model, kwargs in ((frozen, {}), (_BatchStats().double(), {"include": ["head.*"]})):
        try:
            gradscope.per_example_norms(model, x, y, **kwargs)
        except ModelError as e:
            assert "a batch norm on the batch's own statistics" in str(e), e
        else:
            raise AssertionError("batch statistics were scored")
    try:
        gradscope.per_example_norms(_BatchStats(functional=True).double(), x, y)
    except ModelError as e:
        assert "example 0 alone fails where its batch runs" in str(e), e
        assert "a batch norm on the batch's own statistics" in str(e), e
    else:
        raise AssertionError("batch statistics were scored")


def test_a_loss_scaled_by_the_batch_s_size_is_refused(tmp_path):
    """``ce * len(y)``: each example's gradient changed with the size of its batch (7.0 at 8,
    4.0 at 5 times the loop's), which no trace of the model sees."""
    make_project(tmp_path)
    net, x, y = load_net(tmp_path)

    def scaled(outputs, targets):
        return torch.nn.functional.cross_entropy(outputs, targets, reduction="none") * len(targets)

    def doubled(outputs, targets):
        return torch.nn.functional.cross_entropy(outputs, targets, reduction="none") * 2.0

    try:
        gradscope.per_example_norms(net, x, y, loss=scaled)
    except ModelError as e:
        assert "or a scale by the batch's size" in str(e), e
    else:
        raise AssertionError("a loss scaled by the batch's size was scored")
    assert_rel_close(gradscope.per_example_norms(net, x, y, loss=doubled),
                     2 * gradscope.per_example_norms(net, x, y), 1e-6)  # fmt: skip


def test_losses_of_the_user_s_that_the_alone_check_must_let_be(tmp_path):
    """A squeezed (B, 1) loss (a () alone), outputs cut along another dimension than the batch
    (time-first, T == B), and a loss that draws: scored, scored, refused for what it is."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1))
    net = net.double()
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 1, dtype=torch.float64)
    mse = torch.nn.functional.mse_loss
    plain = gradscope.per_example_norms(net, x, y, lambda o, t: mse(o, t, reduction="none")[:, 0])
    squeezed = gradscope.per_example_norms(
        net, x, y, lambda o, t: mse(o, t, reduction="none").squeeze()
    )
    assert torch.equal(plain, squeezed)

    def noisy(o, t):
        return mse(o + 0.1 * torch.randn_like(o), t, reduction="none")[:, 0]

    try:
        gradscope.per_example_norms(net, x, y, noisy)
    except ModelError as e:
        assert "another value on a second call (it draws random numbers?)" in str(e), e
    else:
        raise AssertionError("a loss that draws was scored")


def test_an_instance_norm_written_as_a_batch_norm_stays_per_example():
    """AdaIN's F.batch_norm(x.view(1, B * C, H, W), training=True): each channel one example's."""

    class AdaIN(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.head = torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.Linear(4, 3)

        def forward(self, x):
            h = self.conv(x)
            b, c = h.shape[:2]
            h = torch.nn.functional.batch_norm(h.reshape(1, b * c, *h.shape[2:]), None, None,
                                               training=True).reshape(h.shape)  # fmt: skip
            return self.head(h.mean((2, 3)))

    torch.manual_seed(0)
    model = AdaIN().double()
    kept = {k: v.clone() for k, v in model.state_dict().items()}
    for _ in range(2):  # two batches of one shape, other values: a fresh call each
        x, y = torch.randn(6, 3, 5, 5, dtype=torch.float64), torch.randint(0, 3, (6,))
        want = []
        for i in range(6):
            loss = torch.nn.functional.cross_entropy(model(x[i : i + 1]), y[i : i + 1])
            grads = torch.autograd.grad(loss, list(model.parameters()))
            want.append(torch.cat([g.flatten() for g in grads]).norm())
        assert_rel_close(gradscope.per_example_norms(model, x, y), torch.stack(want), 1e-10)
        assert all(torch.equal(v, kept[k]) for k, v in model.state_dict().items())
