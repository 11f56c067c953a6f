"""The command line through typer's runner: exit codes, tables, the Parquet schema and metadata."""

from __future__ import annotations

import pandas as pd
import pyarrow.parquet as pq
import torch
from oracle import assert_rel_close, reference_norms
from project import load_net, make_project
from typer.testing import CliRunner

from gradscope.cli import app
from gradscope.io.parquet import read_metadata

runner = CliRunner()


def test_norms_writes_parquet_and_prints_outliers(tmp_path):
    config = make_project(tmp_path, n=23, data__ids="name")
    result = runner.invoke(app, ["norms", str(config), "--top-k", "5", "--per-layer"])
    assert result.exit_code == 0, result.output
    assert "top 5 outliers by grad_norm" in result.output
    assert "per class (grad_norm)" in result.output
    assert "23 examples; grad_norm: median" in result.output
    schema = pq.read_schema(tmp_path / "scores.parquet")
    assert schema.names == [
        "example_id",
        "id",
        "loss",
        "grad_norm",
        "grad_norm/fc1",
        "grad_norm/fc2",
        "target",
        "finite",
    ]
    assert [str(t) for t in schema.types] == [
        "int64",
        "int64",
        "double",
        "double",
        "double",
        "double",
        "int64",
        "bool",
    ]
    frame = pd.read_parquet(tmp_path / "scores.parquet")
    net, x, y = load_net(tmp_path)
    _, norm = reference_norms(net, (x,), y, "cross_entropy")
    assert_rel_close(torch.tensor(frame["grad_norm"].to_numpy()), norm, 1e-4)
    assert frame["finite"].all()
    # the table's first row is the largest norm
    top = frame.loc[frame["grad_norm"].idxmax()]
    assert f"{top['grad_norm']:.4g}" in result.output.split("robust_z")[1].splitlines()[2]


def test_options_override_config(tmp_path):
    config = make_project(tmp_path, n=23)
    out = tmp_path / "sub" / "custom.parquet"
    result = runner.invoke(
        app,
        [
            "norms",
            str(config),
            "--out",
            str(out),
            "--limit",
            "7",
            "--batch-size",
            "3",
            "--device",
            "cpu",
        ],
    )
    assert result.exit_code == 0, result.output
    frame = pd.read_parquet(out)
    assert frame["example_id"].tolist() == list(range(7))
    assert pq.ParquetFile(out).metadata.num_row_groups == 3
    assert read_metadata(out)["config"]["data"]["limit"] == 7
    assert not (tmp_path / "scores.parquet").exists()


def test_summary_of_existing_file(tmp_path):
    config = make_project(tmp_path)
    assert runner.invoke(app, ["norms", str(config)]).exit_code == 0
    result = runner.invoke(
        app, ["summary", str(tmp_path / "scores.parquet"), "--top-k", "3", "--by", "loss"]
    )
    assert result.exit_code == 0, result.output
    assert "top 3 outliers by loss" in result.output
    assert "wrote" not in result.output  # summary writes nothing


def test_user_errors_exit_2_with_one_line(tmp_path):
    cases = [
        (["norms", str(tmp_path / "missing.yaml")], "error: config file not found"),
        (
            ["norms", str(make_project(tmp_path, data__targets="label"))],
            "error: no column 'label' for data.targets",
        ),
        (["summary", str(tmp_path / "none.parquet")], "error: scores file not found"),
    ]
    for args, message in cases:
        result = runner.invoke(app, args)
        assert result.exit_code == 2, result.output
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(message), result.stderr
        assert "Traceback" not in result.output


def test_summary_unknown_column(tmp_path):
    config = make_project(tmp_path)
    runner.invoke(app, ["norms", str(config)])
    result = runner.invoke(app, ["summary", str(tmp_path / "scores.parquet"), "--by", "nope"])
    assert result.exit_code == 2
    assert "error: no column 'nope' to rank by" in result.stderr


def test_model_that_cannot_take_the_inputs_writes_nothing(tmp_path):
    config = make_project(tmp_path)
    data = torch.load(tmp_path / "data.pt")
    data["x"] = torch.randn(len(data["y"]), 6)
    torch.save(data, tmp_path / "data.pt")
    result = runner.invoke(app, ["norms", str(config)])
    assert result.exit_code == 2
    assert "error: the model cannot take inputs of shape (4, 6)" in result.stderr
    assert list(tmp_path.glob("*.parquet*")) == [] and list(tmp_path.glob(".*partial")) == []


def test_fp16_checkpoint_runs_in_fp16_with_dtype_null(tmp_path):
    config = make_project(tmp_path)
    state = torch.load(tmp_path / "net.pt")
    torch.save({k: v.half() for k, v in state.items()}, tmp_path / "net.pt")
    result = runner.invoke(app, ["norms", str(config)])
    assert result.exit_code == 0, result.output
    assert read_metadata(tmp_path / "scores.parquet")["dtype"] == "float16"
