"""Each command's work is one public call: the API's DataFrame (or file) equals the command
line's Parquet file (or file) on the same config, and the scores equal a per-example loop."""

from __future__ import annotations

import re
from functools import partial
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from oracle import reference_influence
from problem import make_problem
from project import load_net, make_project
from running import K, N, cli
from safetensors.torch import load_file

import gradscope
from gradscope import terminal
from gradscope.engine import render_plan, render_report
from gradscope.errors import ConfigError


def test_norms(project: Path) -> None:
    config = project / "config.yaml"
    cli("norms", config, "--per-layer", "--limit", 7, "--out", project / "cli.parquet")
    api = gradscope.norms(config, per_layer=True, limit=7)
    pd.testing.assert_frame_equal(api, pd.read_parquet(project / "cli.parquet"))
    assert "grad_norm/fc1" in api and len(api) == 7


def test_influence_per_ref_with_curvature(project: Path) -> None:
    config, ref = project / "config.yaml", project / "ref.pt"
    cli("influence", config, "--ref", ref, "--per-ref", "--curvature", "gn", "--damping", 0.5,
        "--out", project / "cli.parquet")  # fmt: skip
    api = gradscope.influence(config, ref=ref, per_ref=True, curvature="gn", damping=0.5)
    pd.testing.assert_frame_equal(api, pd.read_parquet(project / "cli.parquet"))
    assert len(api) == N * K


def test_influence_matrix_against_the_loop(project: Path) -> None:
    """(K, N): row k the inner products with reference row k's gradient, formed one at a time."""
    config, ref = project / "config.yaml", project / "ref.pt"
    cli("influence", config, "--ref", ref, "--curvature", "none", "--out", project / "c.parquet")
    mean = gradscope.influence(config, ref=ref, curvature="none")
    pd.testing.assert_frame_equal(mean, pd.read_parquet(project / "c.parquet"))
    matrix = gradscope.influence(config, ref=ref, per_ref=True, curvature="none", matrix=True)
    net, x, y = load_net(project)
    refs = torch.load(ref)
    expected, _, _ = reference_influence(net, (x,), y, ((refs["x"],), refs["y"]), "cross_entropy",
                                         per_ref=True)  # fmt: skip
    assert matrix.shape == (K, N) and matrix.dtype == torch.float64
    torch.testing.assert_close(matrix, expected.T, rtol=1e-9, atol=1e-12)
    row = gradscope.influence(config, ref=ref, curvature="none", matrix=True)  # the mean
    torch.testing.assert_close(row[0], torch.tensor(mean["influence"].to_numpy()))


def test_factors(project: Path) -> None:
    config = project / "config.yaml"
    cli("factors", config, "--ekfac", "--out", project / "cli.safetensors")
    made = gradscope.factors(config, ekfac=True, out=project / "api.safetensors")
    assert made.meta["examples"] == N
    cli_file, api_file = (load_file(project / f) for f in ("cli.safetensors", "api.safetensors"))
    assert cli_file.keys() == api_file.keys() and cli_file
    for name, value in cli_file.items():
        torch.testing.assert_close(api_file[name], value, rtol=0, atol=0)


def test_factors_held_score_as_their_file(project: Path) -> None:
    """``precondition=`` the factors ``factors`` returned: the numbers of their file, in norms,
    influence, query and one batch; a resume needs the file."""
    config, ref, file = project / "config.yaml", project / "ref.pt", project / "f.safetensors"
    made = gradscope.factors(config, ekfac=True, out=file)
    for run in (gradscope.norms, partial(gradscope.influence, ref=ref, per_ref=True)):
        pd.testing.assert_frame_equal(
            run(config, precondition=made), run(config, precondition=file)
        )
    index = gradscope.build_index(config, dim=16, out=project / "f.index")
    asked = partial(gradscope.query, index, config, ref=ref)
    pd.testing.assert_frame_equal(asked(precondition=made), asked(precondition=file))
    net, x, y = load_net(project)
    refs = torch.load(ref)
    batch = partial(gradscope.per_example_influence, net, x, y, refs["x"], refs["y"])
    torch.testing.assert_close(batch(precondition=made), batch(precondition=file), rtol=0, atol=0)
    with pytest.raises(ConfigError, match="resume needs precondition= as a file"):
        gradscope.norms(config, precondition=made, resume=True, out=project / "s.parquet")


def test_check(project: Path) -> None:
    config, ref = project / "config.yaml", project / "ref.pt"
    printed = cli("check", config, "--examples", 5, "--ref", ref)
    report = gradscope.check(config, examples=5, ref=ref)
    assert report.ok
    with terminal.console.capture() as shown:
        terminal.console.print(render_plan(report.plan))
        terminal.console.print(render_report(report))
    assert shown.get() in printed


def test_index_and_query(project: Path) -> None:
    config, ref = project / "config.yaml", project / "ref.pt"
    cli("index", config, "--dim", 16, "--out", project / "cli.index")
    made = gradscope.build_index(config, dim=16, out=project / "api.index")
    assert made == project / "api.index"
    ids = pd.read_parquet(made / "ids.parquet")
    pd.testing.assert_frame_equal(ids, pd.read_parquet(project / "cli.index" / "ids.parquet"))
    shard = "shard-000000.npy"
    assert (made / shard).read_bytes() == (project / "cli.index" / shard).read_bytes()
    for more, kwargs in (([], {}), (["--per-ref", "--top-k", 4], {"per_ref": True, "top_k": 4})):
        cli("query", project / "cli.index", "--config", config, "--ref", ref, *more,
            "--out", project / "q.parquet")  # fmt: skip
        api = gradscope.query(project / "cli.index", config, ref=ref, **kwargs)
        pd.testing.assert_frame_equal(api, pd.read_parquet(project / "q.parquet"))


