"""`gradscope check` through typer's runner: the plan, the error table and the exit status."""

from __future__ import annotations

import torch
from project import make_project
from torch import nn
from typer.testing import CliRunner

from gradscope.cli import app
from gradscope.rules import RULES, Dense, Rule
from gradscope.rules.linear import linear

runner = CliRunner()

SCALED_MODEL = '''
import torch
from torch import nn


class Net(nn.Module):
    """Linear layers (rule), a raw gain (broadcast) and a raw matrix squared, read by
    ``torch.mm`` (fallback: the tap serves ``matmul``, not ``mm``)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(5, 8), nn.Linear(8, 3)
        self.gain = nn.Parameter(torch.ones(8))
        self.mix = nn.Parameter(torch.eye(8))

    def forward(self, x):
        return self.fc2(torch.mm(torch.tanh(self.fc1(x)) * self.gain, self.mix * self.mix))
'''


def _errors(output: str, table: str = "norms") -> dict[str, float]:
    """module -> relative error, read from the rows of the norms or the influence table."""
    norms, influence = output.split("\ninfluence")
    rows = (norms.split("norms, ")[1] if table == "norms" else influence).splitlines()
    cells = [[c.strip() for c in row.split("│")[1:-1]] for row in rows if row.count("│") == 3]
    return {module: float(err) for module, err in cells}


def test_check_passes_and_prints_errors_per_module(tmp_path):
    config = make_project(tmp_path, n=11)
    result = runner.invoke(app, ["check", str(config), "--examples", "5"])
    assert result.exit_code == 0, result.output
    assert "norms, 5 examples" in result.output
    errors = _errors(result.output)
    assert set(errors) == {"fc1", "fc2", "(all)"}
    assert max(errors.values()) < 1e-4
    influence = _errors(result.output, "influence")
    assert set(influence) == {"fc1", "fc2", "hooks", "jvp"}
    assert max(influence.values()) < 1e-4
    assert "worst error" in result.output and ": ok" in result.output


def test_check_influence_against_a_reference_file(tmp_path):
    config = make_project(tmp_path, n=11)
    ref = {"x": torch.randn(6, 5), "y": torch.randint(0, 3, (6,))}
    torch.save(ref, tmp_path / "ref.pt")
    result = runner.invoke(app, ["check", str(config), "--ref", str(tmp_path / "ref.pt")])
    assert result.exit_code == 0, result.output
    assert max(_errors(result.output, "influence").values()) < 1e-4


def test_check_shows_the_fallback_in_the_plan(tmp_path):
    # no checkpoint: random initial weights are as good a check as trained ones
    config = make_project(tmp_path, n=11, model={"factory": "model.py:Net"})
    (tmp_path / "model.py").write_text(SCALED_MODEL)
    result = runner.invoke(app, ["check", str(config)])
    assert result.exit_code == 0, result.output
    rows = {line.split()[1]: line for line in result.output.splitlines() if line.count("│") > 4}
    assert "broadcast" in rows["gain"] and "fallback" in rows["mix"], rows
    assert set(_errors(result.output)) == {"fc1", "fc2", "gain", "mix", "(all)"}


def test_wrong_rule_fails_with_exit_1(tmp_path, monkeypatch):
    """A rule whose per-example gradients are wrong but add up right (the middle two examples
    swapped): the first-batch self-check (batch sums, first and last example) cannot see it;
    check must."""

    def swapped_bias(module, inputs, grad_output):
        parts = linear(module, inputs, grad_output)
        parts["bias"] = Dense(parts["bias"].materialize()[[0, 2, 1, 3]])
        return parts

    monkeypatch.setitem(RULES, nn.Linear, Rule("linear", swapped_bias))
    config = make_project(tmp_path, n=11)
    result = runner.invoke(app, ["check", str(config), "--examples", "4"])
    assert result.exit_code == 1, result.output
    assert _errors(result.output)["(all)"] > 1e-2
    assert _errors(result.output, "influence")["hooks"] > 1e-2
    assert "FAILED" in result.output


def test_rule_that_does_not_add_up_moves_to_the_fallback(tmp_path, monkeypatch):
    """The self-check: a rule whose gradients do not sum to autograd's batch gradient serves
    nothing; its parameter goes to the fallback, with the reason in the plan, and stays exact."""

    def doubled_bias(module, inputs, grad_output):
        parts = linear(module, inputs, grad_output)
        parts["bias"] = Dense(2 * parts["bias"].materialize())
        return parts

    monkeypatch.setitem(RULES, nn.Linear, Rule("linear", doubled_bias))
    config = make_project(tmp_path, n=11)
    result = runner.invoke(app, ["check", str(config), "--examples", "3"])
    assert result.exit_code == 0, result.output
    assert max(_errors(result.output).values()) < 1e-4
    rows = [line for line in result.output.splitlines() if ".bias" in line]
    assert rows and all("fallback" in row for row in rows), rows


def test_bad_examples_count_is_a_user_error(tmp_path):
    config = make_project(tmp_path, n=11)
    result = runner.invoke(app, ["check", str(config), "--examples", "0"])
    assert result.exit_code == 2
    assert "error: --examples must be at least 1" in result.output
