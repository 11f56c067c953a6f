"""Every user-fixable mistake ends with exit status 2 and one line naming what is at fault."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from project import Marker, edit_checkpoint, edit_config, edit_data, make_project
from typer.testing import CliRunner

from gradscope.cli import app

runner = CliRunner()


MORE_CODE = """

class Empty(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(())


def nothing():
    return Empty()


class NoParams(nn.Module):
    def forward(self, x):
        return x[:, :3]


class Lookup(Net):
    def forward(self, x):
        return {"logits": super().forward(x)}["logit"]


def weighted(outputs, targets):
    return {"per_example": outputs.sum(1)}["weight"]


class Checkpointed(Net):
    '''Its last layer recomputed in the backward by the reentrant checkpoint, which
    autograd.grad cannot run through.'''

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.fc2, torch.tanh(self.fc1(x)), use_reentrant=True)


class Refusing(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise ValueError("no gradient here")


class OwnBackward(Net):
    def forward(self, x):
        return Refusing.apply(super().forward(x))


class Broken(Net):
    def __init__(self):
        raise ValueError("no weights here")


def raising():
    raise FileNotFoundError("rows.csv")


def scalar_first():
    return {"n": 5, "x": torch.zeros(4, 5), "y": torch.zeros(4, dtype=torch.long)}


def wide_ids():
    return {"x": torch.zeros(4, 5), "y": torch.zeros(4, dtype=torch.long),
            "i": torch.zeros(4, 2)}  # fmt: skip


class Seg(nn.Module):
    '''(B, 3, 2, 3) logits: 3 classes at 2 x 3 pixels, as many classes as columns.'''

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 18)

    def forward(self, x):
        return self.fc(x).view(-1, 3, 2, 3)
"""

# a billion laughs: eight nested aliases, each ten of the one before, in params.include
ANCHORS = "params:\n  include:\n    - &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"    - &{b} [*{a}, *{a}, *{a}, *{a}, *{a}, *{a}, *{a}, *{a}, *{a}, *{a}]\n"
    for a, b in zip("abcdefg", "bcdefgh", strict=True)
)


def _factory(name: str, **more):
    """A spoiler that makes ``model.py:name`` the model factory."""
    return lambda r: edit_config(r, lambda c: c["model"].update(factory=f"model.py:{name}", **more))


def _data(**more):
    """A spoiler that sets keys of the config's ``data``."""
    return lambda r: edit_config(r, lambda c: c["data"].update(**more))


def _prefixed(prefix: str):
    def change(state: dict) -> None:
        renamed = {prefix + k: v for k, v in state.items()}
        state.clear()
        state.update(renamed)

    return change


def segmentation(root: Path) -> None:
    _factory("Seg", checkpoint=None)(root)
    edit_data(root, lambda d: d.update(y=torch.randint(0, 3, (len(d["y"]), 2, 3))))


def _csv_with_text(root: Path) -> None:
    """The data as CSV, one value of a number column a word: the column reads as text."""
    data = torch.load(root / "data.pt")
    lines = ["x0,x1,x2,x3,x4,y"] + [
        ",".join([*map(str, x.tolist()), str(int(y))])
        for x, y in zip(data["x"], data["y"], strict=True)
    ]
    lines[3] = "abc," + lines[3].split(",", 1)[1]
    (root / "data.csv").write_text("\n".join(lines) + "\n")
    _data(path="data.csv", inputs="x*")(root)


def _parquet_with_nulls(root: Path, column: str) -> None:
    """The data as Parquet, one row of ``column`` null (``y``: an integer column)."""
    data = torch.load(root / "data.pt")
    x, y = data["x"].tolist(), data["y"].tolist()
    (x if column == "x" else y)[2] = None
    (root / "rows").mkdir()  # not beside the scores: nothing may be written there
    pq.write_table(pa.table({"x": x, "y": pa.array(y, pa.int64())}), root / "rows/data.parquet")
    _data(path="rows/data.parquet")(root)


