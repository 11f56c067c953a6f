"""`gradscope factors`, and `--precondition` with its file on norms and influence, end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import torch
from project import fails, load_net, make_project
from typer.testing import CliRunner

import gradscope
from gradscope.cli import app
from gradscope.curvature import Factors, load_preconditioner
from gradscope.engine import Engine, naive_grads
from gradscope.errors import ModelError
from gradscope.io.parquet import read_metadata
from gradscope.losses import resolve_loss

N = 10


@pytest.fixture(autouse=True)
def whole_biases(monkeypatch) -> None:
    """The project's biases (8 and 3 numbers) get whole blocks, its weights (40, 24) K-FAC:
    both kinds in one file."""
    monkeypatch.setattr("gradscope.curvature.factors.FULL_ELEMENTS", 8)


def _invoke(*args) -> str:
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return result.output


@pytest.mark.parametrize("ekfac", [False, True], ids=["kfac", "ekfac"])
def test_factors_then_precondition(tmp_path: Path, ekfac: bool) -> None:
    cfg = make_project(tmp_path, n=N)
    torch.save({"x": torch.randn(3, 5), "y": torch.randint(0, 3, (3,))}, tmp_path / "ref.pt")
    factors = tmp_path / "f.safetensors"
    flags = ["--ekfac"] if ekfac else []
    output = _invoke("factors", cfg, "--out", factors, "--fisher", "empirical", *flags)
    kind = "ekfac" if ekfac else "kfac"
    assert f"{N} examples, empirical Fisher; 2 {kind}, 2 full" in output
    made = Factors.load(factors)
    assert made.meta["model"]["checkpoint_sha256"] and made.meta["examples"] == N

    out = tmp_path / "norms.parquet"
    _invoke("norms", cfg, "--precondition", factors, "--out", out)
    frame = pd.read_parquet(out)
    # the definition, with the preconditioner read back from the file
    net, x, y = load_net(tmp_path)
    net = net.double()
    loss = resolve_loss("cross_entropy")
    engine = Engine(net, loss)
    pre = load_preconditioner(factors, engine)
    names = [n for n, _ in net.named_parameters()]
    with engine:
        _, grads = naive_grads(net, (x.double(),), y, loss, names)
    expected = 0
    for n in names:
        g = grads[n].flatten(1)  # (B, P)
        pg = torch.stack([pre.refs({n: grads[n][i : i + 1]})[n].flatten() for i in range(N)])
        expected = expected + (g * pg).sum(1)
    torch.testing.assert_close(
        torch.tensor(frame["self_influence"].to_numpy()), expected, rtol=1e-4, atol=1e-6
    )
    meta = read_metadata(out)["precondition"]
    assert meta["kind"] == kind and meta["fisher"] == "empirical" and meta["sha256"]
    assert meta["parameters"] == {
        "fc1.weight": kind, "fc1.bias": "full", "fc2.weight": kind, "fc2.bias": "full"
    }  # fmt: skip

    out = tmp_path / "influence.parquet"
    _invoke("influence", cfg, "--ref", tmp_path / "ref.pt", "--precondition", factors, "--out", out)
    assert read_metadata(out)["influence"]["precondition"]["kind"] == kind
    net, x, y = load_net(tmp_path)  # the Python API takes the file too, on either engine
    ref = torch.load(tmp_path / "ref.pt")
    for engine in ("hooks", "jvp"):
        api = gradscope.per_example_influence(
            net, x, y, ref["x"], ref["y"], precondition=str(factors), engine=engine
        )
        torch.testing.assert_close(
            api.double(),
            torch.tensor(pd.read_parquet(out)["influence"].to_numpy()),
            rtol=1e-4,  # float32, by two routes (the CLI's pass forms norms beside)
            atol=1e-6,
        )


def test_adam_norms(tmp_path: Path) -> None:
    cfg = make_project(tmp_path, n=N)
    model, _, _ = load_net(tmp_path)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(5, 5)).sum().backward()
    opt.step()
    torch.save(opt.state_dict(), tmp_path / "adam.pt")
    out = tmp_path / "norms.parquet"
    _invoke("norms", cfg, "--precondition", tmp_path / "adam.pt", "--out", out)
    assert read_metadata(out)["precondition"]["kind"] == "adam"
    assert (pd.read_parquet(out)["self_influence"] > 0).all()  # values: test_curvature.py


def test_user_errors_exit_2(tmp_path: Path, monkeypatch, capsys) -> None:
    cfg = make_project(tmp_path, n=N)
    factors = tmp_path / "f.safetensors"
    assert "--fisher must be true or empirical" in fails(
        monkeypatch, capsys, "factors", cfg, "--out", factors, "--fisher", "fake"
    )
    assert "output path is the run's" in fails(
        monkeypatch, capsys, "factors", cfg, "--out", tmp_path / "net.pt"
    )
    _invoke("factors", cfg, "--out", factors)
    other = make_project(tmp_path, n=N, params__exclude=["fc2.*"])
    err = fails(monkeypatch, capsys, "norms", other, "--precondition", factors)
    assert "the factors do not fit the selected parameters (only in the factors: fc2" in err
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(2)}, tmp_path / "weights.safetensors")  # neither kind
    err = fails(
        monkeypatch, capsys, "norms", cfg, "--precondition", tmp_path / "weights.safetensors"
    )
    assert "not an optimizer state_dict" in err
    net, _, _ = load_net(tmp_path)
    torch.save({k: v + 1 for k, v in net.state_dict().items()}, tmp_path / "net2.pt")
    cfg = make_project(tmp_path, n=N, model__checkpoint="net2.pt")
    err = fails(monkeypatch, capsys, "norms", cfg, "--precondition", factors)
    assert "computed at another checkpoint" in err
    # factors at the factory's initial weights (no checkpoint) fit no checkpoint's model, nor
    # the reverse: both were taken for unknown before (scores off by far more than they are)
    cfg = make_project(tmp_path, n=N, model__checkpoint=None)
    _invoke("factors", cfg, "--out", tmp_path / "init.safetensors")
    err = fails(monkeypatch, capsys, "norms", cfg, "--precondition", factors)
    assert "computed at a checkpoint; this config names none" in err
    cfg = make_project(tmp_path, n=N)
    err = fails(monkeypatch, capsys, "norms", cfg, "--precondition", tmp_path / "init.safetensors")
    assert "computed at no checkpoint they record" in err


def _header(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    size = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8 : 8 + size]), raw[8 + size :]


def _rewrite(path: Path, header: dict, body: bytes) -> None:
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + body)


def _meta(edit):
    def spoil(path: Path) -> None:
        header, body = _header(path)
        header["__metadata__"]["gradscope"] = edit(header["__metadata__"]["gradscope"])
        _rewrite(path, header, body)

    return spoil


def _tensors(edit):
    def spoil(path: Path) -> None:
        from safetensors.torch import load_file, save_file

        header, _ = _header(path)
        tensors = load_file(path)
        edit(tensors)
        save_file(tensors, path, metadata=header["__metadata__"])

    return spoil


def _blocks(edit):
    return _meta(lambda text: json.dumps(edit(json.loads(text))))


# (id, how the file is damaged, what the error line says)
DAMAGED = [
    ("cut-short", lambda p: p.write_bytes(p.read_bytes()[:-100]), "it does not read as safetensors"),
    ("metadata-not-json", _meta(lambda text: text[:-5]), "its metadata is not JSON"),
    ("no-blocks", _blocks(lambda m: {k: v for k, v in m.items() if k != "blocks"}), "its metadata lists no blocks"),
    ("a-tensor-missing", _tensors(lambda t: t.pop("fc1.weight/A_eigenvectors")), "tensor fc1.weight/A_eigenvectors is missing"),
    ("a-factor-of-another-shape", _tensors(lambda t: t.update({"fc1.weight/A": torch.eye(3)[None].double()})), "factors of 1 x 8 x 3 do not cover block fc1.weight's shape (8, 5)"),
    ("a-full-block-of-another-shape", _tensors(lambda t: t.update({"fc1.bias/F": torch.eye(5).double()})), "tensor fc1.bias/F is (5, 5) torch.float64, its block needs (8, 8) floats"),
    ("a-diagonal-of-another-shape", lambda p: (_tensors(lambda t: t.update({"fc1.bias/diagonal": torch.ones(5).double()}))(p), _blocks(lambda m: {**m, "blocks": {**m["blocks"], "fc1.bias": {**m["blocks"]["fc1.bias"], "kind": "diagonal", "damping": {"diagonal": 1.0}}}})(p)), "tensor fc1.bias/diagonal is (5,) torch.float64, its block needs (8,) floats"),
    ("eigenvectors-of-another-shape", _tensors(lambda t: t.update({"fc2.weight/S_eigenvectors": torch.eye(2)[None].double()})), "tensor fc2.weight/S_eigenvectors is (1, 2, 2) torch.float64, its block needs (1, 3, 3) floats"),
    ("a-nan", _tensors(lambda t: t["fc2.bias/F_eigenvalues"].__setitem__(1, float("nan"))), "tensor fc2.bias/F_eigenvalues holds NaN or infinite values"),
    ("a-kind-unknown", _blocks(lambda m: {**m, "blocks": {**m["blocks"], "fc1.bias": {**m["blocks"]["fc1.bias"], "kind": "other"}}}), "the metadata of block fc1.bias is not a kind, shape and damping"),
    ("a-factor-rescaled", _tensors(lambda t: t["fc1.weight/A"].mul_(10)), "its tensors or metadata are not what gradscope wrote (sha256)"),
    ("a-damping-edited", _blocks(lambda m: {**m, "blocks": {**m["blocks"], "fc2.weight": {**m["blocks"]["fc2.weight"], "damping": {"A": 100.0, "S": 1.0}}}}), "its tensors or metadata are not what gradscope wrote (sha256)"),
    ("a-factor-swapped", _tensors(lambda t: t.update({k + s: t[k.replace("A", "S") + s] if "A" in k else t[k.replace("S", "A") + s] for k in ("fc1.weight/A", "fc1.weight/S") for s in ("", "_eigenvalues", "_eigenvectors")})), "factors of 1 x 5 x 8 do not cover block fc1.weight's shape (8, 5)"),
    ("no-sha256", _blocks(lambda m: {k: v for k, v in m.items() if k != "sha256"}), "it holds no sha256 (written by an older gradscope)"),
    ("damping-missing", _blocks(lambda m: {**m, "blocks": {**m["blocks"], "fc2.weight": {**m["blocks"]["fc2.weight"], "damping": {"A": 1.0}}}}), "block fc2.weight has no positive damping S"),
]  # fmt: skip


@pytest.mark.parametrize(("spoil", "message"), [pytest.param(*c[1:], id=c[0]) for c in DAMAGED])
def test_a_damaged_factors_file_is_one_line(tmp_path: Path, monkeypatch, capsys, spoil, message):
    cfg = make_project(tmp_path, n=N)
    factors = tmp_path / "f.safetensors"
    _invoke("factors", cfg, "--out", factors, "--fisher", "empirical")
    spoil(factors)
    torch.save({"x": torch.randn(3, 5), "y": torch.randint(0, 3, (3,))}, tmp_path / "ref.pt")
    for command in (["norms"], ["influence", "--ref", tmp_path / "ref.pt"]):
        err = fails(monkeypatch, capsys, command[0], cfg, *command[1:], "--precondition", factors)
        assert err.startswith(f"error: the factors file is damaged: {message}"), err
        assert err.endswith(f"; run gradscope factors again ({factors})\n"), err


@pytest.mark.parametrize("ekfac", [False, True], ids=["kfac", "ekfac"])
@pytest.mark.parametrize("fisher", ["empirical", "true"])
def test_examples_with_a_nan_loss_are_left_out_and_said(tmp_path: Path, fisher, ekfac) -> None:
    """The empirical factors of the data with two NaN rows put in are those of the data
    without them; the true Fisher's draws differ with the batches, so only finite there."""
    cfg = make_project(tmp_path, n=N)
    flags = ["--fisher", fisher, *(["--ekfac"] if ekfac else [])]
    clean = tmp_path / "clean.safetensors"
    _invoke("factors", cfg, "--out", clean, *flags)
    data = torch.load(tmp_path / "data.pt")
    nan = torch.full((1, 5), float("nan"))
    x = torch.cat([data["x"][:1], nan, data["x"][1:6], nan, data["x"][6:]])
    y = torch.cat([data["y"][:1], data["y"][:1], data["y"][1:6], data["y"][:1], data["y"][6:]])
    torch.save({"x": x, "y": y}, tmp_path / "data.pt")
    out = tmp_path / "f.safetensors"
    output = _invoke("factors", cfg, "--out", out, *flags)
    assert f"{N} examples (2 left out: a NaN or infinite loss or gradient), {fisher}" in output
    made, expected = Factors.load(out), Factors.load(clean)  # load refuses NaN blocks
    assert made.meta["examples"] == N and made.meta["left_out"] == 2
    if fisher == "empirical":
        for name, block in expected.blocks.items():
            for key, t in block.tensors.items():
                if "eigenvectors" not in key:  # their signs are eigh's to choose
                    got = made.blocks[name].tensors[key]  # the model runs in float32
                    torch.testing.assert_close(got, t, rtol=1e-5, atol=1e-6, msg=key)


