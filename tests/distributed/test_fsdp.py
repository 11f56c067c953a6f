"""distributed.shard: fsdp under torchrun (2 CPU processes, gloo) writes the file one process
writes, for norms and influence; what a sharded pass cannot serve is refused by name."""

from __future__ import annotations

import os
import subprocess
import sys

import pandas as pd
import pytest
import torch
import yaml
from project import adapted

from gradscope.config import load_config
from gradscope.errors import ConfigError
from gradscope.fsdp import blocks
from gradscope.io.parquet import read_metadata
from gradscope.run import score_dataset
from gradscope.scorers import InfluenceScorer

transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

GPT2 = {"vocab_size": 40, "n_positions": 16, "n_embd": 8, "n_layer": 2, "n_head": 2}


def gpt2_project(tmp_path, n: int = 20, **distributed) -> tuple:
    """A GPT-2 save_pretrained folder, n ragged token rows (padded per batch, so the two ranks'
    batches differ in shape) and a config sharding it with FSDP."""
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT2)).save_pretrained(tmp_path / "gpt2")
    g = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(n):
        ids = torch.randint(0, GPT2["vocab_size"], (int(torch.randint(2, 9, (), generator=g)),))
        rows.append({"input_ids": ids.tolist(), "attention_mask": [1] * len(ids)})
        rows[-1]["labels"] = rows[-1]["input_ids"]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    datasets.Dataset.from_list(rows[:5]).save_to_disk(str(tmp_path / "ref"))
    raw = {
        "model": {"factory": "transformers:GPT2LMHeadModel", "pretrained": "gpt2"},
        "data": {
            "path": "ds",
            "inputs": {"input_ids": "input_ids", "attention_mask": "attention_mask"},
            "targets": "labels",
            "pad": {"input_ids": 0, "attention_mask": 0, "labels": -100},
            "batch_size": 3,
        },
        "loss": {"name": "causal_lm"},
        "device": "cpu",
        "dtype": "float64",
        "distributed": {"shard": "fsdp", **distributed},
        "output": {"path": "one.parquet"},
    }
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(raw, sort_keys=False))
    return config


