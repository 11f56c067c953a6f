"""Attribution through training against central finite differences of ``fit`` (each row's weight
1 +- eps, the same seed and order), in float64; the functional optimizer steps against PyTorch's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from gradscope.config import TrainConfig, load_config
from gradscope.errors import ConfigError, DataError, GradscopeError, Interrupted, ModelError
from gradscope.training import fit
from gradscope.training.adjoint import Problem
from gradscope.training.recipe import make_optimizer
from gradscope.training.replay import through_training
from gradscope.training.run import train_model
from gradscope.training.steps import Update, clip
from tests.project import edit_config, edit_data, made_by_code, make_project

RECIPES = {
    "sgd": {"optimizer": "sgd", "lr": 0.3, "epochs": 3},
    "sgd-momentum-decay": {"optimizer": "sgd", "lr": 0.2, "momentum": 0.9, "weight_decay": 0.01,
                           "steps": 8},
    "sgd-nesterov-clip": {"optimizer": "sgd", "lr": 0.2, "momentum": 0.9, "nesterov": True,
                          "weight_decay": 0.01, "steps": 11, "clip": 0.5},
    "adam-linear-decay-clip": {"optimizer": "adam", "lr": 0.05, "schedule": "linear", "warmup": 3,
                               "epochs": 2, "clip": 0.5, "weight_decay": 0.01},
    "adamw-cosine-warmup": {"optimizer": "adamw", "lr": 0.05, "weight_decay": 0.1,
                            "schedule": "cosine", "warmup": 4, "epochs": 4, "batch_size": 5},
    "adamw-cosine-warmup-clip": {"optimizer": "adamw", "lr": 0.05, "weight_decay": 0.1,
                                 "schedule": "cosine", "warmup": 2, "steps": 7, "clip": 0.3},
}  # fmt: skip
DROPOUT = """
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.drop = nn.Linear(5, 8), nn.Linear(8, 3), nn.Dropout(0.3)

    def forward(self, x):
        return self.fc2(self.drop(torch.tanh(self.fc1(x))))
"""
N = 10


def project(root: Path, train: dict, factory: str = "model.py:Net") -> Path:
    """A float64 project of N rows, and three reference rows in ref.pt."""
    (root / "drop.py").write_text(DROPOUT)
    config = make_project(root, n=N, train=train, dtype="float64", model__factory=factory)
    g = torch.Generator().manual_seed(5)
    ref = {"x": torch.randn(3, 5, generator=g), "y": torch.randint(0, 3, (3,), generator=g)}
    torch.save(ref, root / "ref.pt")
    return config


def recorded(root: Path, train: dict, factory: str = "model.py:Net", segment: int = 3):
    cfg = load_config(project(root, train, factory))
    return cfg, train_model(cfg, root / "out.pt", record=True, segment=segment).record


def reference_losses(cfg, weights: np.ndarray, root: Path) -> np.ndarray:
    """(R,) each reference's loss after training with the rows' ``weights``."""
    ref = torch.load(root / "ref.pt")
    model = fit(cfg, seed=cfg.train.seed, weights=weights)
    return F.cross_entropy(model(ref["x"].double()), ref["y"], reduction="none").detach().numpy()


def finite_differences(cfg, root: Path, eps: float = 1e-5) -> np.ndarray:
    """(N, R) -d loss_r / d w_i by central differences: influence's sign."""
    rows = []
    for i in range(N):
        e = np.zeros(N)
        e[i] = eps
        up, down = reference_losses(cfg, 1 + e, root), reference_losses(cfg, 1 - e, root)
        rows.append(-(up - down) / (2 * eps))
    return np.stack(rows)


def close(got: np.ndarray, want: np.ndarray, rel: float = 1e-6) -> bool:
    return np.abs(got - want).max() <= rel * np.abs(want).max()


@pytest.mark.parametrize("name", RECIPES)
def test_scores_are_finite_differences(tmp_path, name):
    cfg, run = recorded(tmp_path, RECIPES[name])
    got = through_training(cfg, run, tmp_path / "ref.pt")  # (N,) against the mean loss
    assert close(got, finite_differences(cfg, tmp_path).mean(1))


def test_dropout_masks_are_replayed(tmp_path):
    train = RECIPES["adamw-cosine-warmup"]
    cfg, run = recorded(tmp_path, train, "drop.py:Net", segment=4)
    got = through_training(cfg, run, tmp_path / "ref.pt")
    assert close(got, finite_differences(cfg, tmp_path).mean(1))


