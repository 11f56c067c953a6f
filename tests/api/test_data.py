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
from gradscope.errors import ConfigError, DataError, ModelError


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
    with pytest.raises(ConfigError, match="^batch_size= must be at least 1"):
        gradscope.norms(project / "config.yaml", batch_size=0)
    with pytest.raises(ConfigError, match="pass a config"):
        gradscope.train(net)
    with pytest.raises(ConfigError, match="no data"):
        gradscope.norms(net)
    with torch.inference_mode(), pytest.raises(ModelError, match="inside torch.inference_mode"):
        gradscope.per_example_norms(net.double(), x.double(), y)  # an AttributeError before
    with pytest.raises(ConfigError, match="top_k must be at least 1, got 0"):  # 20, unsaid
        gradscope.write_report(project / "scores.parquet", top_k=0)
    with pytest.raises(ConfigError, match="write_report takes a scores file's path"):
        gradscope.write_report(pd.DataFrame())  # a TypeError before
    with pytest.raises(TypeError, match=r"out= must be a path \(str or Path\), got int"):
        gradscope.norms(net, {"x": x, "y": y}, out=5)  # pathlib's TypeError before
    with pytest.raises(ModelError, match="uninitialized parameter"):  # the weights' hash raised
        gradscope.norms(torch.nn.Sequential(torch.nn.LazyLinear(3)), {"x": x, "y": y})


def test_one_glob_as_a_string_is_that_glob(project: Path) -> None:
    """include="2.*" was read letter by letter: "pattern '2' matches no parameter"."""
    net, x, y = load_net(project)
    net, x = net.double(), x.double()
    one = gradscope.per_example_norms(net, x, y, include="fc2.*")
    listed = gradscope.per_example_norms(net, x, y, include=["fc2.*"])
    torch.testing.assert_close(one, listed, rtol=0, atol=0)


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
    with pytest.raises(ConfigError, match="candidates= sets how many exact=True re-scores"):
        gradscope.query(built, net, loader, ref=torch.load(ref), candidates=3)  # unread before
    with pytest.raises(DataError, match="model.checkpoint is not what the index was built from"):
        gradscope.query(built, config, ref=ref)


class _Interrupting(TensorDataset):
    """Rows that raise KeyboardInterrupt at row ``at`` (None: never)."""

    at: int | None = 6

    def __getitem__(self, i):
        if i == self.at:
            raise KeyboardInterrupt
        return super().__getitem__(i)


def test_a_held_model_resumes_by_its_weights_not_its_address(project: Path) -> None:
    """A held model was named by its address alone: a resume after its weights changed mixed
    rows of both weights; new objects of the same weights and rows resumed or not by where
    memory put them."""
    net, x, y = load_net(project)
    net = net.double()
    rows = _Interrupting(x, y)
    out = project / "r.parquet"
    with pytest.raises(BaseException, match="interrupted|saved"):
        gradscope.norms(net, DataLoader(rows, batch_size=4), out=out)
    rows.at = None
    with torch.no_grad():
        changed = type(net)().double()
        changed.load_state_dict({k: v * 3 for k, v in net.state_dict().items()})
    with pytest.raises(
        ConfigError, match="cannot resume: the interrupted run had a different model=;"
    ):
        gradscope.norms(changed, DataLoader(rows, batch_size=4), out=out, resume=True)
    again = type(net)().double()
    again.load_state_dict(net.state_dict())  # another object, the same weights and rows
    resumed = gradscope.norms(again, DataLoader(TensorDataset(x, y), batch_size=4), out=out,
                              resume=True)  # fmt: skip
    whole = gradscope.norms(net, {"x": x, "y": y})
    np.testing.assert_allclose(resumed["grad_norm"], whole["grad_norm"], rtol=1e-12)