def torchrun(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
         "-m", "gradscope", *args],
        env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def one_process(config, *scorer) -> pd.DataFrame:
    """The scores of one process, on one thread as torchrun runs each rank (OMP_NUM_THREADS=1):
    the same sums in the same order, so the files can be equal to the last bit."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return pd.read_parquet(score_dataset(load_config(config), *scorer))
    finally:
        torch.set_num_threads(threads)


def test_fsdp_norms_two_processes_equal_one(tmp_path):
    config = gpt2_project(tmp_path)  # 7 batches: rank 1 runs a last pass with nothing to score
    one = one_process(config)  # not sharded
    out = tmp_path / "two.parquet"
    run = torchrun("norms", str(config), "--out", str(out))
    assert run.returncode == 0, run.stderr[-3000:]
    pd.testing.assert_frame_equal(pd.read_parquet(out), one, check_exact=True)
    meta = read_metadata(out)
    assert meta["sharded"] == "fsdp: 2 blocks and the root over 2 ranks"
    assert {p["rule"] for p in meta["plan"]} <= {
        "embedding+linear",
        "embedding",
        "hf_conv1d",
        "layer_norm",
    }


def test_fsdp_influence_two_processes_equal_one(tmp_path):
    config = gpt2_project(tmp_path, n=14)
    ref = str(tmp_path / "ref")
    one = one_process(config, InfluenceScorer(ref, curvature="none"))
    out = tmp_path / "two.parquet"
    run = torchrun("influence", str(config), "--ref", ref, "--curvature", "none", "--out", str(out))
    assert run.returncode == 0, run.stderr[-3000:]
    # one process keeps the reference as each layer's factors where they cost less
    # (``rules/factored.py``), two keep it formed: the same sums in another order, 6e-16 apart
    pd.testing.assert_frame_equal(pd.read_parquet(out), one, check_exact=False, rtol=1e-12)


def test_blocks_are_the_models_no_split_modules_or_the_named_classes():
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT2))
    assert blocks(model) == list(model.transformer.h)
    assert [type(m).__name__ for m in blocks(model, ["GPT2MLP"])] == ["GPT2MLP", "GPT2MLP"]
    mlp = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ModuleList([torch.nn.Linear(2, 2)]))
    assert blocks(mlp) == [mlp[1][0]]


def test_fsdp_refuses_what_it_cannot_serve_by_name(tmp_path):
    config = gpt2_project(tmp_path)
    raw = yaml.safe_load(config.read_text())
    raw["distributed"]["shard"] = "zero3"
    config.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match="'distributed.shard' must be null or fsdp"):
        load_config(config)


def test_parameters_left_to_the_fallback_are_refused_before_sharding():
    from gradscope.engine import Engine
    from gradscope.fsdp import decide
    from gradscope.losses import resolve_loss

    class Squared(torch.nn.Module):
        """A raw matrix squared before use: no rule reads it."""

        def __init__(self):
            super().__init__()
            self.mix, self.head = torch.nn.Parameter(torch.eye(3)), torch.nn.Linear(3, 2)

        def forward(self, x):
            return self.head(x.mean(1) @ (self.mix * self.mix))

    engine = Engine(Squared(), resolve_loss("cross_entropy"))
    with pytest.raises(ConfigError, match=r"fsdp serves only parameters a layer rule serves; mix"):
        decide(engine, (torch.randn(4, 5, 3),), torch.tensor([0, 1, 0, 1]))


def test_fsdp_lora_adapters_two_processes_equal_one(tmp_path):
    peft = pytest.importorskip("peft")
    config = gpt2_project(tmp_path, n=11)
    base = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "gpt2")
    lora = peft.LoraConfig(r=4, target_modules=["c_attn", "c_proj"], fan_in_fan_out=True)
    adapted(base, lora, tmp_path / "lora")
    raw = yaml.safe_load(config.read_text())
    raw["model"]["adapter"] = "lora"  # a frozen base sharded with its adapters
    config.write_text(yaml.safe_dump(raw))
    one = one_process(config)
    out = tmp_path / "two.parquet"
    run = torchrun("norms", str(config), "--out", str(out))
    assert run.returncode == 0, run.stderr[-3000:]
    pd.testing.assert_frame_equal(pd.read_parquet(out), one, check_exact=True)
    included = [p for p in read_metadata(out)["plan"] if p["rule"] != "excluded"]
    assert len(included) == 12 and all("lora_" in p["name"] for p in included)


def test_fsdp_index_two_processes_equal_one(tmp_path):
    """A sharded model's index: each rank's rows as one process writes them, queried alike."""
    from gradscope.index.query import Query, run_query
    from gradscope.index.scorer import IndexScorer, index_output

    config = gpt2_project(tmp_path, n=11)
    cfg = index_output(load_config(config), str(tmp_path / "one"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        score_dataset(cfg, IndexScorer(dim=16))
    finally:
        torch.set_num_threads(threads)
    run = torchrun("index", str(config), "--dim", "16", "--out", str(tmp_path / "two"))
    assert run.returncode == 0, run.stderr[-3000:]
    ids = [pd.read_parquet(tmp_path / name / "ids.parquet") for name in ("one", "two")]
    pd.testing.assert_frame_equal(*ids, check_exact=True)
    asked = Query(str(tmp_path / "ref"), per_ref=True, top_k=11)
    one, two = (
        pd.read_parquet(run_query(tmp_path / n, asked, config=config)) for n in ("one", "two")
    )
    pd.testing.assert_frame_equal(one, two, check_exact=True)


def test_sharded_influence_refuses_the_default_curvature(tmp_path):
    """One process fits the curvature by default; a sharded run cannot: it says so, rather than
    score the plain inner product in its place."""
    scorer = InfluenceScorer(str(tmp_path / "ref"))
    with pytest.raises(ConfigError, match="pass --curvature none"):
        scorer._sharded(None, iter(()))
