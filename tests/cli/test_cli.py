"""The command line through typer's runner: exit codes, tables, the Parquet schema and metadata."""

from __future__ import annotations

import copy
import math

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from oracle import assert_rel_close, reference_norms
from project import edit_config, load_net, make_project, one_error
from typer.testing import CliRunner

from gradscope.cli import app
from gradscope.io.model import import_object
from gradscope.io.parquet import read_metadata
from gradscope.losses import resolve_loss

runner = CliRunner()


def test_norms_writes_parquet_and_prints_outliers(tmp_path):
    config = make_project(tmp_path, n=23, data__ids="name")
    result = runner.invoke(app, ["norms", str(config), "--top-k", "5", "--per-layer"])
    assert result.exit_code == 0, result.output
    assert "top 5 outliers by loss" in result.output  # the loss ranks unless --by says
    assert "per class (loss)" in result.output
    assert "23 examples; loss: median" in result.output
    schema = pq.read_schema(tmp_path / "scores.parquet")
    assert schema.names == [
        "example_id",
        "id",
        "loss",
        "grad_norm",
        "grad_norm/fc1",
        "grad_norm/fc2",
        "target",
        "pred",
        "prob",
        "margin",
        "robust_z",
        "class_z",
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
        "int64",
        "double",
        "double",
        "double",
        "double",
        "bool",
    ]
    frame = pd.read_parquet(tmp_path / "scores.parquet")
    net, x, y = load_net(tmp_path)
    _, norm = reference_norms(net, (x,), y, "cross_entropy")
    assert_rel_close(torch.tensor(frame["grad_norm"].to_numpy()), norm, 1e-4)
    assert frame["finite"].all()
    median = frame["loss"].median()  # robust_z: robust z of the ranked loss over every row
    mad = (frame["loss"] - median).abs().median()
    assert frame["robust_z"].to_numpy() == pytest.approx(
        ((frame["loss"] - median) / (1.4826 * mad)).to_numpy()
    )
    for _, group in frame.groupby("target"):  # class_z: robust z of the loss within the class
        median = group["loss"].median()
        mad = (group["loss"] - median).abs().median()
        expected = (group["loss"] - median) / (1.4826 * mad)
        assert group["class_z"].to_numpy() == pytest.approx(expected.to_numpy())
    # the table's first row is the largest loss
    top = frame.loc[frame["loss"].idxmax()]
    first = next(line for line in result.output.splitlines() if "│" in line)
    assert f"{top['loss']:.4g}" in first and f"{top['grad_norm']:.4g}" in first
    assert_predictions(frame, net, x, y)


def assert_predictions(frame: pd.DataFrame, net: torch.nn.Module, x, y) -> None:
    """pred, prob and margin against the model's logits, one example at a time in float64."""
    model = copy.deepcopy(net).double()
    for i, row in frame.iterrows():
        logits = model(x[i : i + 1].double())[0].tolist()
        target = int(y[i])
        others = [v for j, v in enumerate(logits) if j != target]
        assert row["pred"] == max(range(len(logits)), key=logits.__getitem__)
        prob = math.exp(logits[target]) / sum(math.exp(v) for v in logits)
        assert row["prob"] == pytest.approx(prob, rel=1e-5)
        assert row["margin"] == pytest.approx(logits[target] - max(others), rel=1e-5, abs=1e-6)


