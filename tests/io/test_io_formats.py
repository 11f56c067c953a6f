"""Each data format and checkpoint option, end to end through score_dataset, against the loop."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from oracle import assert_rel_close, reference_norms
from project import load_net, make_project
from safetensors.torch import save_file

from gradscope.config import load_config
from gradscope.errors import ModelError
from gradscope.io.parquet import read_metadata
from gradscope.run import score_dataset


def run(config) -> pd.DataFrame:
    return pd.read_parquet(score_dataset(load_config(config)))


def check_against_loop(frame: pd.DataFrame, tmp_path, x=None, y=None) -> None:
    net, x0, y0 = load_net(tmp_path)
    x = x0 if x is None else x
    y = y0 if y is None else y
    loss, norm = reference_norms(net, (x,), y, "cross_entropy")
    assert frame["example_id"].tolist() == list(range(len(x)))
    assert_rel_close(torch.tensor(frame["grad_norm"].to_numpy()), norm, 1e-4)
    assert_rel_close(torch.tensor(frame["loss"].to_numpy()), loss, 1e-5)


def test_pt_with_ids_and_uneven_last_batch(tmp_path):
    frame = run(make_project(tmp_path, n=23, data__ids="name"))  # batches of 4: the last holds 3
    check_against_loop(frame, tmp_path)
    assert frame["id"].tolist() == list(range(100, 123))
    assert pq.ParquetFile(tmp_path / "scores.parquet").metadata.num_row_groups == 6


def test_npz(tmp_path):
    config = make_project(tmp_path, data__path="data.npz")
    data = torch.load(tmp_path / "data.pt")
    np.savez(tmp_path / "data.npz", x=data["x"].numpy(), y=data["y"].numpy())
    check_against_loop(run(config), tmp_path)


def test_parquet_with_list_column(tmp_path):
    config = make_project(tmp_path, data__path="data.parquet")
    data = torch.load(tmp_path / "data.pt")
    table = pa.table({"x": [row.tolist() for row in data["x"]], "y": data["y"].numpy()})
    pq.write_table(table, tmp_path / "data.parquet")
    check_against_loop(run(config), tmp_path)


def test_csv_columns_as_inputs(tmp_path):
    cols = [f"f{i}" for i in range(5)]
    config = make_project(
        tmp_path, data__path="data.csv", data__inputs=cols, model__factory="model.py:Columns"
    )
    data = torch.load(tmp_path / "data.pt")
    frame = pd.DataFrame(data["x"].numpy(), columns=cols).assign(y=data["y"].numpy())
    frame.to_csv(tmp_path / "data.csv", index=False)
    check_against_loop(run(config), tmp_path)


@pytest.mark.parametrize(
    "names",
    [
        ["007", "7", "0100", "100"],
        ["18446744073709551612", "18446744073709551613", "18446744073709551614", "1"],
        ["true", "TRUE", "false", "False"],
        "y",  # the ids are the targets: numbers, as the loss reads them
    ],
)
def test_csv_ids_are_copied_as_written(tmp_path, names):
    """pyarrow guesses a CSV column's type: ids 007 and 7 both became 7, twenty-digit ones one
    float, true and TRUE one bool. The ids column is read as its text, but where it is the
    targets (or an input) too: numbers there."""
    ids = "y" if names == "y" else "name"
    config = make_project(tmp_path, n=4, data__path="data.csv", data__inputs=["x_*"],
                          data__ids=ids, model__factory="model.py:Net")  # fmt: skip
    data = torch.load(tmp_path / "data.pt")
    names = data["y"].tolist() if names == "y" else names
    frame = pd.DataFrame(data["x"].numpy(), columns=[f"x_{i}" for i in range(5)])
    frame.assign(y=data["y"].numpy(), name=names).to_csv(tmp_path / "data.csv", index=False)
    out = run(config)
    check_against_loop(out, tmp_path)
    assert out["id"].tolist() == names


def test_make_dataset_function(tmp_path):
    config = make_project(
        tmp_path, data__path="model.py:make_dataset", data__inputs="features", data__targets="label"
    )
    from gradscope.io.model import import_object

    data = import_object(f"{tmp_path}/model.py:make_dataset", "test")()
    check_against_loop(run(config), tmp_path, data["features"], data["label"])


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_state_dict_key_and_strip_prefix(tmp_path, suffix):
    config = make_project(
        tmp_path,
        model__checkpoint=f"wrapped{suffix}",
        model__state_dict_key="model",
        model__strip_prefix="module.",
    )
    state = {f"module.{k}": v for k, v in torch.load(tmp_path / "net.pt").items()}
    if suffix == ".pt":
        torch.save({"model": state, "epoch": 3}, tmp_path / "wrapped.pt")
    else:  # safetensors has no nesting: the key is not needed
        config = make_project(
            tmp_path, model__checkpoint="wrapped.safetensors", model__strip_prefix="module."
        )
        save_file(state, tmp_path / "wrapped.safetensors")
    check_against_loop(run(config), tmp_path)


@pytest.mark.parametrize("dtype", [None, "float64"])
def test_a_float64_checkpoint_is_loaded_unrounded(tmp_path, dtype):
    """The factory builds float32 weights: a float64 checkpoint was copied into them (rounded
    to float32) and only then cast, 1e-8 off a float64 model's losses."""
    config = make_project(tmp_path, dtype=dtype)
    g = torch.Generator().manual_seed(4)
    state = {k: torch.randn(v.shape, generator=g, dtype=torch.float64)
             for k, v in torch.load(tmp_path / "net.pt").items()}  # fmt: skip
    torch.save(state, tmp_path / "net.pt")
    from gradscope.io.model import build_model

    model = build_model(load_config(config).model)
    for name, value in model.state_dict().items():
        assert value.dtype == torch.float64 and torch.equal(value, state[name]), name


