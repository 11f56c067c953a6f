"""Which column finds which odd rows: each ranking column's detection AUROC on planted faults.

    python benchmarks/detection.py [--json benchmarks/results/cpu-2core-DATE-detection.json]

Each setting plants one kind of fault in data that ships with the project, trains a model on it
with gradscope's own recipe (``gradscope.training.fit``), scores every row with ``norms`` (and
with EK-FAC self-influence, ``g^T (F + d)^-1 g``), and measures how well each column separates
the planted rows from the rest: the AUROC (ties counted half) and the share of the planted rows
among the top k, k the number planted.

- ``digits-flipped``: the bundled digits (examples/digits), 1500 rows of which 150 have a wrong
  label; the bundled MLP and its recipe (configs/digits.yaml).
- ``digits-noise``: the same rows with their true labels, 75 of them (5%) with every pixel
  replaced by uniform noise: an atypical input, its label no help.
- ``digits-duplicates``: the true labels, and 75 rows copied over other rows with another label:
  the same input twice, the labels contradicting.
- ``cancer-flipped``: scikit-learn's breast cancer table (benchmarks/data/breast_cancer.npz,
  569 rows x 30 features, standardised), 5% of the labels flipped; a 30-32-2 MLP.

``margin`` and ``prob`` rank low first (a row the model contradicts); the rest high first.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch
import yaml

from gradscope.config import load_config
from gradscope.curvature import fit_factors
from gradscope.run import score_dataset
from gradscope.scorers import NormsScorer
from gradscope.training import fit
from gradscope.validation.metrics import auroc

ROOT = Path(__file__).resolve().parents[1]
DIGITS = ROOT / "examples" / "digits"
COLUMNS = {"grad_norm": 1, "loss": 1, "margin": -1, "prob": -1, "self_influence": 1}
CANCER_MODEL = """
from torch import nn


def mlp():
    return nn.Sequential(nn.Linear(30, 32), nn.Tanh(), nn.Linear(32, 2))
"""


def digits(kind: str, rng: np.random.Generator) -> tuple[dict, np.ndarray]:
    """The digits' tensors with ``kind``'s rows planted, and which rows they are."""
    data = torch.load(DIGITS / "digits.pt", weights_only=True)
    x, y, n = data["x"].clone(), data["y_true"].clone(), len(data["y_true"])
    if kind == "flipped":
        return {"x": x, "y": data["y"]}, data["flipped"].numpy()
    planted = np.zeros(n, dtype=bool)
    rows = rng.choice(n, n // 20, replace=False)
    planted[rows] = True
    if kind == "noise":
        x[rows] = torch.as_tensor(rng.random((len(rows), x.shape[1])), dtype=x.dtype)
    else:  # duplicates: each planted row the copy of a clean row of another label
        sources = rng.choice(np.flatnonzero(~planted), len(rows), replace=False)
        for row, source in zip(rows, sources, strict=True):
            x[row] = x[source]
            if y[row] == y[source]:
                y[row] = (y[source] + 1 + int(rng.integers(9))) % 10
    return {"x": x, "y": y}, planted


def cancer(rng: np.random.Generator) -> tuple[dict, np.ndarray]:
    data = np.load(ROOT / "benchmarks" / "data" / "breast_cancer.npz")
    x = (data["x"] - data["x"].mean(0)) / data["x"].std(0)
    y = data["y"].copy()
    planted = np.zeros(len(y), dtype=bool)
    planted[rng.choice(len(y), len(y) // 20, replace=False)] = True
    y[planted] = 1 - y[planted]
    return {"x": torch.as_tensor(x), "y": torch.as_tensor(y)}, planted


def config(folder: Path, setting: str) -> Path:
    """The setting's config in ``folder``: the model, the planted data, the recipe."""
    if setting.startswith("digits"):
        raw = yaml.safe_load((ROOT / "configs" / "digits.yaml").read_text())
        raw["model"]["factory"] = str(DIGITS / "model.py") + ":DigitsMLP"
        raw.pop("report")
    else:
        (folder / "cancer.py").write_text(CANCER_MODEL)
        raw = {"model": {"factory": "cancer.py:mlp"}, "loss": {"name": "cross_entropy"},
               "device": "cpu",
               "train": {"optimizer": "adam", "lr": 0.01, "epochs": 60, "batch_size": 32}}  # fmt: skip
    raw["model"]["checkpoint"] = "model.pt"
    raw["data"] = {"path": "data.pt", "inputs": "x", "targets": "y", "batch_size": 256}
    raw["output"] = {"path": "scores.parquet"}
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def run_setting(setting: str, folder: Path, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    data, planted = cancer(rng) if setting == "cancer-flipped" else digits(setting[7:], rng)
    torch.save(data, folder / "data.pt")
    cfg = load_config(config(folder, setting))
    start = time.perf_counter()
    model = fit(cfg)
    trained = time.perf_counter() - start
    torch.save(model.state_dict(), folder / "model.pt")
    fit_factors(cfg, folder / "factors.safetensors", ekfac=True)
    score_dataset(cfg, NormsScorer(precondition=str(folder / "factors.safetensors")))
    scores = pd.read_parquet(folder / "scores.parquet").sort_values("example_id")
    accuracy = float((scores["pred"] == scores["target"]).mean())
    k = int(planted.sum())
    columns = {}
    for name, sign in COLUMNS.items():
        values = sign * scores[name].to_numpy()
        top = np.argsort(-values, kind="stable")[:k]
        columns[name] = {"auroc": auroc(values, planted), "top_k": float(planted[top].mean())}
    return {"rows": len(planted), "planted": k, "train_accuracy": accuracy,
            "train_seconds": trained, "columns": columns}  # fmt: skip


def markdown(results: dict) -> str:
    """One table: a row per setting, AUROC (and top-k share) per column, the best in bold."""
    names = list(COLUMNS)
    lines = ["| setting | planted | " + " | ".join(f"`{n}`" for n in names) + " |",
             "|---|---|" + "---|" * len(names)]  # fmt: skip
    for setting, r in results["settings"].items():
        best = max(r["columns"][n]["auroc"] for n in names)
        cells = []
        for n in names:
            c = r["columns"][n]
            text = f"{c['auroc']:.3f} ({c['top_k']:.0%})"
            cells.append(f"**{text}**" if c["auroc"] == best else text)
        lines.append(f"| {setting} | {r['planted']} of {r['rows']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, help="write the results here (and a .md beside)")
    parser.add_argument("--seed", type=int, default=0, help="where the faults are planted")
    args = parser.parse_args()
    torch.set_num_threads(1)
    settings = ("digits-flipped", "digits-noise", "digits-duplicates", "cancer-flipped")
    results = {"machine": platform.processor() or platform.machine(), "seed": args.seed,
               "torch": torch.__version__, "settings": {}}  # fmt: skip
    for setting in settings:
        with tempfile.TemporaryDirectory() as folder:
            results["settings"][setting] = run_setting(setting, Path(folder), args.seed)
        print(setting, json.dumps(results["settings"][setting]["columns"]), flush=True)
    print(markdown(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
        args.json.with_suffix(".md").write_text(markdown(results))


if __name__ == "__main__":
    main()