def test_a_held_model_is_hashed_only_for_a_run_that_can_resume(
    project: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every call hashed the held model's weights for the run's key (seconds for a billion
    parameters), also with out=None, whose temporary file no run resumes."""
    import gradscope.io.files as files

    net, x, y = load_net(project)
    hashed: list[str] = []
    hash_tensor = files.hash_tensor
    monkeypatch.setattr(files, "hash_tensor", lambda h, name, *a, **k: (
        hashed.append(name), hash_tensor(h, name, *a, **k)))  # fmt: skip
    ref = torch.load(project / "ref.pt")
    gradscope.norms(net, {"x": x, "y": y})
    gradscope.influence(net, {"x": x, "y": y}, ref=ref)
    assert hashed == []
    gradscope.norms(net, {"x": x, "y": y}, out=project / "kept.parquet")
    assert sorted(hashed) == sorted(net.state_dict())


def test_a_query_of_a_held_model_whose_weights_changed_is_refused(project: Path) -> None:
    net, x, y = load_net(project)
    net, ref = net.double(), torch.load(project / "ref.pt")
    built = gradscope.build_index(net, {"x": x, "y": y}, dim=16, out=project / "a.index")
    copy = type(net)().double()
    copy.load_state_dict(net.state_dict())  # another object, the same weights: as the index
    gradscope.query(built, copy, {"x": x, "y": y}, ref=ref)
    with pytest.raises(ConfigError, match="top_k= must be at least 1, got 0"):  # as top_k=None
        gradscope.query(built, copy, {"x": x, "y": y}, ref=ref, top_k=0)
    with torch.no_grad():
        next(net.parameters()).add_(1)  # trained on: the indexed gradients are not its own
    with pytest.raises(DataError, match="model= is not what the index was built from"):
        gradscope.query(built, net, {"x": x, "y": y}, ref=ref)


def test_a_held_model_scored_in_another_dtype_is_left_as_it_was(project: Path) -> None:
    """dtype= converted the caller's model in place and left it so (float32 weights lost to
    bfloat16); a model of two dtypes was cast to its first's and left broken."""
    net, x, y = load_net(project)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    gradscope.norms(net, {"x": x, "y": y}, dtype="float64")
    assert all(torch.equal(before[k], v) and v.dtype == before[k].dtype
               for k, v in net.state_dict().items())  # fmt: skip
    mixed = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Linear(4, 3).double())
    with pytest.raises(ModelError, match="the model's parameters are of several dtypes"):
        gradscope.norms(mixed, {"x": x, "y": y})
    assert mixed[1].weight.dtype == torch.float64 and mixed[0].weight.dtype == torch.float32


def test_a_call_leaves_the_callers_random_state(project: Path) -> None:
    """A DataLoader draws its base seed from torch's generator each time it is read, and a run
    reads it more than once: the caller's next draws moved."""
    net, x, y = load_net(project)
    state = torch.random.get_rng_state()
    gradscope.norms(net.double(), DataLoader(TensorDataset(x, y), batch_size=4))
    assert torch.equal(torch.random.get_rng_state(), state)


def test_an_adam_state_held_in_python_preconditions_influence(project: Path) -> None:
    """per_example_influence took optimizer.state_dict() as precondition=; influence() read its
    str() as a path (OSError: file name too long)."""
    net, x, y = load_net(project)
    net, x, ref = net.double(), x.double(), torch.load(project / "ref.pt")
    optimizer = torch.optim.Adam(net.parameters())
    torch.nn.functional.cross_entropy(net(x), y).backward()
    optimizer.step()
    state = optimizer.state_dict()
    want = gradscope.per_example_influence(net, x, y, ref["x"].double(), ref["y"],
                                           precondition=state)  # fmt: skip
    got = gradscope.influence(net, {"x": x, "y": y}, ref=ref, precondition=state)
    np.testing.assert_allclose(got["influence"], want.numpy(), rtol=1e-10)


def test_a_dataframe_is_rows_and_a_generator_is_refused(project: Path) -> None:
    """A DataFrame was read as a map-style Dataset ('cannot read data: 0'); a generator read
    once, then 'the dataset is empty' for its rows."""
    net, x, y = load_net(project)
    frame = pd.DataFrame({"x": list(x.numpy()), "y": y.numpy()})
    got = gradscope.norms(net, frame)
    want = gradscope.norms(net, {"x": x, "y": y})
    np.testing.assert_allclose(got["grad_norm"], want["grad_norm"], rtol=1e-12)
    with pytest.raises(DataError, match="got an iterator .a generator., which reads its rows once"):
        gradscope.norms(net, ({"x": x[i], "y": y[i]} for i in range(N)))


