"""Own data as people have it: CSV and Parquet columns with real names (spaces, no shared
prefix) stacked into one (B, K) input by a list or a pattern, and errors that name the columns."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from oracle import assert_rel_close, reference_norms
from project import edit_config, load_net, make_project, one_error
from typer.testing import CliRunner

from gradscope.cli import app

runner = CliRunner()
COLUMNS = ["age", "blood pressure", "height (cm)", "lab_a", "lab_b"]


def csv_project(tmp_path, inputs) -> tuple:
    """make_project's model (5 inputs) over a CSV whose columns hold real names, in an order
    that is not the one the model was given them in; returns the config and the table."""
    config = make_project(tmp_path)
    rng = np.random.default_rng(0)
    frame = pd.DataFrame(rng.standard_normal((11, 5)), columns=COLUMNS)
    frame.insert(2, "label", rng.integers(0, 3, 11))
    frame.to_csv(tmp_path / "data.csv", index=False)
    data = {"path": "data.csv", "inputs": inputs, "targets": "label", "batch_size": 4}
    edit_config(tmp_path, lambda c: c.update(data=data))
    return config, frame


@pytest.mark.parametrize(
    ("inputs", "order"),
    [
        ([COLUMNS], COLUMNS),  # a list of columns: one (B, 5) input
        ([["lab_b", "height (cm)", "age", "blood pressure", "lab_a"]], None),  # its own order
        ([["age", "blood pressure", "height (cm)", "lab_*"]], COLUMNS),  # a glob among them
        ({"x": ["blood pressure", "age", "lab_*", "height (cm)"]}, None),  # by keyword
    ],
)
def test_listed_columns_stack_in_their_order(tmp_path, inputs, order):
    config, frame = csv_project(tmp_path, inputs)
    listed = next(iter(inputs.values())) if isinstance(inputs, dict) else inputs[0]
    order = order or [c for name in listed for c in (["lab_a", "lab_b"] if "*" in name else [name])]
    result = runner.invoke(app, ["norms", str(config)])
    assert result.exit_code == 0, result.output
    scores = pd.read_parquet(tmp_path / "scores.parquet")
    net, _, _ = load_net(tmp_path)
    x = torch.tensor(frame[order].to_numpy(), dtype=torch.float32)
    loss, norm = reference_norms(
        net, (x,), torch.tensor(frame["label"].to_numpy()), "cross_entropy"
    )
    assert_rel_close(torch.tensor(scores["grad_norm"].to_numpy()), norm, 1e-5)
    assert_rel_close(torch.tensor(scores["loss"].to_numpy()), loss, 1e-5)


@pytest.mark.parametrize(
    ("inputs", "stacked"),
    [
        ([["age", "lab_*"]], "['age', 'lab_*'] stacks 3 columns: age, lab_a, lab_b"),
        (["lab_*"], "'lab_*' stacks 2 columns: lab_a, lab_b"),
    ],
)
def test_a_shape_the_model_cannot_take_names_the_columns_stacked(tmp_path, inputs, stacked):
    config, _ = csv_project(tmp_path, inputs)
    line = one_error(runner.invoke(app, ["norms", str(config)]))
    assert line.startswith("error: the model cannot take inputs of shape (4, "), line
    assert line.endswith(f"(data.inputs: {stacked})"), line


def test_a_listed_column_that_is_not_there_is_named(tmp_path):
    config, _ = csv_project(tmp_path, [["age", "blood presure"]])
    line = one_error(runner.invoke(app, ["norms", str(config)]))
    assert line.startswith(
        "error: no column 'blood presure' for data.inputs ['age', 'blood presure'] (columns: "
        "age, blood pressure, label,"
    ), line


def test_stacked_columns_whose_rows_differ_in_shape_are_named(tmp_path):
    config = make_project(tmp_path)
    rng = np.random.default_rng(0)
    pq.write_table(pa.table({
        "a": rng.standard_normal(6), "b": [list(rng.standard_normal(3)) for _ in range(6)],
        "y": rng.integers(0, 3, 6),
    }), tmp_path / "data.parquet")  # fmt: skip
    data = {"path": "data.parquet", "inputs": [["a", "b"]], "targets": "y"}
    edit_config(tmp_path, lambda c: c.update(data=data))
    line = one_error(runner.invoke(app, ["norms", str(config)]))
    assert line == (
        "error: data.inputs ['a', 'b'] stacks columns whose rows differ in shape: a (), b (3,) "
        f"({tmp_path / 'data.parquet'})"
    )