def test_norms_at_several_checkpoints(tmp_path):
    """grad_norm@k and loss@k against the loop at each checkpoint; self_influence their sum."""
    make_project(tmp_path)
    net, x, y = load_net(tmp_path)
    torch.manual_seed(1)
    earlier = {k: v + 0.3 * torch.randn_like(v) for k, v in net.state_dict().items()}
    torch.save(earlier, tmp_path / "net0.pt")
    ckpts = [{"path": "net0.pt", "weight": 0.5}, {"path": "net.pt", "weight": 2.0}]
    config = make_project(tmp_path, model__checkpoint=None, model__checkpoints=ckpts)
    result = runner.invoke(app, ["norms", str(config), "--top-k", "3"])
    assert result.exit_code == 0, result.output
    assert "top 3 outliers by self_influence, highest first" in result.output  # not grad_norm
    frame = pd.read_parquet(tmp_path / "scores.parquet")
    assert [c for c in frame.columns if "@" in c or c == "self_influence"] == [
        "loss@0", "grad_norm@0", "loss@1", "grad_norm@1", "self_influence",
    ]  # fmt: skip
    loss1, norm1 = reference_norms(net, (x,), y, "cross_entropy")
    assert_predictions(frame, net, x, y)  # the last checkpoint's model
    net.load_state_dict(earlier)
    loss0, norm0 = reference_norms(net, (x,), y, "cross_entropy")
    for column, expected in [("loss@0", loss0), ("grad_norm@0", norm0), ("loss@1", loss1),
                             ("grad_norm@1", norm1), ("grad_norm", norm1), ("loss", loss1),
                             ("self_influence", 0.5 * norm0**2 + 2.0 * norm1**2)]:  # fmt: skip
        assert_rel_close(torch.tensor(frame[column].to_numpy()), expected, 1e-4)


def test_options_override_config(tmp_path):
    config = make_project(tmp_path, n=23)
    out = tmp_path / "sub" / "custom.parquet"
    out.parent.mkdir()  # an output goes in a folder that exists
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
    meta = read_metadata(out)
    assert meta["config"]["data"]["limit"] == 7
    assert 0 < meta["seconds"] < 600  # the run's wall time
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


def test_report_command_and_flag(tmp_path):
    config = make_project(tmp_path)
    result = runner.invoke(app, ["norms", str(config), "--report", "--top-k", "4"])
    assert result.exit_code == 0, result.output
    assert f"wrote {tmp_path / 'scores.html'}" in result.output.replace("\n", "")
    page = (tmp_path / "scores.html").read_text()
    assert page.count('<tr class="row">') == 4
    assert page.count('class="text"') == 4  # the 5 features of each example, as values
    out = tmp_path / "r.html"
    args = ["report", str(tmp_path / "scores.parquet"), "--out", str(out), "--by", "loss"]
    result = runner.invoke(app, [*args, "--top-k", "3"])
    assert result.exit_code == 0, result.output
    page = out.read_text()
    assert page.count('<tr class="row">') == 3 and "top 3 marked" in page
    assert 'class="text"' not in page and "--config" in page  # no config: no examples
    args = ["report", str(tmp_path / "scores.parquet"), "--config", str(config), "--out"]
    result = runner.invoke(app, [*args, str(tmp_path / "data.pt")])
    assert result.exit_code == 2 and "the output path is the run's data.path" in result.stderr
    assert torch.load(tmp_path / "data.pt")["x"].shape == (23, 5)  # untouched


@pytest.mark.parametrize(
    ("args", "edit", "message"),
    [
        (["--out", "{r}/res.html"], None, "--report writes its page beside the scores, as .html"),
        ([], {"data": {"show": "nope"}}, "no column 'nope' for data.show"),
        ([], {"report": {"tokenizer": "nowhere"}}, "cannot load a tokenizer from the folder"),
        ([], {"report": {"image_shape": [2, 3]}}, "report.image_shape [2, 3] fits no input"),
    ],
    ids=["scores-as-html", "show-column", "tokenizer", "image-shape"],
)
def test_what_report_needs_is_checked_before_the_scores(tmp_path, args, edit, message):
    """The scores were written, then the report failed (the scores at res.html, refused as the
    report's own path): exit 2 with the run's output replaced."""
    config = make_project(tmp_path)
    if edit:
        edit_config(tmp_path, lambda c: [c.setdefault(k, {}).update(v) for k, v in edit.items()])
    argv = ["norms", str(config), "--report", *(a.format(r=tmp_path) for a in args)]
    result = runner.invoke(app, argv)
    assert result.exit_code == 2 and message in result.stderr, result.output
    assert not list(tmp_path.glob("*.parquet")) and not list(tmp_path.glob("res.*"))