def test_per_ref_is_each_reference_alone(tmp_path):
    cfg, run = recorded(tmp_path, RECIPES["adam-linear-decay-clip"])
    both = through_training(cfg, run, tmp_path / "ref.pt", per_ref=True)  # (N, 3)
    assert both.shape == (N, 3)
    assert close(both, finite_differences(cfg, tmp_path))
    ref = torch.load(tmp_path / "ref.pt")
    for r in range(3):
        torch.save({k: v[r : r + 1] for k, v in ref.items()}, tmp_path / "one.pt")
        alone = through_training(cfg, run, tmp_path / "one.pt")
        np.testing.assert_allclose(both[:, r], alone, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize(
    "name", ["sgd-nesterov-clip", "adam-linear-decay-clip", "adamw-cosine-warmup"]
)
def test_steps_are_torchs(name):
    """The functional step is PyTorch's, step by step, to 1e-12 in float64, with a weight
    whose gradient is exactly 0 (Adam's second moment 0: no NaN in the derivative either)."""
    train = TrainConfig(**RECIPES[name])
    g = torch.Generator().manual_seed(0)
    params = [
        torch.randn(4, 3, generator=g, dtype=torch.float64),
        torch.zeros(2, dtype=torch.float64),
    ]
    torch_params = [torch.nn.Parameter(p.clone()) for p in params]
    opt = make_optimizer(train, torch_params)
    update = Update(train)
    state = update.state_of(opt, torch_params)
    for t in range(5):
        lr = 0.05 * (t + 1) / 5
        grads = [
            torch.randn(4, 3, generator=g, dtype=torch.float64),
            torch.zeros(2, dtype=torch.float64),
        ]
        for p, gr in zip(torch_params, grads, strict=True):
            p.grad = gr.clone()
        if train.clip:
            torch.nn.utils.clip_grad_norm_(torch_params, train.clip)
        for group in opt.param_groups:
            group["lr"] = lr
        opt.step()
        leaves = [p.clone().requires_grad_() for p in params]
        params, state = update(leaves, state, clip(grads, train.clip), lr, t)
        derivative = torch.autograd.grad(
            sum(p.sum() for p in params) + sum(s.sum() for s in state), leaves
        )
        assert all(torch.isfinite(d).all() for d in derivative)
        params, state = [p.detach() for p in params], [s.detach() for s in state]
        for a, b in zip(params, torch_params, strict=True):
            assert torch.allclose(a, b, rtol=1e-12, atol=1e-14)
        for a, b in zip(state, update.state_of(opt, torch_params), strict=True):
            assert torch.allclose(a, b, rtol=1e-12, atol=1e-14)


def test_a_killed_replay_continues_from_its_last_segment(tmp_path):
    cfg, run = recorded(tmp_path, RECIPES["adamw-cosine-warmup"])  # 8 steps, segments of 3
    whole = through_training(cfg, run, tmp_path / "ref.pt", per_ref=True)
    walked = []

    def kill(n: int) -> None:
        walked.append(n)
        if len(walked) == 5:  # in the second segment walked back
            raise KeyboardInterrupt

    with pytest.raises(Interrupted, match="1 of 3 segments replayed"):
        through_training(
            cfg, run, tmp_path / "ref.pt", per_ref=True, partial=tmp_path / "p", on_step=kill
        )
    walked.clear()
    again = through_training(
        cfg, run, tmp_path / "ref.pt", per_ref=True, partial=tmp_path / "p", on_step=walked.append
    )
    assert walked == [2] + [1] * 6  # the last segment's 2 steps done; 6 to go
    np.testing.assert_array_equal(again, whole)
    walked.clear()
    other = through_training(
        cfg, run, tmp_path / "ref.pt", partial=tmp_path / "p", on_step=walked.append
    )
    assert walked == [1] * 8  # another replay (the mean, not per reference) starts over
    np.testing.assert_allclose(other, whole.mean(1), rtol=1e-10, atol=1e-14)


def test_a_killed_replay_of_a_function_reference_continues_only_for_the_same_gradients(tmp_path):
    """A reference made by a ``file.py:fn`` has no data hash: its saved adjoints are kept for
    the references' gradients, so another function's references start the replay over (they
    continued the first's, and scored against it without a word)."""
    cfg, run = recorded(tmp_path, RECIPES["adamw-cosine-warmup"])
    for name, rows in (("first", "[:2]"), ("last", "[2:]")):
        (tmp_path / f"{name}.py").write_text(
            f"import torch\n\ndef make():\n    d = torch.load({str(tmp_path / 'ref.pt')!r})\n"
            f"    return {{'x': d['x']{rows}, 'y': d['y']{rows}}}\n"
        )
    first, last = f"{tmp_path / 'first.py'}:make", f"{tmp_path / 'last.py'}:make"
    whole = through_training(cfg, run, last)
    walked: list[int] = []

    def kill(n: int) -> None:
        walked.append(n)
        if len(walked) == 5:  # in the second segment walked back
            raise KeyboardInterrupt

    with pytest.raises(Interrupted, match="1 of 3 segments replayed"):
        through_training(cfg, run, first, partial=tmp_path / "p", on_step=kill)
    walked.clear()
    again = through_training(cfg, run, last, partial=tmp_path / "p", on_step=walked.append)
    assert walked == [1] * 8  # started over
    np.testing.assert_array_equal(again, whole)


NUMPY_NOISE = """
import numpy as np
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 3)

    def forward(self, x):
        noise = torch.as_tensor(np.random.rand(*x.shape)) if self.training else 0
        return self.fc(x + noise)
"""
UNUSED = """
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.head = nn.Linear(5, 3), nn.Linear(5, 2)  # head: never called

    def forward(self, x):
        return self.fc(x)
"""
OWN_GENERATOR = """
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.g = nn.Linear(5, 3), torch.Generator().manual_seed(0)

    def forward(self, x):
        if self.training:  # dropout of its own generator's: fresh at the start of the run
            x = x * (torch.rand(x.shape, generator=self.g, dtype=x.dtype) > 0.3) / 0.7
        return self.fc(x)
"""
BATCHNORM = """
from torch import nn


class Net(nn.Sequential):
    def __init__(self):
        super().__init__(nn.Linear(5, 4), nn.BatchNorm1d(4), nn.Linear(4, 3))
"""


def _edit(run: Path, name: str, edit) -> None:
    path = run / name
    path.write_bytes(edit(path.read_bytes()))


def _remanifest(run: Path, name: str) -> None:
    import json

    from gradscope.io.files import file_sha256

    manifest = json.loads((run / "manifest.json").read_text())
    manifest[name] = file_sha256(run / name)
    (run / "manifest.json").write_text(json.dumps(manifest))


REFUSALS = {
    "no record": (lambda run, root: __import__("shutil").rmtree(run), "no run record"),
    "unfinished": (lambda run, root: (run / "manifest.json").unlink(), "unfinished run record"),
    "edited": (
        lambda run, root: _edit(run, "steps.pt", lambda b: b[:-9] + bytes([b[-9] ^ 1]) + b[-8:]),
        "steps.pt changed after it was written",
    ),
    "truncated": (
        lambda run, root: _edit(run, "segment-00001.pt", lambda b: b[: len(b) // 2]),
        "segment-00001.pt changed",
    ),
    "missing": (lambda run, root: (run / "final.pt").unlink(), "lacks final.pt"),
    # forged: edited, and the manifest's sha256 written anew
    "record.json a list": (
        lambda run, root: ((run / "record.json").write_text("[]"), _remanifest(run, "record.json")),
        "record.json is not one gradscope wrote",
    ),
    "no segment": (
        lambda run, root: (
            _edit(run, "record.json", lambda b: b.replace(b'"segment": 3', b'"segment": 0')),
            _remanifest(run, "record.json"),
        ),
        "a run of no steps or segments of none",
    ),
    "a row outside": (
        lambda run, root: (
            torch.save(
                {**torch.load(run / "steps.pt"), "picked": torch.full((24,), 99)}, run / "steps.pt"
            ),  # fmt: skip
            _remanifest(run, "steps.pt"),
        ),
        "steps.pt is not its 8 steps' rows of the 10 training rows",
    ),
    "manifest not a map": (
        lambda run, root: (run / "manifest.json").write_text("null"),
        "manifest is not its files' sha256 by name",
    ),
    "manifest outside": (
        lambda run, root: (run / "manifest.json").write_text('{"../data.pt": "0"}'),
        "names a file outside its folder",
    ),
    "extra": (lambda run, root: (run / "segment-00009.pt").write_bytes(b""), "holds segment-00009"),
    "other data": (
        lambda run, root: torch.save(
            {k: v.flip(0) for k, v in torch.load(root / "data.pt").items()}, root / "data.pt"
        ),
        "different file .*data.pt",
    ),
    "nondeterministic": (
        lambda run, root: (
            _edit(
                run,
                "record.json",
                lambda b: b.replace(b'"deterministic": true', b'"deterministic": false'),
            ),
            _remanifest(run, "record.json"),
        ),
        "without torch.use_deterministic_algorithms",
    ),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_a_record_that_cannot_be_replayed_is_one_line(tmp_path, case):
    cfg, run = recorded(tmp_path, RECIPES["sgd-momentum-decay"])
    spoil, message = REFUSALS[case]
    spoil(run, tmp_path)
    with pytest.raises(GradscopeError, match=message) as raised:
        through_training(cfg, run, tmp_path / "ref.pt")
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"train": {**RECIPES["sgd-momentum-decay"], "lr": 0.1}}, "different train.lr"),
        ({"train": {"fn": "model.py:Net"}}, "train.fn is a loop of your own"),
        ({"train": RECIPES["sgd-momentum-decay"], "loss__name": "nll"}, "different loss.name"),
    ],
)
def test_a_record_of_another_config_is_refused(tmp_path, change, message):
    _, run = recorded(tmp_path, RECIPES["sgd-momentum-decay"])
    other = load_config(make_project(tmp_path, n=N, dtype="float64", **change))
    with pytest.raises(ConfigError, match=message):
        through_training(other, run, tmp_path / "ref.pt")


