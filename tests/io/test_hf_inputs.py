"""Tokenized data as Hugging Face leaves it: save_to_disk folders, ragged lists padded per batch,
input globs, keyword mappings, and the next-token loss against a loop over positions."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
import yaml

from gradscope.config import load_config
from gradscope.errors import ConfigError, DataError
from gradscope.io.data import open_dataset
from gradscope.losses import resolve_loss

datasets = pytest.importorskip("datasets")

ROWS = [[5, 1, 2], [3, 4], [6], [7, 8, 9, 1], [2, 2, 2, 2, 2], [4]]


def data_config(tmp_path, **data):
    path = tmp_path / "c.yaml"
    raw = {"model": {"factory": "torch.nn:Linear"}, "data": {"targets": "labels", **data}}
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return load_config(path).data


def save_rows(folder, shards: int = 3) -> None:
    table = {"input_ids": ROWS, "labels": ROWS, "text": [str(r) for r in ROWS]}
    datasets.Dataset.from_dict(table).save_to_disk(str(folder), num_shards=shards)


def expected_padded(rows: list[list[int]], value: int) -> torch.Tensor:
    longest = max(map(len, rows))
    return torch.tensor([r + [value] * (longest - len(r)) for r in rows])


@pytest.mark.parametrize("batch_size", [1, 4, 6])
def test_save_to_disk_folder_padded_per_batch(tmp_path, batch_size):
    save_rows(tmp_path / "ds")
    cfg = data_config(
        tmp_path,
        path="ds",
        inputs={"input_ids": "input_ids"},
        pad={"input_ids": 0, "labels": -100},
    )
    dataset = open_dataset(cfg)
    assert len(dataset) == len(ROWS)
    batches = list(dataset.batches(batch_size))
    for n, batch in enumerate(batches):
        rows = ROWS[n * batch_size : (n + 1) * batch_size]
        assert batch.index.tolist() == list(range(n * batch_size, n * batch_size + len(rows)))
        assert torch.equal(batch.inputs[0], expected_padded(rows, 0))
        assert torch.equal(batch.targets, expected_padded(rows, -100))
        assert batch.inputs[0].dtype == torch.int64  # datasets writes input_ids as int32
    assert sum(len(b) for b in batches) == len(ROWS)


def test_arrow_files_by_glob_and_limit(tmp_path):
    save_rows(tmp_path / "ds", shards=2)
    cfg = data_config(
        tmp_path, path="ds/*.arrow", inputs="input_ids", pad={"input_ids": 0, "labels": 0}
    )
    (batch,) = open_dataset(cfg).batches(8, limit=4)
    assert torch.equal(batch.inputs[0], expected_padded(ROWS[:4], 0))


def test_ragged_column_without_pad_names_the_column_and_key(tmp_path):
    save_rows(tmp_path / "ds")
    cfg = data_config(tmp_path, path="ds", inputs="input_ids", pad={"labels": -100})
    with pytest.raises(
        DataError,
        match=r"column 'input_ids' holds lists of different lengths; set data.pad.input_ids",
    ):
        list(open_dataset(cfg).batches(6))


def test_dataset_dict_folder_points_at_a_split(tmp_path):
    table = datasets.Dataset.from_dict({"input_ids": ROWS, "labels": ROWS})
    datasets.DatasetDict({"train": table, "test": table}).save_to_disk(str(tmp_path / "dd"))
    cfg = data_config(tmp_path, path="dd", inputs="input_ids", pad={"input_ids": 0})
    with pytest.raises(DataError, match="DatasetDict folder; point data.path at one split"):
        open_dataset(cfg)


def test_input_glob_stacks_matching_columns_in_file_order(tmp_path):
    rng = np.random.default_rng(0)
    frame = pd.DataFrame({"feature_b": rng.normal(size=7), "labels": rng.integers(0, 3, 7)})
    frame.insert(0, "feature_a", rng.integers(0, 5, 7))  # ints promote with the floats
    frame["feature_c"] = rng.normal(size=7)
    frame["other"] = 1.0
    for n in range(2):  # two shards read by a glob
        frame.iloc[n * 4 : (n + 1) * 4].to_csv(tmp_path / f"part-{n}.csv", index=False)
    cfg = data_config(tmp_path, path="part-*.csv", inputs="feature_*")
    (batch,) = open_dataset(cfg).batches(16)
    expected = torch.tensor(frame[["feature_a", "feature_b", "feature_c"]].to_numpy())
    assert torch.equal(batch.inputs[0], expected)  # (B, 3) in file order
    assert torch.equal(batch.targets, torch.tensor(frame["labels"].to_numpy()))
    cfg = data_config(tmp_path, path="part-*.csv", inputs="pixel_*")
    with pytest.raises(DataError, match=r"no column matches 'pixel_\*' for data.inputs"):
        open_dataset(cfg)


def test_mapping_inputs_keep_their_order(tmp_path):
    save_rows(tmp_path / "ds")
    cfg = data_config(
        tmp_path,
        path="ds",
        inputs={"labels": "input_ids", "input_ids": "labels"},
        pad={"input_ids": 1, "labels": 2},
    )
    assert cfg.inputs == {"labels": "input_ids", "input_ids": "labels"}
    (batch,) = open_dataset(cfg).batches(2, limit=2)
    assert torch.equal(batch.inputs[0], expected_padded(ROWS[:2], 1))
    assert torch.equal(batch.inputs[1], expected_padded(ROWS[:2], 2))


@pytest.mark.parametrize(
    ("model", "data", "message"),
    [
        ({"pretrained": "m", "config": {}}, {}, "model.config .* or model.pretrained .*, not both"),
        (
            {},
            {"pad": {"text": 0}},
            "'data.pad.text' names no column of data.inputs or data.targets",
        ),
        ({}, {"pad": {"x": "zero"}}, "'data.pad' must be a mapping of strings to numbers"),
        ({}, {"inputs": {"input ids": "x"}}, "'input ids' is not a Python name"),
        (
            {},
            {"inputs": {"x": 3}},
            "'data.inputs' must be a list of strings or lists of strings or a mapping of strings "
            "to strings or lists of strings, got",
        ),
    ],
)
def test_bad_hf_keys_are_named(tmp_path, model, data, message):
    path = tmp_path / "c.yaml"
    raw = {
        "model": {"factory": "transformers:AutoModel", **model},
        "data": {"path": "d.pt", "inputs": "x", "targets": "y", **data},
    }
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    with pytest.raises(ConfigError, match=message):
        load_config(path)


def causal_lm_loop(logits: torch.Tensor, ids: torch.Tensor, reduction: str) -> torch.Tensor:
    """Each example: -log p(ids[t+1] | logits[t]) over positions whose target is not -100."""
    out = []
    for b in range(ids.shape[0]):
        terms = [
            -torch.log_softmax(logits[b, t], 0)[ids[b, t + 1]]
            for t in range(ids.shape[1] - 1)
            if ids[b, t + 1] != -100
        ]
        total = sum(terms, logits.new_zeros(()))
        out.append(total if reduction == "sum" else total / max(len(terms), 1))
    return torch.stack(out)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_causal_lm_is_next_token_cross_entropy(reduction):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 6, 11, generator=g, dtype=torch.float64)
    ids = torch.randint(0, 11, (4, 6), generator=g)
    ids[1, 3:] = -100  # padding
    ids[2, 1:] = -100  # one token: nothing to predict
    ids[3, 2] = -100  # a masked position inside
    loss = resolve_loss("causal_lm", token_reduction=reduction)(logits, ids.int())
    assert torch.allclose(loss, causal_lm_loop(logits, ids, reduction), rtol=1e-12, atol=0)
    assert loss[2] == 0


def test_causal_lm_refuses_outputs_that_are_not_sequences():
    with pytest.raises(
        Exception, match=r"causal_lm takes \(B, T, V\) logits and \(B, T\) token ids"
    ):
        resolve_loss("causal_lm")(torch.zeros(3, 5), torch.zeros(3, dtype=torch.long))


def test_arrow_ipc_file_format_is_read_too(tmp_path):
    import pyarrow as pa

    table = pa.table({"input_ids": ROWS, "labels": [len(r) for r in ROWS]})
    with (
        pa.OSFile(str(tmp_path / "rows.arrow"), "wb") as sink,
        pa.ipc.new_file(sink, table.schema) as w,
    ):
        w.write_table(table, max_chunksize=4)
    cfg = data_config(tmp_path, path="rows.arrow", inputs="input_ids", pad={"input_ids": -1})
    dataset = open_dataset(cfg)
    assert len(dataset) == len(ROWS)
    (batch,) = dataset.batches(8)
    assert torch.equal(batch.inputs[0], expected_padded(ROWS, -1))
    assert batch.targets.tolist() == [len(r) for r in ROWS]


def test_reading_a_save_to_disk_folder_imports_neither_datasets_nor_transformers(tmp_path):
    import subprocess
    import sys

    save_rows(tmp_path / "ds")
    cfg = data_config(tmp_path, path="ds", inputs="input_ids", pad={"input_ids": 0, "labels": 0})
    code = (
        "import sys\n"
        "from gradscope.cli import app\n"
        "from gradscope.config import DataConfig\n"
        "from gradscope.io.data import open_dataset\n"
        f"cfg = DataConfig(path={cfg.path!r}, inputs=['input_ids'], targets='labels', "
        "pad={'input_ids': 0, 'labels': 0})\n"
        "print(sum(len(b) for b in open_dataset(cfg).batches(4)))\n"
        "print(sorted(m for m in ('datasets', 'transformers') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[:2] == [str(len(ROWS)), "[]"]