@pytest.mark.parametrize(("kinds", "held"), [((torch.float64, torch.float32), torch.float64),
                                            ((torch.bfloat16, torch.float16), torch.float32)])  # fmt: skip
def test_a_checkpoint_of_several_dtypes_is_loaded_in_one_that_holds_them(tmp_path, kinds, held):
    """float64 weights beside float32 ones were rounded to the factory's float32 unsaid."""
    config = make_project(tmp_path)
    g = torch.Generator().manual_seed(4)
    state = {k: torch.randn(v.shape, generator=g).to(kinds[i % 2])
             for i, (k, v) in enumerate(torch.load(tmp_path / "net.pt").items())}  # fmt: skip
    torch.save(state, tmp_path / "net.pt")
    from gradscope.io.model import build_model

    model = build_model(load_config(config).model)
    for name, value in model.state_dict().items():
        assert value.dtype == held and torch.equal(value, state[name].to(held)), name


def test_tuple_output(tmp_path):
    frame = run(make_project(tmp_path, model__factory="model.py:TupleNet", model__output=0))
    check_against_loop(frame, tmp_path)


def test_per_layer_columns_add_up(tmp_path):
    frame = run(make_project(tmp_path, output={"path": "s.parquet", "per_layer": True}))
    squares = frame["grad_norm/fc1"] ** 2 + frame["grad_norm/fc2"] ** 2
    np.testing.assert_allclose(np.sqrt(squares), frame["grad_norm"], rtol=1e-6)


def test_metadata(tmp_path):
    config = make_project(tmp_path)
    score_dataset(load_config(config))
    meta = read_metadata(tmp_path / "scores.parquet")
    assert meta["command"] == "norms" and meta["device"] == "cpu" and meta["dtype"] == "float32"
    assert len(meta["checkpoint_sha256"]) == 64
    assert meta["config"]["data"]["batch_size"] == 4
    assert {p["name"]: p["rule"] for p in meta["plan"]} == {
        "fc1.weight": "linear", "fc1.bias": "linear", "fc2.weight": "linear", "fc2.bias": "linear"
    }  # fmt: skip


def test_checkpoint_that_does_not_fit(tmp_path):
    config = make_project(tmp_path)
    state = torch.load(tmp_path / "net.pt")
    state["fc2.weight"] = torch.zeros(4, 8)
    torch.save(state, tmp_path / "net.pt")
    with pytest.raises(
        ModelError, match=r"fc2.weight has shape \(4, 8\), the model expects \(3, 8\)"
    ):
        run(config)
