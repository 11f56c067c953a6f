"""`--precondition` with an Adam/AdamW state: each entry matched to its parameter by the names
torch records, by position only where that can be trusted, and refused otherwise."""

from __future__ import annotations

import copy
from pathlib import Path

import pandas as pd
import pytest
import torch
from project import make_project, one_error
from torch import nn
from typer.testing import CliRunner

from gradscope.cli import app
from gradscope.engine import Engine, naive_grads
from gradscope.io.model import import_object
from gradscope.losses import resolve_loss

N = 10
runner = CliRunner()


def square_net(root: Path) -> tuple[Path, nn.Module]:
    """The project with every weight 5 x 5 and every bias of 5: entries matched to the wrong
    parameters would pass every shape check."""
    config = make_project(root, n=N, model__kwargs={"hidden": 5, "classes": 5})
    torch.manual_seed(0)
    net = import_object(f"{root / 'model.py'}:Net", "test")(hidden=5, classes=5)
    torch.save(net.state_dict(), root / "net.pt")
    return config, net


def stepped(net: nn.Module, groups: list[dict], root: Path) -> torch.optim.AdamW:
    """An AdamW over ``groups`` after three steps, its state saved to adam.pt; the model's
    weights stay those of net.pt."""
    saved = copy.deepcopy(net.state_dict())
    opt = torch.optim.AdamW(groups, betas=(0.9, 0.95), eps=1e-3)
    g = torch.Generator().manual_seed(3)
    for scale in (1.0, 5.0, 0.2):  # parameters' moments differ: a swap changes every score
        opt.zero_grad()
        (scale * net(torch.randn(6, 5, generator=g)).square().sum()).backward()
        opt.step()
    net.load_state_dict(saved)
    torch.save(opt.state_dict(), root / "adam.pt")
    return opt


def self_influence(root: Path, net: nn.Module, opt: torch.optim.AdamW) -> torch.Tensor:
    """sum over parameters of g_i^2 / (sqrt(v_hat) + eps), each with its own state, in float64."""
    data = torch.load(root / "data.pt")
    loss = resolve_loss("cross_entropy")
    double = copy.deepcopy(net).double()
    names = [n for n, _ in net.named_parameters()]
    with Engine(double, loss):
        _, grads = naive_grads(double, (data["x"].double(),), data["y"], loss, names)
    total = torch.zeros(N, dtype=torch.float64)
    for name, p in net.named_parameters():
        state = opt.state[p]
        v_hat = state["exp_avg_sq"].double() / (1 - 0.95 ** state["step"].item())
        total += (grads[name].square() / (v_hat.sqrt() + 1e-3)).flatten(1).sum(1)
    return total


def named(net: nn.Module, *names: str) -> list[tuple[str, nn.Parameter]]:
    params = dict(net.named_parameters())
    return [(n, params[n]) for n in names]


def weight_decay_split(net: nn.Module, with_names: bool) -> list[dict]:
    """Weights, then biases (no decay), each the second layer first: not the model's order."""
    weights, biases = named(net, "fc2.weight", "fc1.weight"), named(net, "fc2.bias", "fc1.bias")
    if not with_names:
        weights, biases = [p for _, p in weights], [p for _, p in biases]
    return [{"params": weights}, {"params": biases, "weight_decay": 0.0}]


def scores(config: Path, *args: str) -> pd.DataFrame:
    result = runner.invoke(app, ["norms", str(config), *args])
    assert result.exit_code == 0, result.output
    return pd.read_parquet(config.parent / "scores.parquet")


def test_named_groups_in_another_order_are_matched_by_name(tmp_path):
    config, net = square_net(tmp_path)
    opt = stepped(net, weight_decay_split(net, with_names=True), tmp_path)
    frame = scores(config, "--precondition", str(tmp_path / "adam.pt"))
    expected = self_influence(tmp_path, net, opt)
    torch.testing.assert_close(
        torch.tensor(frame["self_influence"].to_numpy()), expected, rtol=1e-4, atol=0
    )


def test_unnamed_groups_are_refused(tmp_path):
    config, net = square_net(tmp_path)
    stepped(net, weight_decay_split(net, with_names=False), tmp_path)
    args = ["norms", str(config), "--precondition", str(tmp_path / "adam.pt")]
    line = one_error(runner.invoke(app, args))
    assert line.startswith(
        "error: the optimizer state has 2 parameter groups and no parameter names"
    ), line
    assert line.endswith(f"({tmp_path / 'adam.pt'})")


