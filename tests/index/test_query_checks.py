"""What a query checks before it scores: the model from --config only (no code from an index),
every key that changes the gradients, the rows --exact reads again, the factors' checkpoint; and
the cosine of a zero gradient, NaN and ranked last as ``influence`` has it."""

from __future__ import annotations

import math
import shutil

import numpy as np
import pytest
import torch
import yaml
from project import edit_config, edit_data, fails, load_net, made_by_code
from runs import N, close, index, loop, query, refused, run

from gradscope import job
from gradscope.curvature import load_preconditioner
from gradscope.engine import Engine
from gradscope.losses import resolve_loss


def test_a_query_runs_no_code_an_index_names(project, monkeypatch, capsys):
    """The index's own config names model.py:Net: a query without --config is refused before
    anything is imported."""
    model = project / "model.py"
    model.write_text(model.read_text() + "\nimport pathlib\npathlib.Path(__file__).with_name("
                     "'imported').touch()\n")  # fmt: skip
    ix = index(project, "--dim", 4)
    (project / "imported").unlink()
    err = fails(monkeypatch, capsys, "query", ix, "--ref", project / "ref.pt")
    assert "a query builds the model from --config only" in err
    assert not (project / "imported").exists()


def other_config(project, change) -> None:
    raw = yaml.safe_load((project / "config.yaml").read_text())
    change(raw)
    (project / "config.yaml").write_text(yaml.safe_dump(raw))


CHANGES = {
    "loss.kwargs": lambda c: c.setdefault("loss", {}).update(kwargs={"label_smoothing": 0.1}),
    "model.kwargs": lambda c: c["model"].update(kwargs={"hidden": 8}),
    "model.factory": lambda c: c["model"].update(factory="model.py:TupleNet", output=0),
    "loss.token_reduction": lambda c: c.setdefault("loss", {}).update(token_reduction="sum"),
    "data.pad_targets": lambda c: c["data"].update(pad_targets=-1),
}


def test_query_config_agrees_with_the_index_on_every_gradient_key(project, monkeypatch, capsys):
    ix = index(project, "--dim", 4)
    original = (project / "config.yaml").read_text()
    for key, change in CHANGES.items():
        other_config(project, change)
        err = refused(monkeypatch, capsys, project, ix)
        assert f"error: {key} is not what the index was built with" in err
        (project / "config.yaml").write_text(original)
    # the references at the checkpoints listed, the rows at the index's: refused as index does
    other_config(
        project, lambda c: c["model"].update(checkpoints=[{"path": c["model"].pop("checkpoint")}])
    )
    err = refused(monkeypatch, capsys, project, ix)
    assert "error: an index holds the gradients at one checkpoint" in err
    (project / "config.yaml").write_text(original)
    moved = project / "elsewhere"  # the same model from another folder: the same gradients
    moved.mkdir()
    for name in ("model.py", "net.pt", "data.pt", "config.yaml"):
        shutil.copy(project / name, moved / name)
    run("query", ix, "--ref", project / "ref.pt", "--config", moved / "config.yaml")


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_exact_refuses_rows_a_data_function_changed(project, monkeypatch, capsys, dtype):
    """data.path is a function: its rows' sha256 tells; where an index has none (built before
    it kept one), the re-read rows' losses tell (in float32 within 2%: example 3's loss moves by
    far more)."""
    (project / "gen.py").write_text(
        "import pathlib, torch\n\ndef make_dataset():\n"
        "    d = torch.load(pathlib.Path(__file__).with_name('data.pt'))\n"
        "    return {'x': d['x'], 'y': d['y']}\n"
    )
    other_config(
        project, lambda c: c.update(dtype=dtype, data={**c["data"], "path": "gen.py:make_dataset"})
    )
    ix = index(project, "--dim", 4)
    with monkeypatch.context() as before:  # an index built before the rows had a sha256
        before.setattr(job, "data_identity", lambda data: None)
        old = index(project, "--dim", 4, name="old")
    assert len(query(project, ix, "--exact", "--top-k", 3, "--candidates", 4)) == 3
    limited = index(project, "--dim", 4, "--limit", 6, name="limited")  # the rows it holds
    assert len(query(project, limited, "--exact", "--top-k", 3, "--candidates", 2)) == 3
    edit_data(project, lambda d: d["x"][3].mul_(2))
    for built, message in [
        (ix, "data.path has changed since the index was built (its sha256 differs)"),
        (old, "their losses are not the indexed ones: the data has changed"),
    ]:
        err = refused(monkeypatch, capsys, project, built, "--exact", "--top-k", 3,
                      "--candidates", 4)  # fmt: skip
        assert message in err