def test_ctrl_c_in_a_call_is_a_keyboard_interrupt_in_the_apis_words(project: Path) -> None:
    """It was an Exception (a user's `except Exception` ate Ctrl-C) saying 'run the same command
    with --resume', also where out=None's temporary folder took the saved rows with it (then
    'run the same call with resume=True to continue', and that call 'nothing to resume')."""
    net, x, y = load_net(project)
    with pytest.raises(KeyboardInterrupt) as e:
        gradscope.norms(net, DataLoader(_Interrupting(x, y), batch_size=4))
    assert str(e.value) == (
        "interrupted with 4 examples saved to out=None's temporary folder, which went with the "
        "call: give out= to keep them for resume=True"
    )
    with pytest.raises(ConfigError, match=r"resume=True continues .* give that out= \(a call"):
        gradscope.norms(net, {"x": x, "y": y}, resume=True)
    with pytest.raises(KeyboardInterrupt, match="the same call with resume=True") as e:
        gradscope.norms(net, DataLoader(_Interrupting(x, y), batch_size=4),
                        out=project / "k.parquet")  # fmt: skip
    assert "out=" not in str(e.value)


class _ExtraState(torch.nn.Linear):
    def get_extra_state(self):
        return {"note": "kept"}

    def set_extra_state(self, state):
        pass


class _SelfIterating(torch.utils.data.IterableDataset):
    """Its own iterator, begun again at each iter(): rows, not a generator."""

    def __init__(self, x, y):
        self.x, self.y, self.i = x, y, 0

    def __iter__(self):
        self.i = 0
        return self

    def __next__(self):
        if self.i == len(self.y):
            raise StopIteration
        self.i += 1
        return {"x": self.x[self.i - 1], "y": self.y[self.i - 1]}


def test_what_the_held_identity_met_in_review(project: Path) -> None:
    """A model with gradients scored in another dtype (its restore raised and left it half
    converted); a loss callable changed under a resume or an index (both accepted); a module
    with extra state (AttributeError); a Dataset that is its own iterator (refused as a
    generator)."""
    net, x, y = load_net(project)
    torch.nn.functional.cross_entropy(net(x), y).backward()
    grads = [p.grad.clone() for p in net.parameters()]
    gradscope.norms(net, {"x": x, "y": y}, dtype="float64")
    assert all(p.dtype == torch.float32 and torch.equal(p.grad, g)
               for p, g in zip(net.parameters(), grads, strict=True))  # fmt: skip

    def mean(outputs, targets):
        return torch.nn.functional.cross_entropy(outputs, targets, reduction="none")

    def hundred(outputs, targets):
        return 100 * mean(outputs, targets)

    rows = _Interrupting(x, y)
    out = project / "l.parquet"
    with pytest.raises(KeyboardInterrupt):
        gradscope.norms(net, DataLoader(rows, batch_size=4), out=out, loss=mean)
    rows.at = None
    with pytest.raises(ConfigError, match="different loss=; run without resume=True"):
        gradscope.norms(net, DataLoader(rows, batch_size=4), out=out, loss=hundred, resume=True)
    built = gradscope.build_index(net, {"x": x, "y": y}, dim=8, loss=mean, out=project / "l.index")
    with pytest.raises(ConfigError, match="loss= is not what the index was built with"):
        gradscope.query(built, net, {"x": x, "y": y}, ref=torch.load(project / "ref.pt"),
                        loss=hundred)  # fmt: skip
    extra = torch.nn.Sequential(_ExtraState(5, 3))
    assert len(gradscope.norms(extra, {"x": x, "y": y})) == N
    assert len(gradscope.norms(net, _SelfIterating(x, y))) == N
