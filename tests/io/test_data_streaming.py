"""Shards, globs, streamed CSV/Parquet and torch Datasets: same rows, same ids, as one table."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from project import make_project

from gradscope.config import DataConfig, load_config
from gradscope.errors import DataError
from gradscope.io.data import open_dataset
from gradscope.run import score_dataset

DATASETS = '''

class Items(torch.utils.data.Dataset):
    """Map-style, items as {name: tensor}."""

    def __init__(self, as_tuples=False):
        self.data, self.as_tuples = torch.load(HERE / "data.pt"), as_tuples

    def __len__(self):
        return len(self.data["y"])

    def __getitem__(self, i):
        if self.as_tuples:
            return self.data["x"][i], self.data["y"][i]
        return {k: v[i] for k, v in self.data.items()}


class Stream(torch.utils.data.IterableDataset):
    """Iterable: no length known ahead; the target as a Python int."""

    def __iter__(self):
        data = torch.load(HERE / "data.pt")
        for x, y in zip(data["x"], data["y"]):
            yield {"x": x, "y": int(y)}


def items():
    return Items()


def tuples():
    return Items(as_tuples=True)


def stream():
    return Stream()
'''


@pytest.fixture
def project(tmp_path):
    config = make_project(tmp_path, n=23)
    with (tmp_path / "model.py").open("a") as f:
        f.write(f"\nfrom pathlib import Path\nHERE = Path({str(tmp_path)!r})\n" + DATASETS)
    return tmp_path, config


def scores(config, **data) -> tuple[pd.DataFrame, list]:
    """The scores of ``config`` with ``data`` keys replaced, and what on_start was told."""
    import dataclasses

    cfg = load_config(config)
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, **data))
    told = []
    return pd.read_parquet(score_dataset(cfg, on_start=told.append)), told


def write_shards(root, data: dict, cuts: list[int]) -> list[str]:
    """data.pt cut at ``cuts`` into shard-0.pt, shard-1.npz, shard-2.parquet, ... in turn."""
    bounds = [0, *cuts, len(data["y"])]
    paths = []
    for n, (lo, hi) in enumerate(zip(bounds, bounds[1:], strict=False)):
        part = {k: v[lo:hi] for k, v in data.items()}
        path = root / f"shard-{n}.{['pt', 'npz', 'parquet'][n % 3]}"
        if path.suffix == ".pt":
            torch.save(part, path)
        elif path.suffix == ".npz":
            np.savez(path, **{k: v.numpy() for k, v in part.items()})
        else:
            table = pa.table({"x": [r.tolist() for r in part["x"]], "y": part["y"].numpy(),
                              "name": part["name"].numpy()})  # fmt: skip
            pq.write_table(table, path, row_group_size=2)  # row groups cut across batches
        paths.append(str(path))
    return paths


def test_shards_in_order_as_one_table(project):
    root, config = project
    whole, told = scores(config, ids="name")
    assert told == [23]
    paths = write_shards(root, torch.load(root / "data.pt"), [5, 6, 15])  # one shard of one row
    listed, told = scores(config, path=paths, ids="name")
    assert told == [None]  # .pt/.npz shards are sized only once read
    pd.testing.assert_frame_equal(listed, whole)
    globbed, _ = scores(config, path=str(root / "shard-*"), ids="name")
    pd.testing.assert_frame_equal(globbed, whole)


def test_glob_in_config_resolves_against_its_folder(project):
    root, config = project
    write_shards(root, torch.load(root / "data.pt"), [10])
    config.write_text(
        config.read_text().replace("path: data.pt", "path: [shard-0.pt, shard-1.npz]")
    )
    assert load_config(config).data.path == [str(root / "shard-0.pt"), str(root / "shard-1.npz")]
    config.write_text(config.read_text().replace("[shard-0.pt, shard-1.npz]", "shard-*"))
    assert load_config(config).data.path == str(root / "shard-*")
    whole, _ = scores(config)
    assert whole["example_id"].tolist() == list(range(23))


def test_glob_without_matches(project):
    root, config = project
    with pytest.raises(DataError, match="no data file matches the pattern"):
        scores(config, path=str(root / "nope-*.parquet"))


@pytest.mark.parametrize("spec", ["items", "tuples", "stream"])
def test_torch_datasets(project, spec):
    root, config = project
    whole, _ = scores(config)
    frame, told = scores(config, path=f"{root}/model.py:{spec}")
    assert told == [None if spec == "stream" else 23]
    pd.testing.assert_frame_equal(frame, whole)


def test_limit_stops_reading(project):
    root, config = project
    frame, told = scores(config, path=f"{root}/model.py:stream", limit=6, batch_size=4)
    assert frame["example_id"].tolist() == list(range(6))
    frame, told = scores(config, limit=6, batch_size=4)
    assert told == [6]


def test_streamed_csv_equals_in_memory(project, tmp_path):
    root, config = project
    data = torch.load(root / "data.pt")
    frame = pd.DataFrame(data["x"].numpy(), columns=[f"f{i}" for i in range(5)])
    frame.assign(y=data["y"].numpy()).to_csv(root / "data.csv", index=False)
    cfg = DataConfig(path=str(root / "data.csv"), targets="y", inputs=[f"f{i}" for i in range(5)])
    dataset = open_dataset(cfg)
    assert dataset.length is None
    batches = list(dataset.batches(batch_size=5))
    assert [len(b) for b in batches] == [5, 5, 5, 5, 3]
    assert len(dataset) == 23  # read once more to count
    x = torch.stack([torch.cat(t) for t in zip(*(b.inputs for b in batches), strict=True)], 1)
    torch.testing.assert_close(x.float(), data["x"])  # CSV reads as float64
    assert torch.cat([b.index for b in batches]).tolist() == list(range(23))


def test_tuple_items_of_the_wrong_length(project):
    root, config = project
    with pytest.raises(DataError, match=r"items are tuples of 2; expected 3"):
        scores(config, path=f"{root}/model.py:tuples", inputs=["x", "x2"])


RAGGED = """

ROWS = [[3, 1, 4], [1], [5, 9, 2, 6]]


def ragged_items():  # a map-style dataset of tensors of each row's length
    return [{"t": torch.tensor(r), "y": torch.tensor(r)} for r in ROWS]


def ragged_lists():
    return {"t": ROWS, "y": ROWS}
"""


def test_dataset_items_of_ragged_tensors_pad_as_lists_do(project):
    """Items holding a row's token ids as tensors of its own length were stacked before any
    padding ('stack expects each tensor to be equal size'), where the same rows as lists pad."""
    import dataclasses

    root, config = project
    with (root / "model.py").open("a") as f:
        f.write(RAGGED)
    data = load_config(config).data
    got = []
    for fn in ("ragged_items", "ragged_lists"):
        spec = dataclasses.replace(data, path=f"{root}/model.py:{fn}", inputs="t", targets="y",
                                   pad={"t": 0, "y": -100}, ids=None)  # fmt: skip
        (batch,) = open_dataset(spec).batches(3)
        got.append((batch.inputs[0], batch.targets))
    assert torch.equal(got[0][0], torch.tensor([[3, 1, 4, 0], [1, 0, 0, 0], [5, 9, 2, 6]]))
    assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1])
    assert got[0][1][1].tolist() == [1, -100, -100, -100]