def test_report(project: Path) -> None:
    config = project / "config.yaml"
    scores = project / "scores.parquet"
    cli("norms", config)
    cli("report", scores, "--config", config, "--top-k", 3, "--out", project / "cli.html")
    page = gradscope.write_report(scores, config=config, top_k=3, out=project / "api.html")
    assert page == project / "api.html"
    drawn = re.compile(r"\b[mp][0-9a-f]{10}\b")  # matplotlib's SVG ids, drawn at random
    assert drawn.sub("", page.read_text()) == drawn.sub("", (project / "cli.html").read_text())


def test_train_and_validate(tmp_path: Path) -> None:
    config = make_problem(tmp_path)
    cli("train", config, "--out", tmp_path / "cli.pt")
    trained = gradscope.train(config, out=tmp_path / "api.pt")
    assert trained.path == tmp_path / "api.pt" and trained.steps == 8  # 2 epochs of 4 batches
    cli_state, api_state = (torch.load(tmp_path / f) for f in ("cli.pt", "api.pt"))
    assert all(torch.equal(api_state[k], v) for k, v in cli_state.items())

    ref, scores = tmp_path / "ref.pt", tmp_path / "s.parquet"
    pd.DataFrame({"example_id": np.arange(40), "influence": np.linspace(-1, 1, 40)}).to_parquet(
        scores
    )
    cli("validate", config, "--ref", ref, "--scores", scores, "--subsets", 3,
        "--out", tmp_path / "cli.parquet")  # fmt: skip
    table = gradscope.validate(config, ref=ref, scores=[scores], subsets=3,
                               out=tmp_path / "api.parquet")  # fmt: skip
    timed = [c for c in table if "seconds" in c]
    pd.testing.assert_frame_equal(
        table.drop(columns=timed), pd.read_parquet(tmp_path / "cli.parquet").drop(columns=timed)
    )
    assert np.isfinite(table["lds"]).all()
    # one file and one column as a string each (they were read as lists of their characters),
    # the retrained models the call above kept reused
    one = gradscope.validate(config, ref=ref, scores=scores, subsets=3, columns="influence",
                             out=tmp_path / "one.parquet", truth=tmp_path / "api.truth.parquet")  # fmt: skip
    pd.testing.assert_frame_equal(one.drop(columns=timed), table.drop(columns=timed))
    with pytest.raises(ConfigError, match="validate takes score files' paths"):
        gradscope.validate(config, ref=ref, scores=[table])
    with pytest.raises(TypeError, match="'subset'; besides its named ones it takes: subsets, "):
        gradscope.validate(config, ref=ref, scores=scores, subset=3)
    with pytest.raises(ConfigError, match="resume=True continues the run an interrupted call"):
        gradscope.validate(config, ref=ref, scores=scores, resume=True)


def test_train_record_and_influence_through_training(tmp_path: Path) -> None:
    train = {"optimizer": "adamw", "lr": 0.05, "epochs": 2, "schedule": "cosine"}
    config = make_project(tmp_path, n=8, model__checkpoint="out.pt", train=train, dtype="float64")
    torch.save({"x": torch.randn(2, 5), "y": torch.tensor([0, 2])}, tmp_path / "ref.pt")
    cli("train", config, "--record", "--segment", 2, "--out", tmp_path / "cli.pt")
    trained = gradscope.train(config, record=True, segment=2)
    assert trained.record == tmp_path / "out.run"
    ref = tmp_path / "ref.pt"
    cli("influence", config, "--ref", ref, "--through-training", tmp_path / "cli.run",
        "--per-ref", "--out", tmp_path / "cli.parquet")  # fmt: skip
    (tmp_path / "out.pt").unlink()  # the record's weights are scored: no checkpoint is read
    api = gradscope.influence(config, ref=ref, through_training=trained.record, per_ref=True)
    pd.testing.assert_frame_equal(api, pd.read_parquet(tmp_path / "cli.parquet"))


def test_through_training_of_a_run_trained_on_the_api_s_limit(tmp_path: Path) -> None:
    """train(limit=N) then influence(limit=N, through_training=...) was refused ("made with a
    different data.limit"): the call's limit= chose the rows scored and the replay took the
    config's, so no keyword could match the run. The replay trains as the record says; limit=
    and batch_size= choose the rows scored and how they are batched."""
    train = {"optimizer": "sgd", "lr": 0.1, "epochs": 2}
    config = make_project(tmp_path, n=8, train=train, dtype="float64")
    ref = tmp_path / "ref.pt"
    torch.save({"x": torch.randn(2, 5), "y": torch.tensor([0, 2])}, ref)
    six = gradscope.train(config, limit=6, batch_size=3, record=True, out=tmp_path / "six.pt")
    scored = gradscope.influence(config, ref=ref, limit=6, batch_size=3,
                                 through_training=six.record)  # fmt: skip
    assert len(scored) == 6 and np.isfinite(scored["influence"]).all()
    first = gradscope.influence(config, ref=ref, limit=4, batch_size=2,
                                through_training=six.record)  # fmt: skip
    np.testing.assert_allclose(first["influence"], scored["influence"][:4], rtol=1e-12)
    every = gradscope.train(config, record=True, out=tmp_path / "every.pt")  # the config's rows
    some = gradscope.influence(config, ref=ref, limit=4, through_training=every.record)
    whole = gradscope.influence(config, ref=ref, through_training=every.record)
    np.testing.assert_allclose(some["influence"], whole["influence"][:4], rtol=1e-12)