def test_one_unnamed_group_is_matched_by_position(tmp_path):
    config, net = square_net(tmp_path)
    opt = stepped(net, [{"params": list(net.parameters())}], tmp_path)
    frame = scores(config, "--precondition", str(tmp_path / "adam.pt"))
    expected = self_influence(tmp_path, net, opt)
    torch.testing.assert_close(
        torch.tensor(frame["self_influence"].to_numpy()), expected, rtol=1e-4, atol=0
    )


def test_a_named_state_without_a_selected_parameter(tmp_path):
    config, net = square_net(tmp_path)
    stepped(net, [{"params": named(net, "fc2.weight", "fc2.bias")}], tmp_path)
    args = ["norms", str(config), "--precondition", str(tmp_path / "adam.pt")]
    line = one_error(runner.invoke(app, args))
    assert line.startswith(
        "error: the optimizer state has no entry for parameter fc1.weight (it names fc2.weight, "
        "fc2.bias)"
    ), line
    config.write_text(config.read_text() + "params:\n  include: ['fc2.*']\n")
    assert scores(config, "--precondition", str(tmp_path / "adam.pt"))["finite"].all()


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_nan_in_the_state_is_named(tmp_path, value):
    config, net = square_net(tmp_path)
    stepped(net, [{"params": list(net.named_parameters())}], tmp_path)
    state = torch.load(tmp_path / "adam.pt")
    state["state"][1]["exp_avg_sq"][2] = value  # fc1.bias
    torch.save(state, tmp_path / "adam.pt")
    args = ["norms", str(config), "--precondition", str(tmp_path / "adam.pt")]
    line = one_error(runner.invoke(app, args))
    assert line.startswith(
        "error: Adam's second moment (exp_avg_sq) for parameter fc1.bias holds NaN or infinite "
        "values"
    ), line


def test_a_zero_denominator_is_named(tmp_path):
    """eps 0 and a second moment of 0 (an entry never updated): g / 0, every score NaN, which
    the run wrote with exit 0 before."""
    config, net = square_net(tmp_path)
    stepped(net, [{"params": list(net.named_parameters())}], tmp_path)
    state = torch.load(tmp_path / "adam.pt")
    state["state"][1]["exp_avg_sq"][2] = 0.0  # fc1.bias
    state["param_groups"][0]["eps"] = 0.0
    torch.save(state, tmp_path / "adam.pt")
    args = ["norms", str(config), "--precondition", str(tmp_path / "adam.pt")]
    line = one_error(runner.invoke(app, args))
    assert "Adam's sqrt(v_hat) + eps is 0 for 1 entries of parameter fc1.bias (eps 0)" in line


def _spoil(state: dict, how: str) -> None:
    if how == "step-0":
        state["state"][1]["step"] = torch.tensor(0.0)
    elif how == "moment-not-a-tensor":
        state["state"][1]["exp_avg_sq"] = [1.0]
    elif how == "no-betas":
        del state["param_groups"][0]["betas"]
    elif how == "never-stepped":  # no gradient reached it: torch keeps no entry
        del state["state"][1]
    else:  # entries not a mapping
        state["state"] = [1, 2]


@pytest.mark.parametrize(
    ("how", "message"),
    [
        ("step-0", "the optimizer state's entry for parameter fc1.bias is not an Adam second "
         "moment after a step"),
        ("moment-not-a-tensor", "the optimizer state's entry for parameter fc1.bias is not an "
         "Adam second moment after a step"),
        ("no-betas", "the optimizer state's parameter group has no Adam betas and eps"),
        ("never-stepped", "the optimizer state holds nothing for parameter fc1.bias: the "
         "optimizer never stepped it"),
        ("entries-a-list", "not an optimizer state_dict ('state' is a mapping of entries)"),
    ],
)  # fmt: skip
def test_a_damaged_state_is_one_line(tmp_path, how, message):
    config, net = square_net(tmp_path)
    stepped(net, [{"params": list(net.named_parameters())}], tmp_path)
    state = torch.load(tmp_path / "adam.pt")
    _spoil(state, how)
    torch.save(state, tmp_path / "adam.pt")
    args = ["norms", str(config), "--precondition", str(tmp_path / "adam.pt")]
    line = one_error(runner.invoke(app, args))
    assert line.startswith(f"error: {message}") and line.endswith(f"({tmp_path / 'adam.pt'})")