ITEMS = """
from pathlib import Path
class Items(torch.utils.data.Dataset):
    def __init__(self, fail):
        self.data, self.fail = torch.load(Path(__file__).parent / "data.pt"), fail
    def __len__(self):
        return len(self.data["y"])
    def __getitem__(self, i):
        if i == 2 and self.fail == "raise":
            raise KeyError(f"bad row {i}")
        item = {"x": self.data["x"][i], "y": self.data["y"][i]}
        return {"x": item["x"]} if i == 2 and self.fail == "key" else item
def raising():
    return Items("raise")
def keyless():
    return Items("key")
class Long(Items):  # its len() one past its rows
    def __init__(self):
        super().__init__(None)
        self.rows = [super(Long, self).__getitem__(i) for i in range(3)]
    def __len__(self):
        return 4
    def __getitem__(self, i):
        return self.rows[i]
def long():
    return Long()
"""


def _items(fn: str):
    """The data a ``Dataset`` of ``model.py`` makes, its item 2 raising or lacking ``y``, or
    its ``len()`` one past its items."""

    def spoil(root: Path) -> None:
        with (root / "model.py").open("a") as f:
            f.write(ITEMS)
        _data(path=f"model.py:{fn}")(root)

    return spoil


def _ids_of_lists(root: Path) -> None:
    """The data as Parquet with a list column of ragged rows named as data.ids."""
    data = torch.load(root / "data.pt")
    tokens = [list(range(1 + i % 3)) for i in range(len(data["y"]))]
    (root / "rows").mkdir()
    pq.write_table(pa.table({"x": data["x"].tolist(), "y": data["y"].tolist(), "t": tokens}),
                   root / "rows/data.parquet")  # fmt: skip
    _data(path="rows/data.parquet", ids="t")(root)


