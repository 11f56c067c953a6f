"""``validate`` against an independent loop in the test: the same subsets (drawn by the documented
rule) and seeds, models trained by a plain PyTorch loop, Spearman by argsort of argsort."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from problem import REFS, ROWS, TRAIN, make_problem, oracle_fit, ref_targets
from typer.testing import CliRunner

from gradscope.cli import app
from gradscope.config import load_config
from gradscope.errors import ConfigError
from gradscope.validation import Options, validate

SUBSETS, SEEDS, SIZE = 6, 2, 20  # fraction 0.5 of 40 rows
SEED_LIST = [TRAIN["seed"] + s for s in range(SEEDS)]


def score_file(path, per_ref: bool, seed: int = 0):
    """Scores the test makes up: validate must only compare them with retraining."""
    rng = np.random.default_rng(seed)
    refs = REFS if per_ref else 1
    scores = rng.normal(size=(refs, ROWS))  # (R, N)
    columns = {"example_id": np.repeat(np.arange(ROWS), refs)}
    if per_ref:
        columns["ref_id"] = np.tile(np.arange(refs), ROWS)
    columns["influence"] = scores.T.reshape(-1)
    pq.write_table(pa.table(columns), path)
    return scores


def oracle_subsets() -> list[np.ndarray]:
    rng = np.random.default_rng([TRAIN["seed"], 0])  # the rule the guide documents
    return [np.sort(rng.choice(ROWS, SIZE, replace=False)) for _ in range(SUBSETS)]


def spearman_by_argsort(a: np.ndarray, b: np.ndarray) -> float:
    return np.corrcoef(a.argsort().argsort(), b.argsort().argsort())[0, 1]


def oracle_lds(root, scores: np.ndarray, same_order: bool = False) -> list[float]:
    """Per reference (or for the mean over REF when ``scores`` has one row); ``same_order``:
    each subset trained on every row in the full run's order, the others weighted 0."""
    truth = []  # (M, R) losses averaged over the seeds
    masks = np.zeros((SUBSETS, ROWS))
    for m, rows in enumerate(oracle_subsets()):
        masks[m, rows] = 1
        if same_order:
            fits = [oracle_fit(root, np.arange(ROWS), s, masks[m]) for s in SEED_LIST]
        else:
            fits = [oracle_fit(root, rows, s) for s in SEED_LIST]
        losses = [ref_targets(root, model)[0] for model in fits]
        truth.append(np.mean(losses, 0))
    truth = np.array(truth)
    if len(scores) == 1:
        truth = truth.mean(1, keepdims=True)
    predicted = -(scores @ masks.T)  # (R, M): a helpful score lowers the loss
    return [spearman_by_argsort(truth[:, r], predicted[r]) for r in range(len(scores))]


def test_lds_matches_an_independent_loop(tmp_path):
    config = make_problem(tmp_path)
    per_ref = score_file(tmp_path / "per_ref.parquet", True)
    mean = score_file(tmp_path / "mean.parquet", False, seed=1)
    result = CliRunner().invoke(app, [
        "validate", str(config), "--ref", str(tmp_path / "ref.pt"),
        "--scores", str(tmp_path / "per_ref.parquet"), str(tmp_path / "mean.parquet"),
        "--subsets", str(SUBSETS), "--seeds", str(SEEDS), "--out", str(tmp_path / "v.parquet"),
    ])  # fmt: skip
    assert result.exit_code == 0, result.output
    table = pd.read_parquet(tmp_path / "v.parquet")
    expected = oracle_lds(tmp_path, per_ref)
    row = table.iloc[0]
    assert row["lds"] == pytest.approx(np.mean(expected), abs=1e-9)
    assert row["lds_std"] == pytest.approx(np.std(expected, ddof=1), abs=1e-9)
    assert row["references"] == REFS and row["lds_low"] < row["lds"] < row["lds_high"]
    assert table.iloc[1]["lds"] == pytest.approx(oracle_lds(tmp_path, mean)[0], abs=1e-9)
    assert table.iloc[1]["references"] == 1
    written = json.loads((tmp_path / "v.json").read_text())["results"]
    assert [w["lds"] for w in written] == table["lds"].tolist()  # every digit (10 before)
    truth = pd.read_parquet(tmp_path / "v.truth.parquet")
    assert len(truth) == SUBSETS * SEEDS and set(truth["seed"]) == set(SEED_LIST)
    assert "validation" in result.output and "per_ref.parquet" in result.output