def test_the_cosine_of_a_zero_gradient_is_nan_and_ranked_last(project):
    """Example 2's target is ignored (-100): its loss and gradient are 0."""
    edit_data(project, lambda d: d["y"].__setitem__(2, -100))
    ix = index(project, "--storage", "float32")  # every number kept: the exact cosine
    grads, refs = loop(project)
    flat = torch.cat([g.flatten(1) for g in grads.values()], 1)  # (N, P)
    ref = torch.cat([r.mean(0).flatten() for r in refs.values()])  # (P,)
    assert flat[2].abs().max() == 0
    cosine = flat @ ref / (flat.norm(dim=1) * ref.norm())  # NaN at 2
    frame = query(project, ix, "--normalize", "--top-k", N)
    assert frame["example_id"].tolist()[-1] == 2 and math.isnan(frame["score"].iloc[-1])
    order = cosine.nan_to_num(-2).argsort(descending=True)  # (N,) example 2 last
    assert frame["example_id"].tolist() == order.tolist()
    every = query(project, ix, "--normalize")
    close(every["score"].drop(index=2), cosine.numpy()[np.arange(N) != 2], 1e-6)
    exact = query(project, ix, "--normalize", "--exact", "--top-k", N, "--candidates", 1)
    assert exact["example_id"].tolist()[-1] == 2 and math.isnan(exact["exact"].iloc[-1])


def preconditioned(project, factors) -> torch.Tensor:
    """(N,) the float64 loop's <g_i, P r>, P from the factors file, r the mean REF gradient."""
    net, _, _ = load_net(project)
    net.double()
    grads, refs = loop(project)
    with Engine(net, resolve_loss("cross_entropy")) as engine:
        pre = load_preconditioner(factors, engine)
    p_ref = pre.refs({n: r.mean(0, keepdim=True) for n, r in refs.items()})
    return sum((g.flatten(1) @ p_ref[n].flatten()) for n, g in grads.items())


def test_factors_from_the_indexed_checkpoint_precondition_the_query(project, monkeypatch, capsys):
    factors = project / "f.safetensors"
    run("factors", project / "config.yaml", "--out", factors, "--fisher", "empirical")
    expected = preconditioned(project, factors)
    whole = index(project, "--storage", "float32", name="whole")  # every number kept
    close(query(project, whole, "--precondition", factors)["score"], expected, 1e-6)
    small = index(project, "--dim", 4, name="small")
    frame = query(project, small, "--precondition", factors, "--exact", "--top-k", 3)
    close(frame["exact"], expected[frame["example_id"].to_numpy()], 1e-9)
    # factors of another checkpoint: refused, naming them
    state = torch.load(project / "net.pt")
    torch.save({k: v + 0.1 for k, v in state.items()}, project / "other.pt")
    other_config(project, lambda c: c["model"].update(checkpoint="other.pt"))
    elsewhere = project / "g.safetensors"
    run("factors", project / "config.yaml", "--out", elsewhere, "--fisher", "empirical")
    other_config(project, lambda c: c["model"].update(checkpoint="net.pt"))
    err = refused(monkeypatch, capsys, project, small, "--precondition", elsewhere)
    assert "the factors were computed at another checkpoint" in err and str(elsewhere) in err


def test_a_report_of_a_query_shows_only_the_indexed_rows(project, monkeypatch, capsys):
    """A query's file recorded no data_sha256: `report --config` showed any data's rows."""
    ix = index(project)
    query(project, ix)
    run("report", project / "q.parquet", "--by", "score", "--config", project / "config.yaml")
    edit_data(project, lambda d: d["x"].mul_(2))
    err = fails(monkeypatch, capsys, "report", project / "q.parquet", "--by", "score",
                "--config", project / "config.yaml")  # fmt: skip
    assert "the data changed since it was scored" in err
    # rows made by code, indexed with --limit: the query's file records the index's rows
    edit_config(project, lambda c: c["data"].update(path=made_by_code(project)))
    ix = index(project, "--limit", 6, name="six")
    query(project, ix)
    run("report", project / "q.parquet", "--by", "score", "--config", project / "config.yaml")