# (id, how to spoil the project, extra arguments, start of the error line, text it must name)
CASES = [
    # data whose values were misread: named for what they are (a probe's)
    (
        "empty-data-file",
        lambda r: (r / "data.pt").write_bytes(b""),
        [],
        "the data file is empty (0 bytes)",
        "data.pt",
    ),
    ("csv-text", _csv_with_text, [], "column 'x0' holds text ('abc'), not numbers", "data.csv"),
    (
        "parquet-null-list",
        lambda r: _parquet_with_nulls(r, "x"),
        [],
        "column 'x' holds a null (a missing value)",
        "data.parquet",
    ),
    (
        "parquet-null-integer",
        lambda r: _parquet_with_nulls(r, "y"),
        [],
        "cross_entropy takes class ids as integers, got floats (an integer column with a null",
        "data.targets",
    ),
    (
        "float-class-ids",
        lambda r: edit_data(r, lambda d: d.update(y=d["y"].double())),
        [],
        "cross_entropy takes class ids as integers, got floats",
        "data.targets",
    ),
    (
        "item-raises",
        _items("raising"),
        [],
        "the dataset's item 2 raised KeyError: 'bad row 2'",
        "model.py:raising",
    ),
    ("item-keyless", _items("keyless"), [], "dataset item 2 has no 'y'", "model.py:keyless"),
    (
        "len-past-the-items",
        _items("long"),
        [],
        "the dataset's item 3 raised IndexError: list index out of range (its len() is 4)",
        "model.py:long",
    ),
    (
        "missing-config",
        lambda r: (r / "config.yaml").unlink(),
        [],
        "config file not found",
        "config.yaml",
    ),
    (
        "malformed-yaml",
        lambda r: (r / "config.yaml").write_text("model: [unclosed\ndata: {}\n"),
        [],
        "malformed YAML",
        "config.yaml, line",
    ),
    (
        "unknown-key",
        _data(batchsize=3),
        [],
        "unknown key 'data.batchsize'",
        "config.yaml",
    ),
    (
        "wrong-type",
        _data(batch_size="big"),
        [],
        "'data.batch_size' must be an integer",
        "config.yaml",
    ),
    (
        "missing-checkpoint",
        lambda r: (r / "net.pt").unlink(),
        [],
        "checkpoint not found",
        "net.pt",
    ),
    ("missing-data", lambda r: (r / "data.pt").unlink(), [], "data file not found", "data.pt"),
    (
        "checkpoint-keys",
        lambda r: edit_checkpoint(r, lambda s: s.update({"fc3.weight": torch.zeros(1)})),
        [],
        "checkpoint does not fit the model: unexpected fc3.weight",
        "net.pt",
    ),
    (
        "checkpoint-prefix",  # a torch.compile'd model's state dict
        lambda r: edit_checkpoint(r, _prefixed("_orig_mod.")),
        [],
        "checkpoint does not fit the model: every key starts with '_orig_mod.', which the "
        "model's do not; set model.strip_prefix: '_orig_mod.'",
        "net.pt",
    ),
    (
        "reentrant-checkpoint",
        _factory("Checkpointed"),
        [],
        "the model's backward raised RuntimeError: ",
        "(model)",
    ),
    (
        "own-backward",
        _factory("OwnBackward"),
        [],
        "the model's backward raised ValueError: no gradient here",
        "(model)",
    ),
    (
        "checkpoint-shapes",
        lambda r: edit_checkpoint(r, lambda s: s.update({"fc1.bias": torch.zeros(9)})),
        [],
        "checkpoint does not fit the model: fc1.bias has shape (9,), the model expects (8,)",
        "net.pt",
    ),
    (
        "checkpoint-shapes-all-named",
        lambda r: edit_checkpoint(
            r, lambda s: s.update({"fc1.bias": torch.zeros(9), "fc2.weight": torch.zeros(3, 2)})
        ),
        [],
        "checkpoint does not fit the model: fc1.bias has shape (9,), the model expects (8,); "
        "fc2.weight has shape (3, 2), the model expects (3, 8)",
        "net.pt",
    ),
    (
        "no-inputs-column",
        _data(inputs="features"),
        [],
        "no column 'features' for data.inputs (columns: x, y, name)",
        "data.pt",
    ),
    (
        "no-targets-column",
        _data(targets="label"),
        [],
        "no column 'label' for data.targets",
        "data.pt",
    ),
    (
        "inputs-the-model-cannot-take",
        lambda r: edit_data(r, lambda d: d.update(x=torch.randn(len(d["y"]), 6))),
        [],
        "the model cannot take inputs of shape (4, 6)",
        "data.inputs",
    ),
    (
        "unknown-loss",
        lambda r: edit_config(r, lambda c: c.update(loss={"name": "hinge"})),
        [],
        "'loss.name' must be one of",
        "hinge",
    ),
    (
        "empty-dataset",
        lambda r: edit_data(r, lambda d: d.update({k: v[:0] for k, v in d.items()})),
        [],
        "the dataset is empty",
        "data.pt",
    ),
    (
        "empty-iterable-dataset",  # its emptiness shows only once it has been read
        _data(path="model.py:nothing"),
        [],
        "the dataset is empty",
        "model.py:nothing",
    ),
    (
        "config-not-utf8",
        lambda r: (r / "config.yaml").write_bytes(b"model: {factory: caf\xe9.py:Net}\n"),
        [],
        "the config is not UTF-8 text",
        "config.yaml",
    ),
    (
        "factory-file-syntax-error",
        lambda r: (r / "model.py").write_text("class Net(nn.Module:\n"),
        [],
        "cannot import",
        "model.py: SyntaxError",
    ),
    (
        "factory-file-import-fails",
        lambda r: (r / "model.py").write_text("import no_such_package_here\n"),
        [],
        "cannot import",
        "model.py: ModuleNotFoundError",
    ),
    (
        "model-without-parameters",
        _factory("NoParams", checkpoint=None),
        [],
        "the model has no parameters",
        "model.factory",
    ),
    (
        "key-error-in-forward",
        _factory("Lookup"),
        [],
        "the model cannot take inputs of shape (4, 5): Lookup's forward raised KeyError: 'logit'",
        "data.inputs",
    ),
    (
        "key-error-in-loss",
        lambda r: edit_config(r, lambda c: c.update(loss={"name": "model.py:weighted"})),
        [],
        "the loss cannot take the model's outputs: KeyError: 'weight'",
        "loss",
    ),
    (
        "output-is-a-folder",
        lambda r: (r / "out").mkdir(),
        ["--out", "{root}/out"],
        "the output path is a folder",
        "out",
    ),
    (
        "output-folder-is-a-file",
        lambda r: (r / "out").write_text("a file"),
        ["--out", "{root}/out/scores.parquet"],
        "the output's folder",
        "is a file",
    ),
    (
        "limit-0",
        _data(limit=0),
        [],
        "'data.limit' must be at least 1, got 0",
        "config.yaml",
    ),
    ("limit-0-option", lambda r: None, ["--limit", "0"], "--limit must be at least 1", "--limit"),
    ("top-k-option", lambda r: None, ["--top-k", "-3"], "--top-k must be at least 1", "--top-k"),
    (
        "nested-yaml-anchors",
        lambda r: (r / "config.yaml").write_text((r / "config.yaml").read_text() + ANCHORS),
        [],
        "the config expands to more than 100000 values",
        "config.yaml",
    ),
    (
        "int-checkpoint",
        lambda r: edit_checkpoint(r, lambda s: s.update({"fc1.weight": s["fc1.weight"].int()})),
        [],
        "checkpoint does not fit the model: fc1.weight is int32, the model expects float32",
        "net.pt",
    ),
    (
        "checkpoint-a-scores-file",
        lambda r: pq.write_table(pa.table({"loss": [1.0]}), r / "net.pt"),
        [],
        "checkpoint is a Parquet file (a scores file?), not one that torch.save or safetensors "
        "writes",
        "net.pt",
    ),
    (
        "checkpoint-a-text-file",
        lambda r: (r / "net.pt").write_text("fc1.weight: [1, 2]\n"),
        [],
        "checkpoint is not a file that torch.save or safetensors writes",
        "net.pt",
    ),
    (
        "precondition-a-scores-file",
        lambda r: pq.write_table(pa.table({"loss": [1.0]}), r / "old.pq"),
        ["--precondition", "{root}/old.pq"],
        "--precondition file is a Parquet file (a scores file?), not one that torch.save or "
        "safetensors writes",
        "old.pq",
    ),
    (
        "segmentation-with-the-default-class-dim",
        segmentation,
        [],
        "cross_entropy with loss.class_dim -1 takes targets of shape (4, 3, 2) for outputs of "
        "shape (4, 3, 2, 3), got (4, 2, 3); the classes are along dim 1: set loss.class_dim: 1",
        "(loss.class_dim)",
    ),
    (
        "factory-raises",
        _factory("Broken"),
        [],
        "the model factory raised ValueError: no weights here",
        "(model.factory)",
    ),
    (
        "data-function-raises",
        _data(path="model.py:raising"),
        [],
        "the data function raised FileNotFoundError: rows.csv",
        "(data.path)",
    ),
    (
        "data-function-scalar",
        _data(path="model.py:scalar_first"),
        [],
        "",
        "a dict whose 'n' is not a column",
    ),
    (  # numpy's "setting an array element with a sequence", as a traceback
        "ids-a-list-column",
        _ids_of_lists,
        [],
        "column 't' for data.ids holds a list a row, not one value",
        "data.parquet",
    ),
    (
        "ids-of-two-values",
        _data(path="model.py:wide_ids", ids="i"),
        [],
        "column 'i' for data.ids holds (2,) values a row, not one",
        "wide_ids",
    ),
    (
        "out-named-as-a-csv",
        lambda r: None,
        ["--out", "{root}/scores.csv"],
        "the output is written as Parquet, not .csv: name it .parquet",
        "scores.csv",
    ),
    (
        "cuda-without-cuda",
        lambda r: None,
        ["--device", "cuda"],
        "device 'cuda' asked for, but CUDA is not available here",
        "device",
    ),
]


