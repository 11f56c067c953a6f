"""The API on the data as Python holds it (a dict of tensors, a Dataset, a DataLoader, a Hugging
Face datasets.Dataset) and on a module equals the API on the config that names the same model
and data; the module is scored as it is, and left as it was."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from project import load_net
from running import N, cli
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    RandomSampler,
    SubsetRandomSampler,
    TensorDataset,
    WeightedRandomSampler,
)

import gradscope
from gradscope.errors import ConfigError, DataError


def held_data(project: Path) -> dict[str, object]:
    data = torch.load(project / "data.pt")
    x, y = data["x"], data["y"]
    items = [{"x": x[i], "y": y[i]} for i in range(N)]
    import datasets

    return {
        "dict": {"x": x, "y": y},
        "shards": [project / "data.pt"],
        "Dataset": TensorDataset(x, y),
        "DataLoader": DataLoader(TensorDataset(x, y), batch_size=4),
        "dict DataLoader": DataLoader(items, batch_size=3),
        "datasets.Dataset": datasets.Dataset.from_dict({"x": x.numpy(), "y": y.numpy()}),
    }


@pytest.mark.parametrize(
    "kind", ["dict", "shards", "Dataset", "DataLoader", "dict DataLoader", "datasets.Dataset"]
)
def test_held_data_and_module_equal_the_config(project: Path, kind: str) -> None:
    config = project / "config.yaml"
    net, x, y = load_net(project)
    net.train()
    gradscope.norms(net, {"x": x, "y": y}, config=config)  # the config's dtype: float64
    assert next(net.parameters()).dtype == torch.float32  # the module scored as it is
    net.double()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    data = held_data(project)[kind]
    by_config = gradscope.norms(config)
    pd.testing.assert_frame_equal(gradscope.norms(net, data, config=config), by_config)
    pd.testing.assert_frame_equal(gradscope.norms(net, data), by_config)  # x, y, cross_entropy
    refs = torch.load(project / "ref.pt")
    held = gradscope.influence(net, data, ref=refs, per_ref=True, curvature="none")
    cli("influence", config, "--ref", project / "ref.pt", "--per-ref", "--curvature", "none",
        "--out", project / "cli.parquet")  # fmt: skip
    pd.testing.assert_frame_equal(held, pd.read_parquet(project / "cli.parquet"))
    assert net.training and all(torch.equal(v, before[k]) for k, v in net.state_dict().items())


def test_config_keys_as_keywords(project: Path) -> None:
    """A key given as a keyword is the key set in the file: the loss as a callable too."""
    config = project / "config.yaml"
    net, x, y = load_net(project)

    def halved(outputs, targets):  # (B,)
        return 0.5 * torch.nn.functional.cross_entropy(outputs, targets, reduction="none")

    scores = gradscope.norms(net.double(), {"x": x, "y": y}, loss=halved, exclude=["fc2.*"])
    whole = gradscope.norms(config, limit=N)
    np.testing.assert_allclose(scores["loss"], 0.5 * whole["loss"], rtol=1e-12)
    assert "pred" not in scores  # a custom loss has no single label
    one = gradscope.norms(config, exclude=["fc2.*"])
    np.testing.assert_allclose(scores["grad_norm"], 0.5 * one["grad_norm"], rtol=1e-12)


def test_refused(project: Path) -> None:
    net, x, y = load_net(project)
    rows = TensorDataset(x, y)
    for loader, message in [
        (DataLoader(rows, batch_size=4, shuffle=True), "by a RandomSampler"),
        (DataLoader(rows, batch_size=4, sampler=SubsetRandomSampler(range(N))), "SubsetRandom"),
        (DataLoader(rows, batch_sampler=BatchSampler(RandomSampler(rows), 4, False)), "Random"),
        (DataLoader(rows, batch_size=4, sampler=WeightedRandomSampler([1.0] * N, N)), "Weight"),
        (DataLoader(rows, batch_size=5, drop_last=True), "drops its last batch"),
        (DataLoader(rows, batch_size=None), "batch_size=None"),
    ]:  # rows drawn out of order, repeated or left out: each to another example_id
        with pytest.raises(DataError, match=message):
            gradscope.norms(net, loader)
    with pytest.raises(TypeError, match="'batchsize'"):
        gradscope.norms(net, {"x": x, "y": y}, batchsize=3)
    with pytest.raises(ConfigError, match="data.batch_size"):
        gradscope.norms(project / "config.yaml", batch_size=0)
    with pytest.raises(ConfigError, match="pass a config"):
        gradscope.train(net)
    with pytest.raises(ConfigError, match="no data"):
        gradscope.norms(net)


def test_index_of_a_module_and_its_loader(project: Path) -> None:
    """The index of a module on a DataLoader, queried with the module, scores as the command
    line's index of the config; a query must name the model the index was built with."""
    config, ref = project / "config.yaml", project / "ref.pt"
    net, x, y = load_net(project)
    loader = DataLoader(TensorDataset(x, y), batch_size=4)
    cli("index", config, "--dim", 16, "--out", project / "cli.index")
    cli(
        "query",
        project / "cli.index",
        "--config",
        config,
        "--ref",
        ref,
        "--out",
        project / "q.parquet",
    )
    built = gradscope.build_index(net.double(), loader, dim=16, out=project / "api.index")
    scores = gradscope.query(built, net, loader, ref=torch.load(ref))
    pd.testing.assert_frame_equal(scores, pd.read_parquet(project / "q.parquet"))
    with pytest.raises(DataError, match="model.checkpoint is not what the index was built from"):
        gradscope.query(built, config, ref=ref)
