"""`gradscope norms` end to end on common model shapes, against the float64 per-example loop."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import pytest
import torch
import yaml
from oracle import assert_rel_close, reference_norms
from typer.testing import CliRunner

from gradscope.cli import app
from gradscope.io.model import import_object
from gradscope.io.parquet import read_metadata

MODELS_PY = '''
import torch
import torch.nn.functional as F
from torch import nn


class TutorialCNN(nn.Module):
    """The CNN of PyTorch's per-sample-gradients tutorial, on (1, 28, 28) images."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1, self.dropout2 = nn.Dropout(0.25), nn.Dropout(0.5)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
        x = torch.flatten(self.dropout1(x), 1)
        return self.fc2(self.dropout2(F.relu(self.fc1(x))))


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv1, self.gn = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.GroupNorm(2, c)
        self.conv2, self.bn = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        h = self.relu(self.gn(self.conv1(x)))
        return self.relu(x + self.bn(self.conv2(h)))


class SmallResNet(nn.Module):
    """A stem, two residual blocks (GroupNorm and BatchNorm), pooling and a linear head."""

    def __init__(self, c=8, classes=5):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU(inplace=True)
        )
        self.blocks = nn.Sequential(Block(c), Block(c))
        self.head = nn.Linear(c, classes)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


class TinyLM(nn.Module):
    """Token and learned positional embeddings, one causal encoder layer, a tied output head."""

    def __init__(self, vocab=13, d=16, context=8):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(context, d)
        self.layer = nn.TransformerEncoderLayer(d, 2, dim_feedforward=32, batch_first=True)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, tokens):
        t = tokens.shape[1]
        h = self.tok(tokens) + self.pos(torch.arange(t, device=tokens.device))
        mask = nn.Transformer.generate_square_subsequent_mask(t, dtype=h.dtype)
        return self.head(self.norm(self.layer(h, src_mask=mask, is_causal=True)))


class LSTMClassifier(nn.Module):
    def __init__(self, vocab=13, d=8, classes=3):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.lstm = nn.LSTM(d, 12, batch_first=True)
        self.head = nn.Linear(12, classes)

    def forward(self, tokens):
        out, _ = self.lstm(self.embed(tokens))
        return self.head(out[:, -1])


class LSTMLastState(LSTMClassifier):
    """The last hidden state, the layer's second output: what the recurrent rule cannot see."""

    def forward(self, tokens):
        _, (h, _) = self.lstm(self.embed(tokens))
        return self.head(h[-1])


class ComputedWeights(nn.Module):
    """Parameters read through tensors computed from them: Mamba's decay -exp(A_log) and a
    weight-norm head (g * v / ||v||, computed each forward)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(13, 8)
        self.A_log = nn.Parameter(torch.randn(8) * 0.3)
        self.v, self.g = nn.Parameter(torch.randn(3, 8)), nn.Parameter(torch.ones(3, 1))

    def forward(self, tokens):
        h = self.emb(tokens)
        decay = torch.exp(-torch.exp(self.A_log) * h)
        return F.linear(decay.mean(1), torch._weight_norm(self.v, self.g, 0))


class EditedInPlace(nn.Module):
    """A Linear's output (a view of its product) with an embedding added in place, as RoCBert's
    embeddings do: read at the product, fc stays on its rule."""

    def __init__(self):
        super().__init__()
        self.emb, self.pos = nn.Embedding(13, 8), nn.Embedding(13, 8)
        self.fc, self.head = nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, tokens):
        h = self.fc(self.emb(tokens))
        h += self.pos(tokens)
        return self.head(torch.tanh(h)).mean(1)


class TwoInputs(nn.Module):
    """An image and a feature vector in, a dict out; the loss reads "logits"."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.fc = nn.Linear(6, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, image, features):
        h = torch.tanh(self.conv(image).mean((2, 3)) + self.fc(features))
        return {"logits": self.head(h), "hidden": h}