@pytest.mark.parametrize(
    ("spoil", "args", "message", "names"),
    [pytest.param(*case[1:], id=case[0]) for case in CASES],
)
def test_exit_2_with_one_line(tmp_path, spoil, args, message, names):
    if "--device" in args and torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    config = make_project(tmp_path)
    with (tmp_path / "model.py").open("a") as f:
        f.write(MORE_CODE)
    spoil(tmp_path)
    result = runner.invoke(app, ["norms", str(config), *(a.format(root=tmp_path) for a in args)])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and len(lines[0]) < 1000, result.stderr[:2000]
    assert lines[0].startswith(f"error: {message}"), lines[0]
    assert names in lines[0]
    assert "Traceback" not in result.output
    assert not list(tmp_path.glob("*.parquet")) and not list(tmp_path.glob(".*.partial"))


def test_pickled_checkpoint_is_refused_without_running_it(tmp_path):
    config = make_project(tmp_path)
    marker = tmp_path / "ran"
    torch.save({"fc1.weight": Marker(marker)}, tmp_path / "net.pt")
    result = runner.invoke(app, ["norms", str(config)])
    assert result.exit_code == 2
    (line,) = result.stderr.strip().splitlines()
    assert "weights_only=True" in line and "--trust-checkpoint" in line and "net.pt" in line
    assert not marker.exists()
    # trusted, the pickle runs (and its result, not being a tensor, still does not fit)
    result = runner.invoke(app, ["norms", str(config), "--trust-checkpoint"])
    assert result.exit_code == 2
    assert marker.exists()