def test_factors_of_other_weights_or_settings_are_refused(tmp_path: Path, monkeypatch, capsys):
    """The same checkpoint file read under another key, the factory or loss set otherwise, and
    the API's model at other weights: each scored with the wrong curvature before."""
    state = torch.load(make_project(tmp_path, n=N).parent / "net.pt")
    torch.save({"ema": state, "model": {k: v + 1 for k, v in state.items()}}, tmp_path / "two.pt")
    made = make_project(tmp_path, n=N, model__checkpoint="two.pt", model__state_dict_key="ema")
    factors = tmp_path / "f.safetensors"
    _invoke("factors", made, "--out", factors)
    other = make_project(tmp_path, n=N, model__checkpoint="two.pt", model__state_dict_key="model")
    err = fails(monkeypatch, capsys, "norms", other, "--precondition", factors)
    assert "computed with another model.state_dict_key" in err
    factors = tmp_path / "g.safetensors"
    _invoke("factors", make_project(tmp_path, n=N), "--out", factors)
    for key, value in (("loss", {"name": "cross_entropy", "kwargs": {"label_smoothing": 0.5}}),
                       ("model", {"factory": "other.py:Other", "checkpoint": "net.pt"})):  # fmt: skip
        changed = make_project(tmp_path, n=N, **{key: value})
        text = (tmp_path / "model.py").read_text()
        (tmp_path / "other.py").write_text(text.replace("Net", "Other"))
        err = fails(monkeypatch, capsys, "norms", changed, "--precondition", factors)
        assert f"computed with another {key}." in err, err
    net, x, y = load_net(tmp_path)
    kept = net.fc1.weight.detach().clone()
    with torch.no_grad():
        net.fc1.weight += 1
    with pytest.raises(ModelError, match="computed at other weights"):
        gradscope.per_example_influence(net, x, y, x[:2], y[:2], precondition=factors)
    with pytest.raises(ModelError, match="computed at other weights"):
        gradscope.per_example_influence(net, x, y, x[:2], y[:2], precondition=Factors.load(factors))
    with torch.no_grad():
        net.fc1.weight.copy_(kept)
    gradscope.per_example_influence(net, x, y, x[:2], y[:2], precondition=factors)


def test_metadata_with_int_keys_reads_back(tmp_path: Path) -> None:
    """A model.config with int keys (a Hugging Face config's id2label, from the API): the
    sha256 was taken over int keys at save and string keys at load, refusing gradscope's own
    file, and mixed keys could not be saved at all."""
    _invoke("factors", make_project(tmp_path, n=N), "--out", tmp_path / "f.safetensors")
    factors = Factors.load(tmp_path / "f.safetensors")
    factors.meta["labels"] = {2: "two", 10: "ten", "other": 1}
    factors.save(tmp_path / "g.safetensors")
    assert Factors.load(tmp_path / "g.safetensors").meta["labels"] == {
        "2": "two", "10": "ten", "other": 1
    }  # fmt: skip