'''


@dataclass
class Project:
    """One model of MODELS_PY with its data and loss, as an end-to-end case."""

    factory: str
    inputs: Callable[[torch.Generator, int], dict[str, torch.Tensor]]
    targets: Callable[[torch.Generator, int], torch.Tensor]
    loss: dict = field(default_factory=lambda: {"name": "cross_entropy"})
    output: str | None = None
    fallback: tuple[str, ...] = ()  # the modules no rule can serve
    n: int = 6

    def write(self, root: Path) -> tuple[Path, torch.nn.Module, tuple, torch.Tensor]:
        """model.py, a random-init checkpoint, data.pt and config.yaml; the model and data too."""
        (root / "model.py").write_text(MODELS_PY)
        torch.manual_seed(0)
        model = import_object(f"{root / 'model.py'}:{self.factory}", "test")()
        for m in model.modules():  # running statistics far from (0, 1), so eval mode matters
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
        torch.save(model.state_dict(), root / "model.pt")
        g = torch.Generator().manual_seed(1)
        inputs = self.inputs(g, self.n)
        targets = self.targets(g, self.n)
        torch.save({**inputs, "y": targets}, root / "data.pt")
        config = {
            "model": {"factory": f"model.py:{self.factory}", "checkpoint": "model.pt"},
            "data": {"path": "data.pt", "inputs": list(inputs), "targets": "y", "batch_size": 4},
            "loss": self.loss,
            "device": "cpu",
            "output": {"path": "scores.parquet"},
        }
        if self.output:
            config["model"]["output"] = self.output
        path = root / "config.yaml"
        path.write_text(yaml.safe_dump(config))
        return path, model, tuple(inputs.values()), targets


def images(*shape: int) -> Callable[[torch.Generator, int], dict[str, torch.Tensor]]:
    return lambda g, n: {"x": torch.randn(n, *shape, generator=g)}


def tokens(g: torch.Generator, n: int) -> dict[str, torch.Tensor]:
    return {"tokens": torch.randint(0, 13, (n, 8), generator=g)}


def classes(k: int) -> Callable[[torch.Generator, int], torch.Tensor]:
    return lambda g, n: torch.randint(0, k, (n,), generator=g)


PROJECTS = [
    pytest.param(Project("TutorialCNN", images(1, 28, 28), classes(10)), id="tutorial-cnn"),
    pytest.param(Project("SmallResNet", images(3, 8, 8), classes(5)), id="resnet"),
    pytest.param(
        Project("TinyLM", tokens, lambda g, n: torch.randint(0, 13, (n, 8), generator=g),
                # positions are one table looked up for all examples: the lookup is expanded
                # to the batch, and the embedding rule serves it
                {"name": "cross_entropy", "class_dim": -1, "token_reduction": "mean"}),
        id="tiny-lm",
    ),
    pytest.param(Project("LSTMClassifier", tokens, classes(3)), id="lstm"),
    pytest.param(
        Project("LSTMLastState", tokens, classes(3), fallback=("lstm",)), id="lstm-last-state"
    ),
    pytest.param(Project("ComputedWeights", tokens, classes(3)), id="computed-weights"),
    pytest.param(Project("EditedInPlace", tokens, classes(3)), id="edited-in-place"),
    pytest.param(
        Project("TwoInputs",
                lambda g, n: {"image": torch.randn(n, 1, 6, 6, generator=g),
                              "features": torch.randn(n, 6, generator=g)},
                classes(3), output="logits"),
        id="two-inputs-dict-output",
    ),
]  # fmt: skip


@pytest.mark.parametrize("project", PROJECTS)
def test_norms_cli_matches_loop(project: Project, tmp_path: Path):
    config, model, inputs, targets = project.write(tmp_path)
    result = CliRunner().invoke(app, ["norms", str(config)])
    assert result.exit_code == 0, result.output
    frame = pd.read_parquet(tmp_path / "scores.parquet")
    assert frame["example_id"].tolist() == list(range(project.n))
    loss, norm = reference_norms(
        model, inputs, targets, project.loss["name"], output=project.output
    )
    assert_rel_close(torch.tensor(frame["loss"].to_numpy()), loss, 1e-4)
    assert_rel_close(torch.tensor(frame["grad_norm"].to_numpy()), norm, 1e-4)
    # every parameter served by a rule or the fallback, none dropped
    plan = read_metadata(tmp_path / "scores.parquet")["plan"]
    assert [p["name"] for p in plan] == [n for n, _ in model.named_parameters()]
    assert all(p["rule"] != "excluded" for p in plan)
    assert {p["module"] for p in plan if p["rule"].startswith("fallback")} == set(project.fallback)