def test_nonfinite_example_is_flagged_and_the_rest_unchanged(tmp_path):
    import pandas as pd

    config = make_project(tmp_path, n=10)
    data = torch.load(tmp_path / "data.pt")
    clean = {k: torch.cat([v[:5], v[6:]]) for k, v in data.items()}
    data["x"][5, 2] = float("nan")
    torch.save(data, tmp_path / "data.pt")
    assert (
        runner.invoke(app, ["norms", str(config), "--out", str(tmp_path / "bad.parquet")]).exit_code
        == 0
    )
    torch.save(clean, tmp_path / "data.pt")
    assert (
        runner.invoke(app, ["norms", str(config), "--out", str(tmp_path / "ok.parquet")]).exit_code
        == 0
    )
    bad, ok = pd.read_parquet(tmp_path / "bad.parquet"), pd.read_parquet(tmp_path / "ok.parquet")
    assert bad["finite"].tolist() == [True] * 5 + [False] + [True] * 4
    kept = bad.drop(index=5).reset_index(drop=True)
    pd.testing.assert_frame_equal(
        kept[["loss", "grad_norm", "target"]], ok[["loss", "grad_norm", "target"]], rtol=1e-6
    )


def test_missing_ref_file(tmp_path):
    config = make_project(tmp_path)
    result = runner.invoke(app, ["influence", str(config), "--ref", str(tmp_path / "nope.pt")])
    assert result.exit_code == 2
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: --ref file not found") and "nope.pt" in line