def test_report_refuses_an_image_shape_that_fits_no_input(tmp_path):
    """``report --config``: each example was shown as its values, the shape read by nothing."""
    config = make_project(tmp_path)
    assert runner.invoke(app, ["norms", str(config)]).exit_code == 0
    edit_config(tmp_path, lambda c: c.setdefault("report", {}).update(image_shape=[2, 3]))
    result = runner.invoke(
        app, ["report", str(tmp_path / "scores.parquet"), "--config", str(config)]
    )
    assert result.exit_code == 2 and "report.image_shape [2, 3] fits no input" in result.stderr
    assert not list(tmp_path.glob("*.html"))
    edit_config(tmp_path, lambda c: c["report"].update(image_shape=[1, 5]))  # x: 5 values
    result = runner.invoke(
        app, ["report", str(tmp_path / "scores.parquet"), "--config", str(config)]
    )
    assert result.exit_code == 0, result.output


def test_user_errors_exit_2_with_one_line(tmp_path):
    cases = [
        (["norms", str(tmp_path / "missing.yaml")], "error: config file not found"),
        (
            ["norms", str(make_project(tmp_path, data__targets="label"))],
            "error: no column 'label' for data.targets",
        ),
        (["summary", str(tmp_path / "none.parquet")], "error: scores file not found"),
        (["report", str(tmp_path / "none.parquet")], "error: scores file not found"),
        # a folder where a file is read was "not found" (an index folder for a scores file)
        (["summary", str(tmp_path)], "error: scores file is a folder, not a file (an index"),
        (
            ["norms", str(tmp_path / "config.yaml"), "--precondition", str(tmp_path)],
            "error: preconditioner file is a folder, not a file",
        ),
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


LM = """
import torch
from torch import nn


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.out = nn.Embedding(7, 4), nn.Linear(4, 7)

    def forward(self, ids):
        return self.out(torch.tanh(self.emb(ids)))
"""


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_rows_that_count_no_target_have_no_loss_and_rank_nowhere(tmp_path, reduction):
    """causal_lm rows whose every target after the first is ignore_index (all of row 2, all
    but the first of row 4) get a NaN loss, a zero gradient and finite false; the others are
    the loop's."""
    (tmp_path / "lm.py").write_text(LM)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 7, (6, 5), generator=g)
    labels = ids.clone()
    labels[2] = -100
    labels[4, 1:] = -100
    labels[0, 3:] = -100  # padding: the row still counts its first positions
    torch.save({"ids": ids, "labels": labels}, tmp_path / "data.pt")
    config = tmp_path / "config.yaml"
    config.write_text(
        "model: {factory: lm.py:LM}\n"
        "data: {path: data.pt, inputs: ids, targets: labels, batch_size: 4}\n"
        f"loss: {{name: causal_lm, token_reduction: {reduction}}}\ndevice: cpu\n"
        "output: {path: scores.parquet}\n"
    )
    result = runner.invoke(app, ["norms", str(config), "--by", "loss:low"])
    assert result.exit_code == 0, result.output
    frame = pd.read_parquet(tmp_path / "scores.parquet")
    empty = frame["example_id"].isin([2, 4]).to_numpy()
    assert frame.loc[empty, "loss"].isna().all() and (frame.loc[empty, "grad_norm"] == 0).all()
    assert frame["finite"].tolist() == [True, True, False, True, False, True]
    torch.manual_seed(0)  # the weights a run without checkpoint builds
    model = import_object(f"{tmp_path / 'lm.py'}:LM", "test")()
    loss = resolve_loss("causal_lm", token_reduction=reduction)
    expected_loss, expected_norm = reference_norms(model, (ids,), labels, loss)
    got = torch.tensor(frame["loss"].to_numpy())
    assert_rel_close(got[~empty], expected_loss[~empty], 1e-5)
    assert_rel_close(torch.tensor(frame["grad_norm"].to_numpy()), expected_norm, 1e-5)
    text = " ".join(result.output.split())
    assert "2 non-finite. 2 of them count no target (every target ignore_index)" in text
    lowest = text.split("lowest first")[1].split("robust_z = ")[0]  # the table's rows
    assert "│" in lowest and all(f" {i} │" not in lowest for i in (2, 4))


