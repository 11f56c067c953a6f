"""Hugging Face models through the CLI, each against the float64 loop run on every example alone
and unpadded: a pretrained folder, a class built from model.config, keyword inputs, a CSV by glob."""

from __future__ import annotations

import re

import pandas as pd
import pytest
import torch
import yaml
from oracle import assert_rel_close, reference_influence, reference_norms
from project import run_cli
from safetensors.torch import save_file
from torch import nn
from typer.testing import CliRunner

from gradscope.cli import app
from gradscope.config import ModelConfig
from gradscope.errors import ConfigError, ModelError
from gradscope.io.files import file_sha256
from gradscope.io.model import build_model
from gradscope.io.parquet import read_metadata

transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

runner = CliRunner()
GPT2 = {"vocab_size": 40, "n_positions": 16, "n_embd": 8, "n_layer": 1, "n_head": 2}
BERT = {
    "vocab_size": 30,
    "hidden_size": 8,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "intermediate_size": 16,
    "max_position_embeddings": 16,
    "num_labels": 3,
}


class Keywords(nn.Module):
    """The oracle's view of a model: tensors passed by keyword, the logits returned."""

    def __init__(self, model: nn.Module, names: list[str]):
        super().__init__()
        self.model, self.names = model, names

    def forward(self, *tensors: torch.Tensor) -> torch.Tensor:
        return self.model(**dict(zip(self.names, tensors, strict=True))).logits