def test_same_order_lds_weighs_the_left_out_rows_zero(tmp_path):
    config = make_problem(tmp_path)
    scores = score_file(tmp_path / "s.parquet", True)
    options = Options(subsets=SUBSETS, seeds=SEEDS, same_order=True)
    ref = str(tmp_path / "ref.pt")
    out = tmp_path / "v.parquet"
    table = validate(load_config(config), ref, [tmp_path / "s.parquet"], options=options, out=out)
    expected = oracle_lds(tmp_path, scores, same_order=True)
    assert table.iloc[0]["lds"] == pytest.approx(np.mean(expected), abs=1e-9)
    assert expected != pytest.approx(oracle_lds(tmp_path, scores), abs=1e-3)  # not the same truth
    with pytest.raises(ConfigError, match="different order"):  # one truth, one setting
        validate(load_config(config), ref, [tmp_path / "s.parquet"], out=out,
                 options=Options(subsets=SUBSETS, seeds=SEEDS))  # fmt: skip


def test_removal_matches_a_retrain_by_hand(tmp_path):
    config = make_problem(tmp_path)
    scores = score_file(tmp_path / "s.parquet", True)
    k, refs = 4, 3
    table = validate(
        load_config(config), str(tmp_path / "ref.pt"), [tmp_path / "s.parquet"],
        options=Options(subsets=2, seeds=1, removal=k, removal_refs=refs),
        out=tmp_path / "v.parquet",
    )  # fmt: skip
    seed = TRAIN["seed"]
    full_loss, full_margin = ref_targets(tmp_path, oracle_fit(tmp_path, np.arange(ROWS), seed))
    changes, flips = {"top": [], "random": []}, {"top": [], "random": []}
    for r in range(refs):
        top = np.argsort(-scores[r])[:k]  # the most helpful rows for reference r
        chance = np.random.default_rng([seed, 1, r + 1]).choice(ROWS, k, replace=False)
        for name, dropped in (("top", top), ("random", chance)):
            kept = np.setdiff1d(np.arange(ROWS), dropped)
            loss, margin = ref_targets(tmp_path, oracle_fit(tmp_path, kept, seed))
            changes[name].append(loss[r] - full_loss[r])
            flips[name].append(np.sign(margin[r]) != np.sign(full_margin[r]))
    row = table.iloc[0]
    assert row["removal_top"] == pytest.approx(np.mean(changes["top"]), abs=1e-9)
    assert row["removal_random"] == pytest.approx(np.mean(changes["random"]), abs=1e-9)
    assert row["flips_top"] == np.mean(flips["top"])
    assert row["flips_random"] == np.mean(flips["random"])


def pairs_auroc(scores: np.ndarray, bad: np.ndarray) -> float:
    """Over every (bad, good) pair: 1 when the bad row scores higher, 1/2 on a tie."""
    return np.mean([(b > g) + 0.5 * (b == g) for b in scores[bad] for g in scores[~bad]])


def test_detection_auroc_and_seconds(tmp_path):
    import torch

    config = make_problem(tmp_path)
    influence = score_file(tmp_path / "a.parquet", True)  # (R, N)
    loss = np.round(np.random.default_rng(5).random(ROWS), 1)  # ties
    table = pq.read_table(tmp_path / "a.parquet")
    pq.write_table(
        table.append_column("loss", pa.array(np.repeat(loss, REFS))), tmp_path / "a.parquet"
    )
    norms = pa.table({"example_id": np.arange(ROWS), "loss": loss, "self_influence": -loss})
    meta = {b"gradscope": json.dumps({"command": "norms", "seconds": 1.5})}
    pq.write_table(norms.replace_schema_metadata(meta), tmp_path / "b.parquet")
    table = validate(
        load_config(config), str(tmp_path / "ref.pt"), [tmp_path / "a.parquet", tmp_path / "b.parquet"],
        options=Options(subsets=2, bad="flipped"), out=tmp_path / "v.parquet",
    )  # fmt: skip
    bad = torch.load(tmp_path / "data.pt")["flipped"].numpy()
    rows = {(r.file.split("/")[-1], r.column): r for r in table.itertuples()}
    assert set(rows) == {
        ("a.parquet", "influence"),
        ("a.parquet", "loss"),
        ("b.parquet", "self_influence"),
    }
    # influence: harmful (negative) first, averaged over the references
    assert rows["a.parquet", "influence"].auroc == pytest.approx(
        pairs_auroc(-influence.mean(0), bad)
    )
    assert rows["a.parquet", "loss"].auroc == pytest.approx(pairs_auroc(loss, bad))
    assert rows["b.parquet", "self_influence"].auroc == pytest.approx(pairs_auroc(-loss, bad))
    assert (
        np.isnan(rows["a.parquet", "loss"].lds)
        and rows["b.parquet", "self_influence"].seconds == 1.5
    )
    assert np.isnan(rows["a.parquet", "influence"].seconds)
