"""A signal that torch turns into another error still ends the run as Ctrl-C does.

TorchScript runs Python called from a scripted function (``torch.jit.ignore``) and torch's own
decompositions under ``torch.func``; a KeyboardInterrupt raised there comes out as a
RuntimeError, which gradscope's handlers of a model's failure (a forward's error, vmap's) would
take for the model's: the run said "the model cannot take inputs", or went on one direction at
a time with the signal lost.
"""

from __future__ import annotations

import subprocess
import sys

from project import launch, make_project
from typer.testing import CliRunner

from gradscope.cli import app

# The model signals itself, inside a scripted function, on its ``STOP_AT``-th forward.
SIGNALLING_MODEL = """
import os
import signal

import torch

from model import Net

calls = 0


@torch.jit.ignore
def signal_self(x: torch.Tensor) -> torch.Tensor:
    global calls
    calls += 1
    if calls == int(os.environ.get("STOP_AT", 0)):
        os.kill(os.getpid(), signal.SIGTERM)
    return x


@torch.jit.script
def scripted(x: torch.Tensor) -> torch.Tensor:
    return signal_self(x) * 1.0


class SignallingNet(Net):
    def forward(self, x):
        return super().forward(scripted(x))
"""


def signalling_project(tmp_path):
    (tmp_path / "signalling.py").write_text(SIGNALLING_MODEL)
    return make_project(tmp_path, n=40, model__factory="signalling.py:SignallingNet")


def test_a_signal_inside_torchscript_in_a_forward_is_an_interruption(tmp_path):
    config = signalling_project(tmp_path)
    proc = launch(config, env={"STOP_AT": "12"})  # past the first batch's analysis
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    (line,) = stderr.strip().splitlines()
    assert line.startswith("error: interrupted with ") and "--resume" in line, line
    resumed = CliRunner().invoke(app, ["norms", str(config), "--batch-size", "2", "--resume"])
    assert resumed.exit_code == 0, resumed.output


def test_a_signal_inside_torchscript_in_a_curvature_pass_is_an_interruption(tmp_path):
    config = signalling_project(tmp_path)
    ref = tmp_path / "data.pt"  # the training rows themselves as the reference batch
    args = ["influence", str(config), "--ref", str(ref), "--curvature", "gn", "--solver", "cg"]
    proc = subprocess.run(
        [sys.executable, "-m", "gradscope", *args],
        env={**__import__("os").environ, "STOP_AT": "40", "OMP_NUM_THREADS": "1"},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr.strip().splitlines() == ["error: interrupted before any example was saved"]
