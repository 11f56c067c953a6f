"""Config loading: defaults, path resolution, and every bad value named by its key path."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from gradscope.config import load_config, with_overrides
from gradscope.errors import ConfigError

BASE = """
model: {factory: model.py:Net, checkpoint: ckpt/net.pt}
data: {path: data.pt, inputs: x, targets: y}
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def test_defaults_and_relative_paths(tmp_path):
    cfg = load_config(write(tmp_path, BASE))
    assert cfg.model.factory == f"{tmp_path}/model.py:Net"
    assert cfg.model.checkpoint == f"{tmp_path}/ckpt/net.pt"
    assert cfg.data.path == f"{tmp_path}/data.pt"
    assert cfg.data.inputs == ["x"] and cfg.data.batch_size == 256
    assert cfg.loss.name == "cross_entropy" and cfg.loss.token_reduction == "mean"
    assert cfg.params.include is None and cfg.device == "auto"
    assert cfg.output.path == f"{tmp_path}/scores.parquet" and cfg.summary.top_k == 20


def test_report_keys(tmp_path):
    text = BASE.replace("targets: y", "targets: y, show: caption")
    cfg = load_config(write(tmp_path, text + "report: {tokenizer: tok, image_shape: [8, 8]}\n"))
    assert cfg.report.tokenizer == f"{tmp_path}/tok" and cfg.report.image_shape == [8, 8]
    assert cfg.data.show == "caption"
    default = load_config(write(tmp_path, BASE))
    assert default.report.tokenizer is None and default.data.show is None


def test_module_specs_are_not_paths(tmp_path):
    cfg = load_config(write(tmp_path, BASE.replace("model.py:Net", "torch.nn:Linear")))
    assert cfg.model.factory == "torch.nn:Linear"


def test_a_colon_in_a_path_is_the_paths(tmp_path):
    """A file under a folder named with a ':' (a run folder stamped 10:00) is read beside the
    config like any other: it was taken for a module spec and read from the working folder."""
    text = BASE.replace("ckpt/net.pt", "run-10:00/net.pt").replace("data.pt", "v:1/data.pt")
    cfg = load_config(write(tmp_path, text))
    assert cfg.model.checkpoint == f"{tmp_path}/run-10:00/net.pt"
    assert cfg.data.path == f"{tmp_path}/v:1/data.pt"


def test_overrides(tmp_path):
    cfg = with_overrides(
        load_config(write(tmp_path, BASE)),
        batch_size=7,
        limit=3,
        per_layer=True,
        top_k=5,
        device="cpu",
    )
    assert (
        cfg.data.batch_size,
        cfg.data.limit,
        cfg.output.per_layer,
        cfg.summary.top_k,
        cfg.device,
    ) == (7, 3, True, 5, "cpu")
    assert with_overrides(load_config(write(tmp_path, BASE)), device="cpu:0").device == "cpu:0"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("model: {factory: m.py:N}\n", "missing required key 'data'"),
        (BASE + "extra: 1\n", "unknown key 'extra'"),
        (BASE.replace("inputs: x", "inputs: x, colour: red"), "unknown key 'data.colour'"),
        (BASE + "loss: {name: hinge}\n", "'loss.name' must be one of"),
        (
            BASE.replace("targets: y", "targets: y, batch_size: many"),
            "'data.batch_size' must be an integer",
        ),
        (
            BASE.replace("targets: y", "targets: y, batch_size: 0"),
            "'data.batch_size' must be at least 1",
        ),
        (BASE.replace("inputs: x", "inputs: [[]]"), "each a column"),  # a TypeError before
        (BASE.replace("inputs: x", "inputs: {x: []}"), "each a column"),
        (BASE + "device: tpu\n", "'device' must be one of"),
        (BASE + "dtype: float8\n", "'dtype' must be one of"),
        (BASE + "params: {include: 3}\n", "'params.include' must be a list of strings"),
        (BASE + "output: [1]\n", "output must be a mapping"),
        (BASE + "loss: {token_reduction: max}\n", "'loss.token_reduction' must be mean or sum"),
        ("model: {factory: [\n", "malformed YAML"),
        (
            BASE + "report: {image_shape: [64]}\n",
            "'report.image_shape' must be .H, W. or .C, H, W. of positive",
        ),
        (BASE + "report: {image_shape: 64}\n", "'report.image_shape' must be a list of integers"),
        (
            BASE + "distributed: {join_timeout: 0}\n",
            "'distributed.join_timeout' must be a positive number of seconds, got 0",
        ),
    ],
)
def test_bad_values_name_their_key(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")) as info:
        load_config(write(tmp_path, text))
    assert "c.yaml" in str(info.value)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")


def test_causal_lm_targets_of_an_input_pad_with_no_token_only_where_they_pad(tmp_path):
    """pad_targets -100 where the targets' column pads as an input; unset where it does not,
    so the truths and records of unpadded LMs made before the key stand."""
    # token-level cross_entropy and nll too: a padded position was class 0 to them, counted
    for loss, pad, expected in (("causal_lm", {"ids": 0}, -100), ("causal_lm", {}, None),
                                ("cross_entropy", {"ids": 0}, -100), ("nll", {"ids": 0}, -100),
                                ("mse", {"ids": 0}, None)):  # fmt: skip
        data = {"path": "d.pt", "inputs": "ids", "targets": "ids", "pad": pad}
        (tmp_path / "c.yaml").write_text(yaml.safe_dump({"model": {"factory": "m.py:M"},
                                                         "data": data, "loss": {"name": loss}}))  # fmt: skip
        assert load_config(tmp_path / "c.yaml").data.pad_targets == expected, loss