def loop_each_alone(model, inputs, rows, targets, loss) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, grad_norm) per example, each run as a batch of one at its own length; ``inputs``
    maps forward arguments to columns of ``rows``."""
    out = []
    for row, target in zip(rows, targets, strict=True):
        tensors = tuple(torch.tensor([row[c]]) for c in inputs.values())
        out.append(reference_norms(Keywords(model, list(inputs)), tensors, target[None], loss))
    return torch.cat([o[0] for o in out]), torch.cat([o[1] for o in out])


def token_rows(n: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 9, (n,), generator=g).tolist()
    return [torch.randint(0, vocab, (t,), generator=g).tolist() for t in lengths]


def test_gpt2_pretrained_folder_on_save_to_disk_with_padding(tmp_path):
    model, ids = gpt2_folder_and_rows(tmp_path, 8)
    assert (tmp_path / "gpt2" / "model.safetensors.index.json").is_file()  # sharded
    rows = [{"input_ids": r, "attention_mask": [1] * len(r), "labels": r} for r in ids]
    inputs = {"input_ids": "input_ids", "attention_mask": "attention_mask"}
    frame = run_cli(
        tmp_path,
        {"factory": "transformers:GPT2LMHeadModel", "pretrained": "gpt2"},
        {
            "path": "ds",
            "inputs": inputs,
            "targets": "labels",
            "pad": {"input_ids": 0, "attention_mask": 0, "labels": -100},
        },
        "causal_lm",
    )
    targets = [torch.tensor(r) for r in ids]
    loss, norm = loop_each_alone(model, inputs, rows, targets, "causal_lm")
    one = torch.tensor([len(r) == 1 for r in ids])  # a row of one token counts no target:
    assert one.any() and frame["loss"][one.numpy()].isna().all()  # NaN, not a loss of 0
    assert_rel_close(torch.tensor(frame["loss"].to_numpy())[~one], loss[~one], 1e-9)
    assert_rel_close(torch.tensor(frame["grad_norm"].to_numpy()), norm, 1e-9)
    # the folder's weights are the checkpoint: hashed, and a change of any file changes the hash
    digest = read_metadata(tmp_path / "scores.parquet")["checkpoint_sha256"]
    assert digest == file_sha256(tmp_path / "gpt2")
    (tmp_path / "gpt2" / "config.json").write_text(
        (tmp_path / "gpt2" / "config.json").read_text() + " "
    )
    assert file_sha256(tmp_path / "gpt2") != digest


def gpt2_folder_and_rows(tmp_path, n: int) -> tuple[nn.Module, list[list[int]]]:
    """A GPT-2 saved with save_pretrained in shards, and n token rows saved with save_to_disk."""
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT2)).eval()
    model.save_pretrained(tmp_path / "gpt2", max_shard_size="4KB")
    ids = token_rows(n, GPT2["vocab_size"], 1)
    rows = [{"input_ids": r, "attention_mask": [1] * len(r), "labels": r} for r in ids]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"), num_shards=2)
    return model, ids


@pytest.mark.parametrize("engine", ["hooks", "auto"])
def test_gpt2_influence_with_a_save_to_disk_reference(tmp_path, engine):
    model, ids = gpt2_folder_and_rows(tmp_path, 7)
    ref_ids = token_rows(3, GPT2["vocab_size"], 9)
    ref_rows = [{"input_ids": r, "attention_mask": [1] * len(r), "labels": r} for r in ref_ids]
    datasets.Dataset.from_list(ref_rows).save_to_disk(str(tmp_path / "ref"))
    frame = run_cli(
        tmp_path,
        {"factory": "transformers:AutoModelForCausalLM", "pretrained": "gpt2"},
        {
            "path": "ds",
            "inputs": {"input_ids": "input_ids", "attention_mask": "attention_mask"},
            "targets": "labels",
            "pad": {"input_ids": 0, "attention_mask": 0, "labels": -100},
        },
        "causal_lm",
        "influence",
        "--ref",
        str(tmp_path / "ref"),
        "--engine",
        engine,
        "--curvature",
        "none",
    )

    def padded(rows: list[list[int]]) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        longest = max(map(len, rows))
        ids = torch.tensor([r + [0] * (longest - len(r)) for r in rows])
        mask = torch.tensor([[1] * len(r) + [0] * (longest - len(r)) for r in rows])
        return (ids, mask), ids.masked_fill(mask == 0, -100)

    expected, _, _ = reference_influence(
        Keywords(model, ["input_ids", "attention_mask"]), *padded(ids), padded(ref_ids), "causal_lm"
    )
    assert_rel_close(torch.tensor(frame["influence"].to_numpy()), expected[:, 0], 1e-9)


def test_bert_classifier_from_config_on_parquet_ragged_lists_by_keyword(tmp_path):
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(transformers.BertConfig(**BERT)).eval()
    save_file(model.state_dict(), tmp_path / "bert.safetensors")
    ids = token_rows(7, BERT["vocab_size"], 2)
    rows = [
        {"ids": r, "mask": [1] * len(r), "segment": [i % 2] * len(r), "label": i % 3}
        for i, r in enumerate(ids)
    ]
    pd.DataFrame(rows).to_parquet(tmp_path / "train.parquet", row_group_size=4)
    # by keyword, in an order that is not forward's: token_type_ids is its third argument
    inputs = {"token_type_ids": "segment", "input_ids": "ids", "attention_mask": "mask"}
    frame = run_cli(
        tmp_path,
        {
            "factory": "transformers:BertForSequenceClassification",
            "config": BERT,
            "checkpoint": "bert.safetensors",
        },
        {
            "path": "train.parquet",
            "inputs": inputs,
            "targets": "label",
            "pad": {"ids": 0, "mask": 0, "segment": 0},
        },
        "cross_entropy",
    )
    targets = [torch.tensor(r["label"]) for r in rows]
    loss, norm = loop_each_alone(model, inputs, rows, targets, "cross_entropy")
    assert_rel_close(torch.tensor(frame["loss"].to_numpy()), loss, 1e-9)
    assert_rel_close(torch.tensor(frame["grad_norm"].to_numpy()), norm, 1e-9)
    # check runs both engines and its own loop through the same keyword call: exit 1 on a mismatch
    result = runner.invoke(app, ["check", str(tmp_path / "config.yaml"), "--examples", "4"])
    assert result.exit_code == 0, result.output


def test_auto_class_from_config_loads_a_save_pretrained_checkpoint_with_tied_weights(tmp_path):
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT2)).eval()
    model.save_pretrained(tmp_path / "gpt2")  # writes transformer.wte.weight, not lm_head.weight
    ids = torch.randint(0, GPT2["vocab_size"], (5, 6))
    torch.save({"ids": ids}, tmp_path / "data.pt")
    frame = run_cli(
        tmp_path,
        {
            "factory": "transformers:AutoModelForCausalLM",
            "config": {"model_type": "gpt2", **GPT2},
            "checkpoint": "gpt2/model.safetensors",
        },
        {"path": "data.pt", "inputs": "ids", "targets": "ids"},
        "causal_lm",
    )
    loss, norm = reference_norms(Keywords(model, ["input_ids"]), (ids,), ids, "causal_lm")
    assert_rel_close(torch.tensor(frame["loss"].to_numpy()), loss, 1e-9)
    assert_rel_close(torch.tensor(frame["grad_norm"].to_numpy()), norm, 1e-9)


def test_csv_shards_and_feature_columns_by_glob(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(4, 3).double()
    torch.save(model.state_dict(), tmp_path / "linear.pt")
    g = torch.Generator().manual_seed(3)
    frame = pd.DataFrame(
        torch.randn(10, 4, generator=g).numpy(), columns=[f"f_{i}" for i in "abcd"]
    )
    frame["label"] = torch.randint(0, 3, (10,), generator=g).numpy()
    frame["noise"] = 5.0  # matched by no glob: not an input
    for n in range(3):
        frame.iloc[n * 4 : (n + 1) * 4].to_csv(tmp_path / f"part-{n}.csv", index=False)
    scores = run_cli(
        tmp_path,
        {
            "factory": "torch.nn:Linear",
            "kwargs": {"in_features": 4, "out_features": 3},
            "checkpoint": "linear.pt",
        },
        {"path": "part-*.csv", "inputs": "f_*", "targets": "label"},
        "cross_entropy",
    )
    x = torch.tensor(
        pd.concat(pd.read_csv(tmp_path / f"part-{n}.csv") for n in range(3))[
            ["f_a", "f_b", "f_c", "f_d"]
        ].to_numpy()
    )
    loss, norm = reference_norms(
        model, (x,), torch.tensor(frame["label"].to_numpy()), "cross_entropy"
    )
    assert_rel_close(torch.tensor(scores["loss"].to_numpy()), loss, 1e-9)
    assert_rel_close(torch.tensor(scores["grad_norm"].to_numpy()), norm, 1e-9)


def test_an_exception_in_the_forward_is_one_error_line(tmp_path):
    (tmp_path / "broken.py").write_text(
        "from torch import nn\n\n\n"
        "class SchemaError(Exception):\n"
        "    pass\n\n\n"
        "class Broken(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.fc = nn.Linear(5, 3)\n\n"
        "    def forward(self, x):\n"
        "        raise SchemaError('no such\\nfield')\n"
    )
    torch.save({"x": torch.randn(4, 5), "y": torch.tensor([0, 1, 2, 0])}, tmp_path / "d.pt")
    config = tmp_path / "c.yaml"
    raw = {"model": {"factory": "broken.py:Broken"}, "data": {"path": "d.pt", "targets": "y"}}
    config.write_text(yaml.safe_dump(raw))
    result = runner.invoke(app, ["norms", str(config), "--device", "cpu"])
    assert result.exit_code == 2
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.output
    assert result.stderr == (
        "error: the model cannot take inputs of shape (4, 5): Broken's forward raised "
        "SchemaError: no such field (data.inputs)\n"
    )


def test_api_takes_logits_by_default_and_names_output_in_errors():
    import gradscope

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT2)).double().eval()
    ids = torch.randint(0, GPT2["vocab_size"], (3, 5))
    norms = gradscope.per_example_norms(model, ids, ids, loss="causal_lm")
    _, expected = reference_norms(Keywords(model, ["input_ids"]), (ids,), ids, "causal_lm")
    assert_rel_close(norms, expected, 1e-9)
    # the keys are whatever this transformers version returns: never hard-code a library's
    keys = ", ".join(model(ids).keys())
    with pytest.raises(
        ModelError, match=re.escape(f"without key 'scores' (keys: {keys}) (output=)")
    ):
        gradscope.per_example_norms(model, ids, ids, loss="causal_lm", output="scores")
    # an integer picks by position, as ModelOutput's [0] does (it was read as a dict's key 0)
    by_position = gradscope.per_example_norms(model, ids, ids, loss="causal_lm", output=0)
    assert_rel_close(by_position, expected, 1e-9)


@pytest.mark.parametrize(
    ("model", "error", "message"),
    [
        (
            {"factory": "transformers:AutoModelForCausalLM", "config": {"n_embd": 8}},
            ConfigError,
            "model.config for AutoModelForCausalLM needs model_type",
        ),
        (
            {"factory": "torch.nn:Linear", "pretrained": "."},
            ConfigError,
            "model.pretrained needs a Hugging Face class as model.factory",
        ),
        (
            {"factory": "transformers:AutoModel", "pretrained": "."},
            ModelError,
            "not a save_pretrained folder: it has no config.json",
        ),
        (  # a folder not there read as one lacking config.json
            {"factory": "transformers:AutoModel", "pretrained": "nosuchdir"},
            ModelError,
            "model.pretrained folder not found",
        ),
        (
            {"factory": "transformers:GPT2LMHeadModel"},
            ConfigError,
            "a Hugging Face class needs model.config or model.pretrained",
        ),
    ],
)
def test_hf_model_keys_that_do_not_fit_are_named(tmp_path, model, error, message):
    with pytest.raises(error, match=message):
        build_model(ModelConfig(**model))


def test_a_resume_fingerprints_the_pretrained_folders_files(tmp_path):
    from gradscope.config import load_config
    from gradscope.inputs import run_inputs
    from gradscope.resume import fingerprint

    gpt2_folder_and_rows(tmp_path, 3)
    config = tmp_path / "c.yaml"
    raw = {
        "model": {"factory": "transformers:GPT2LMHeadModel", "pretrained": "gpt2"},
        "data": {"path": "ds", "inputs": "input_ids", "targets": "labels"},
    }
    config.write_text(yaml.safe_dump(raw))
    cfg = load_config(config)
    before = fingerprint(cfg, "norms", run_inputs(cfg), None)
    shard = sorted((tmp_path / "gpt2").glob("model-*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:-1] + b"\0")
    after = fingerprint(cfg, "norms", run_inputs(cfg), None)
    folder = str(tmp_path / "gpt2")
    assert before["files"][folder] != after["files"][folder]
    assert shard.name in before["files"][folder]