def test_a_record_over_data_made_by_code_is_refused_once_its_rows_change(tmp_path):
    """``rows.py:make`` reads data.pt, which no config names: the record keeps the rows'
    sha256, so a replay over other rows is refused, not scored against the run."""
    project(tmp_path, RECIPES["sgd-momentum-decay"])
    edit_config(tmp_path, lambda c: c["data"].update(path=made_by_code(tmp_path)))
    cfg = load_config(tmp_path / "config.yaml")
    run = train_model(cfg, tmp_path / "out.pt", record=True, segment=3).record
    assert np.isfinite(through_training(cfg, run, tmp_path / "ref.pt")).all()
    edit_data(tmp_path, lambda d: d["x"][0].add_(1))
    with pytest.raises(ConfigError, match="made with a different data made by code"):
        through_training(cfg, run, tmp_path / "ref.pt")


@pytest.mark.parametrize(
    ("code", "error", "message"),
    [
        (NUMPY_NOISE, ModelError, "does not reach its weights after step 8"),
        (BATCHNORM, ModelError, "buffers change as it trains"),
        # torch's optimizers skip a weight of no gradient: a traceback before
        (UNUSED, ModelError, "parameter head.weight gets no gradient at step"),
    ],
)
def test_a_run_gradscope_cannot_retrace_is_refused(tmp_path, code, error, message):
    (tmp_path / "other.py").write_text(code)
    cfg, run = recorded(tmp_path, RECIPES["sgd-momentum-decay"], "other.py:Net")
    with pytest.raises(error, match=message):
        through_training(cfg, run, tmp_path / "ref.pt")


