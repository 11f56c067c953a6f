"""TracIn over a LoRA run: model.checkpoints lists peft adapter folders, each loaded in turn onto
the same base; every score against the float64 loop over base + that adapter."""

from __future__ import annotations

import pytest
import torch
import yaml
from oracle import assert_rel_close, reference_influence, reference_norms
from project import adapted, run_cli
from test_finetune import GPT2
from test_hf_models import Keywords as Logits
from typer.testing import CliRunner

from gradscope.cli import app
from gradscope.io.parquet import read_metadata

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

runner = CliRunner()
WEIGHTS = (0.5, 2.0)


def lora_run(tmp_path) -> list[torch.nn.Module]:
    """A tiny GPT-2 base saved to ``base/`` and two adapters of its LoRA run in ``step1/`` and
    ``step2/``; returns base + each adapter, as trained."""
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT2)).save_pretrained(tmp_path / "base")
    models = []
    for step in ("step1", "step2"):
        base = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "base")
        lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_proj"])
        lora.fan_in_fan_out = True  # GPT-2's Conv1D holds its weight transposed
        models.append(Logits(adapted(base, lora, tmp_path / step).eval(), ["input_ids"]))
    return models


MODEL = {
    "factory": "transformers:GPT2LMHeadModel",
    "pretrained": "base",
    "checkpoints": [
        {"path": "step1", "weight": WEIGHTS[0]},
        {"path": "step2", "weight": WEIGHTS[1]},
    ],
}


def test_tracin_influence_over_adapter_folders(tmp_path):
    models = lora_run(tmp_path)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, GPT2["vocab_size"], (5, 6), generator=g)
    ref = torch.randint(0, GPT2["vocab_size"], (3, 6), generator=g)
    torch.save({"ids": ids}, tmp_path / "data.pt")
    torch.save({"ids": ref}, tmp_path / "ref.pt")
    data = {"path": "data.pt", "inputs": "ids", "targets": "ids"}
    frame = run_cli(
        tmp_path,
        MODEL,
        data,
        "causal_lm",
        "influence",
        "--ref",
        str(tmp_path / "ref.pt"),
        "--curvature",
        "none",
    )
    each = [reference_influence(m, (ids,), ids, ((ref,), ref), "causal_lm") for m in models]
    expected = sum(w * infl[:, 0] for w, (infl, _, _) in zip(WEIGHTS, each, strict=True))
    assert (each[0][0] - each[1][0]).abs().max() > 0.1 * each[1][0].abs().max()  # two models
    assert_rel_close(torch.tensor(frame["influence"].to_numpy()), expected, 1e-9)
    for k, (_, norm, _) in enumerate(each):
        assert_rel_close(torch.tensor(frame[f"grad_norm@{k}"].to_numpy()), norm, 1e-9)
    assert_rel_close(torch.tensor(frame["grad_norm"].to_numpy()), each[1][1], 1e-9)
    meta = read_metadata(tmp_path / "scores.parquet")
    assert meta["adapter_sha256"] and all("lora_" in p["name"]
                                          for p in meta["plan"] if p["rule"] != "excluded")  # fmt: skip


def test_self_influence_over_adapter_folders(tmp_path):
    models = lora_run(tmp_path)
    ids = torch.randint(0, GPT2["vocab_size"], (7, 6), generator=torch.Generator().manual_seed(2))
    torch.save({"ids": ids}, tmp_path / "data.pt")
    data = {"path": "data.pt", "inputs": "ids", "targets": "ids"}
    frame = run_cli(tmp_path, MODEL, data, "causal_lm")
    norms = [reference_norms(m, (ids,), ids, "causal_lm", ["*lora_*"]) for m in models]
    for k, (loss, norm) in enumerate(norms):
        assert_rel_close(torch.tensor(frame[f"loss@{k}"].to_numpy()), loss, 1e-9)
        assert_rel_close(torch.tensor(frame[f"grad_norm@{k}"].to_numpy()), norm, 1e-9)
    expected = sum(w * n**2 for w, (_, n) in zip(WEIGHTS, norms, strict=True))
    assert_rel_close(torch.tensor(frame["self_influence"].to_numpy()), expected, 1e-9)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"adapter": "step1"}, "set model.adapter or adapter folders in model.checkpoints"),
        (
            {"checkpoints": [{"path": "step1"}, {"path": "base/model.safetensors"}]},
            "'model.checkpoints' mixes adapter folders and state dict files",
        ),
    ],
)
def test_adapter_checkpoints_refused_with_what_they_clash_with(tmp_path, change, message):
    for folder in ("base", "step1", "step2"):
        (tmp_path / folder).mkdir()
    (tmp_path / "base" / "model.safetensors").write_bytes(b"")
    torch.save({"ids": torch.zeros(2, 6, dtype=torch.int64)}, tmp_path / "data.pt")
    config = tmp_path / "config.yaml"
    data = {"path": "data.pt", "inputs": "ids", "targets": "ids"}
    config.write_text(yaml.safe_dump({"model": MODEL | change, "data": data, "device": "cpu"}))
    result = runner.invoke(app, ["norms", str(config)])
    assert result.exit_code == 2, result.output
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"error: {message}") and "config.yaml" in line, line