@pytest.mark.parametrize("per_ref", [False, True])
def test_a_reference_row_that_counts_no_target_is_refused(tmp_path, per_ref):
    """A REF row of no counted target has no loss: the mean over REF counted it, scaling every
    influence by the share it left out (3/4 in a probe), and --per-ref gave its pairs 0."""
    (tmp_path / "lm.py").write_text(LM)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 7, (6, 5), generator=g)
    ref = {"ids": ids[:4].clone(), "labels": ids[:4].clone()}
    ref["labels"][3, 1:] = -100  # a first token alone: nothing to predict
    torch.save({"ids": ids, "labels": ids.clone()}, tmp_path / "data.pt")
    torch.save(ref, tmp_path / "ref.pt")
    config = tmp_path / "config.yaml"
    config.write_text(
        "model: {factory: lm.py:LM}\n"
        "data: {path: data.pt, inputs: ids, targets: labels, batch_size: 2}\n"
        "loss: {name: causal_lm}\ndevice: cpu\noutput: {path: scores.parquet}\n"
    )
    args = ["influence", str(config), "--ref", str(tmp_path / "ref.pt"), "--curvature", "none"]
    line = one_error(runner.invoke(app, args + ["--per-ref"] * per_ref))
    assert "the reference's row 3 has no target to predict" in line and "ref.pt" in line


@pytest.mark.parametrize("batch_size", [1, 4])
def test_causal_lm_targets_of_the_inputs_column_pad_as_no_token(tmp_path, batch_size):
    """``targets: ids`` with ``data.pad: {ids: 0}`` (labels = input_ids): the targets pad with
    -100, not the input's 0, so a short row's loss counts its own tokens at any batch size
    (padded positions were scored as token 0: 6 of 8 rows off at batch 4)."""
    (tmp_path / "lm.py").write_text(LM)
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(1, 7, (n,), generator=g) for n in (3, 6, 2, 5, 6, 4, 2, 3)]
    pq.write_table(pa.table({"ids": [r.tolist() for r in rows]}), tmp_path / "lm.parquet")
    config = tmp_path / "config.yaml"
    config.write_text(
        "model: {factory: lm.py:LM}\n"
        f"data: {{path: lm.parquet, inputs: ids, targets: ids, pad: {{ids: 0}}, "
        f"batch_size: {batch_size}}}\n"
        "loss: {name: causal_lm}\ndevice: cpu\ndtype: float64\noutput: {path: scores.parquet}\n"
    )
    result = runner.invoke(app, ["norms", str(config)])
    assert result.exit_code == 0, result.output
    assert read_metadata(tmp_path / "scores.parquet")["config"]["data"]["pad_targets"] == -100
    torch.manual_seed(0)  # the weights a run without checkpoint builds
    model = import_object(f"{tmp_path / 'lm.py'}:LM", "test")().double()
    loss = resolve_loss("causal_lm")
    expected = [reference_norms(model, (r[None],), r[None], loss) for r in rows]
    frame = pd.read_parquet(tmp_path / "scores.parquet")
    assert_rel_close(
        torch.tensor(frame["loss"].to_numpy()), torch.cat([e[0] for e in expected]), 1e-10
    )
    norms = torch.cat([e[1] for e in expected])
    assert_rel_close(torch.tensor(frame["grad_norm"].to_numpy()), norms, 1e-10)


def test_a_class_label_that_is_ignore_index_has_no_loss(tmp_path):
    config = make_project(tmp_path, n=10)
    data = torch.load(tmp_path / "data.pt")
    data["y"][5] = -100
    torch.save(data, tmp_path / "data.pt")
    torch.save({"x": torch.randn(3, 5), "y": torch.randint(0, 3, (3,))}, tmp_path / "ref.pt")
    for command in (["norms"], ["influence", "--ref", str(tmp_path / "ref.pt")]):
        result = runner.invoke(app, [command[0], str(config), *command[1:]])
        assert result.exit_code == 0, result.output
        frame = pd.read_parquet(tmp_path / "scores.parquet")
        assert frame["finite"].tolist() == [True] * 5 + [False] + [True] * 4
        assert math.isnan(frame["loss"][5]) and frame["grad_norm"][5] == 0
        assert frame["loss"].drop(index=5).notna().all()