def test_a_generator_of_the_models_own_is_refused_in_one_segment(tmp_path):
    """A fresh model's own generator replays one segment's masks (its end checks out), then
    has moved on when the walk back recomputes each step: the scores were 24% off."""
    (tmp_path / "other.py").write_text(OWN_GENERATOR)
    cfg, run = recorded(tmp_path, RECIPES["sgd-momentum-decay"], "other.py:Net", segment=100)
    with pytest.raises(ModelError, match="the step recomputed on the walk back does not reach"):
        through_training(cfg, run, tmp_path / "ref.pt")


def test_an_optimizer_gradscope_does_not_know_is_refused():
    with pytest.raises(DataError, match="'lion' is none gradscope can replay"):
        Update(TrainConfig(optimizer="lion"))


def test_references_vmapped_or_one_at_a_time_agree(tmp_path, monkeypatch):
    """The walk keeps whichever double backward is faster for R references: both are the same."""
    cfg, run = recorded(tmp_path, RECIPES["sgd-nesterov-clip"])
    reverse, got = Problem.reverse, {}
    for batched in (True, False):

        def forced(self, *args, batched=batched):
            return reverse(self, *args[:5], batched)

        monkeypatch.setattr(Problem, "reverse", forced)
        got[batched] = through_training(cfg, run, tmp_path / "ref.pt", per_ref=True)
    np.testing.assert_allclose(got[True], got[False], rtol=1e-12, atol=1e-15)