def test_ids_with_a_missing_value_in_a_later_row_group(tmp_path):
    """Checked as each batch is read, not found at assembly as a column of another type."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    config = make_project(tmp_path, n=16)
    data = torch.load(tmp_path / "data.pt")
    names = data["name"].tolist()
    names[13] = None
    table = pa.table(
        {"x": data["x"].tolist(), "y": data["y"].numpy(), "name": pa.array(names, pa.int64())}
    )
    pq.write_table(table, tmp_path / "data.parquet", row_group_size=8)
    edit_config(tmp_path, lambda c: c["data"].update(path="data.parquet", ids="name"))
    result = runner.invoke(app, ["norms", str(config)])
    assert result.exit_code == 2, result.output
    (line,) = result.stderr.strip().splitlines()
    assert (
        line
        == f"error: column 'name' for data.ids has no value at row 13 ({tmp_path / 'data.parquet'})"
    )


def not_parquet(path: Path) -> None:
    path.write_text("example_id,grad_norm\n0,1.5\n")


def cut_short(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-20])


# (id, how to spoil the scores file, arguments, start of the error line, text it must name)
SUMMARY_CASES = [
    ("csv", not_parquet, [], "not a readable Parquet file", "scores.parquet"),
    ("truncated", cut_short, [], "not a readable Parquet file", "scores.parquet"),
    (
        "string-column",
        None,
        ["--by", "name"],
        "column 'name' holds",
        "not numbers to rank by (--by)",
    ),
    ("negative-top-k", None, ["--top-k", "-3"], "--top-k must be at least 1, got -3", "--top-k"),
]


@pytest.mark.parametrize(
    ("spoil", "args", "message", "names"),
    [pytest.param(*case[1:], id=case[0]) for case in SUMMARY_CASES],
)
def test_summary_exit_2_with_one_line(tmp_path, spoil, args, message, names):
    import pandas as pd

    scores = tmp_path / "scores.parquet"
    pd.DataFrame({"grad_norm": [1.0, 2.0], "name": ["a", "b"]}).to_parquet(scores)
    if spoil:
        spoil(scores)
    result = runner.invoke(app, ["summary", str(scores), *args])
    assert result.exit_code == 2, result.output
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"error: {message}") and names in line, line


def test_precondition_pickle_is_refused_without_suggesting_trust_checkpoint(tmp_path):
    config = make_project(tmp_path)
    torch.save({"x": torch.randn(3, 5), "y": torch.randint(0, 3, (3,))}, tmp_path / "ref.pt")
    marker = tmp_path / "ran"
    torch.save({"state": Marker(marker)}, tmp_path / "adam.pt")
    args = ["--ref", str(tmp_path / "ref.pt"), "--precondition", str(tmp_path / "adam.pt")]
    result = runner.invoke(app, ["influence", str(config), *args])
    assert result.exit_code == 2, result.output
    (line,) = result.stderr.strip().splitlines()
    assert "weights_only=True" in line and "adam.pt" in line, line
    assert "--trust-checkpoint" not in line and "optimizer.state_dict()" in line
    assert not marker.exists()


def test_segmentation_logits_score_with_class_dim_1(tmp_path):
    """The refused config above, with its class_dim set: the loss F.cross_entropy gives; the
    true Fisher's factors refuse the default class_dim as the loss does."""
    import pandas as pd
    import torch.nn.functional as F

    from gradscope.io.model import import_object

    config = make_project(tmp_path)
    with (tmp_path / "model.py").open("a") as f:
        f.write(MORE_CODE)
    segmentation(tmp_path)
    args = ["factors", str(config), "--out", str(tmp_path / "f.safetensors")]
    result = runner.invoke(app, args)
    assert result.exit_code == 2 and "set loss.class_dim: 1 (loss.class_dim)" in result.stderr
    edit_config(tmp_path, lambda c: c.update(loss={"name": "cross_entropy", "class_dim": 1}))
    assert runner.invoke(app, ["norms", str(config)]).exit_code == 0
    torch.manual_seed(0)  # the weights a run without checkpoint builds
    model = import_object(f"{tmp_path / 'model.py'}:Seg", "test")()
    data = torch.load(tmp_path / "data.pt")
    with torch.no_grad():
        expected = F.cross_entropy(model(data["x"]), data["y"], reduction="none").mean((1, 2))
    got = torch.tensor(pd.read_parquet(tmp_path / "scores.parquet")["loss"].to_numpy())
    torch.testing.assert_close(got, expected.double(), rtol=1e-6, atol=1e-7)
    assert runner.invoke(app, [*args, "--fisher", "true"]).exit_code == 0
