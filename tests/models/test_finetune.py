"""Fine-tuned models: the parameters that require grad are scored by default, peft adapters
loaded from a folder (model.adapter), half precision from the config; each against the float64
per-example loop."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import yaml
from oracle import assert_rel_close, reference_influence, reference_norms
from project import LFS, Marker, adapted, run_cli
from test_hf_models import BERT
from test_hf_models import Keywords as Logits
from torch import nn
from typer.testing import CliRunner

import gradscope
from gradscope.cli import app
from gradscope.engine import Engine, build_plan, naive_grads
from gradscope.errors import ConfigError
from gradscope.io.parquet import read_metadata
from gradscope.losses import resolve_loss
from gradscope.rules.base import rows

runner = CliRunner()


def frozen_mlp() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """A float64 MLP whose first layer is frozen, and a batch for it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    model[0].requires_grad_(False)
    return model, torch.randn(5, 6, dtype=torch.float64), torch.randint(0, 3, (5,))


def test_the_parameters_that_require_grad_by_default():
    model, x, y = frozen_mlp()
    plan = build_plan(model)
    assert plan.selection == "trainable"
    assert [p.name for p in plan.included] == ["2.weight", "2.bias"]
    got = gradscope.per_example_norms(model, x, y)
    _, expected = reference_norms(model, (x,), y, "cross_entropy", include=["2.*"])
    assert_rel_close(got, expected, 1e-9)
    # the frozen layer's flags are read before the engine flips them, and restored after
    assert [p.requires_grad for p in model.parameters()] == [False, False, True, True]
    assert build_plan(model).selection == "trainable"


def test_all_parameters_when_none_requires_grad():
    model, x, y = frozen_mlp()
    model.requires_grad_(False)  # loaded for inference
    plan = build_plan(model)
    assert plan.selection == "all" and len(plan.included) == 4
    got = gradscope.per_example_norms(model, x, y)
    _, expected = reference_norms(model, (x,), y, "cross_entropy", include=["*"])
    assert_rel_close(got, expected, 1e-9)
    assert not any(p.requires_grad for p in model.parameters())


def test_include_picks_frozen_parameters_too():
    model, x, y = frozen_mlp()
    plan = build_plan(model, ["0.*"])
    assert plan.selection == "include" and [p.name for p in plan.included] == ["0.weight", "0.bias"]
    got = gradscope.per_example_norms(model, x, y, include=["*"], exclude=["2.bias"])
    model.requires_grad_(True)
    _, expected = reference_norms(
        model, (x,), y, "cross_entropy", include=["*"], exclude=["2.bias"]
    )
    assert_rel_close(got, expected, 1e-9)


def test_influence_over_the_trainable_parameters():
    model, x, y = frozen_mlp()
    ref = (torch.randn(3, 6, dtype=torch.float64),), torch.randint(0, 3, (3,))
    got = gradscope.per_example_influence(model, x, y, *ref)
    expected, _, _ = reference_influence(model, (x,), y, ref, "cross_entropy", exclude=("0.*",))
    assert_rel_close(got, expected[:, 0], 1e-9)


def test_exclude_that_leaves_no_trainable_parameter_is_named():
    model, _, _ = frozen_mlp()
    with pytest.raises(ConfigError, match="leaves none of the parameters that require grad"):
        Engine(model, resolve_loss("cross_entropy"), exclude=["2.*"])


@pytest.mark.parametrize("key", ["include", "exclude"])
def test_a_pattern_that_matches_no_parameter_is_named(key):
    """A typo in one of two patterns ('nett.2.*' for '2.*'): that layer was left out, or kept,
    silently; only a selection of nothing at all was refused."""
    model, _, _ = frozen_mlp()
    patterns = {"include": ["0.*", "20.*"]} if key == "include" else {"exclude": ["20.*"]}
    with pytest.raises(ConfigError, match=rf"params.{key} pattern '20.\*' matches no parameter"):
        Engine(model, resolve_loss("cross_entropy"), **patterns)


# -- model.adapter: a peft adapter folder on a save_pretrained base ---------------------------

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

GPT2 = {"vocab_size": 40, "n_positions": 16, "n_embd": 8, "n_layer": 2, "n_head": 2}


def lora_folders(tmp_path, kind: str) -> nn.Module:
    """A tiny base saved to ``base/`` and a LoRA adapter (B drawn at random, as after training)
    saved to ``lora/``; returns the peft model as trained."""
    torch.manual_seed(0)
    if kind == "gpt2":
        base = transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT2))
        lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_proj"])
        lora.fan_in_fan_out = True  # GPT-2's Conv1D holds its weight transposed
    else:
        base = transformers.BertForSequenceClassification(transformers.BertConfig(**BERT))
        # a classification head is trained whole beside the adapters (modules_to_save)
        lora = peft.LoraConfig(r=4, target_modules=["query", "value"], task_type="SEQ_CLS")
    base.save_pretrained(tmp_path / "base")
    return adapted(base, lora, tmp_path / "lora").eval()


def test_lora_gpt2_from_an_adapter_folder_scores_its_adapters(tmp_path):
    trained = lora_folders(tmp_path, "gpt2")
    ids = torch.randint(0, GPT2["vocab_size"], (7, 6))
    torch.save({"ids": ids}, tmp_path / "data.pt")
    model = {"factory": "transformers:GPT2LMHeadModel", "pretrained": "base", "adapter": "lora"}
    frame = run_cli(
        tmp_path, model, {"path": "data.pt", "inputs": "ids", "targets": "ids"}, "causal_lm"
    )
    loss, norm = reference_norms(
        Logits(trained, ["input_ids"]), (ids,), ids, "causal_lm", ["*lora_*"]
    )
    assert_rel_close(torch.tensor(frame["loss"].to_numpy()), loss, 1e-9)
    assert_rel_close(torch.tensor(frame["grad_norm"].to_numpy()), norm, 1e-9)
    meta = read_metadata(tmp_path / "scores.parquet")
    assert meta["params"]["selection"] == "trainable"
    included = [p for p in meta["plan"] if p["rule"] != "excluded"]
    assert len(included) == 12 and all("lora_" in p["name"] for p in included)
    assert {p["rule"] for p in included} == {"linear"}  # A and B are Linear calls: no fallback
    assert meta["adapter_sha256"]
    # the whole model, frozen base included, when asked for by name
    _, whole = reference_norms(Logits(trained, ["input_ids"]), (ids,), ids, "causal_lm", ["*"])
    assert (whole > 2 * norm).all()


def test_lora_gpt2_influence_over_the_adapters(tmp_path):
    trained = lora_folders(tmp_path, "gpt2")
    ids = torch.randint(0, GPT2["vocab_size"], (5, 6))
    ref = torch.randint(0, GPT2["vocab_size"], (3, 6))
    torch.save({"ids": ids}, tmp_path / "data.pt")
    torch.save({"ids": ref}, tmp_path / "ref.pt")
    model = {"factory": "transformers:GPT2LMHeadModel", "pretrained": "base", "adapter": "lora"}
    data = {"path": "data.pt", "inputs": "ids", "targets": "ids"}
    frame = run_cli(
        tmp_path,
        model,
        data,
        "causal_lm",
        "influence",
        "--ref",
        str(tmp_path / "ref.pt"),
        "--curvature",
        "none",
    )
    wrapped = Logits(trained, ["input_ids"])
    expected, norm, _ = reference_influence(wrapped, (ids,), ids, ((ref,), ref), "causal_lm")
    assert_rel_close(torch.tensor(frame["influence"].to_numpy()), expected[:, 0], 1e-9)
    assert_rel_close(torch.tensor(frame["grad_norm"].to_numpy()), norm, 1e-9)


def test_lora_bert_classifier_scores_adapters_and_its_trained_head(tmp_path):
    trained = lora_folders(tmp_path, "bert")
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, BERT["vocab_size"], (7, 6), generator=g)
    mask = torch.ones_like(ids)
    mask[:3, 4:] = 0
    label = torch.randint(0, 3, (7,), generator=g)
    torch.save({"ids": ids, "mask": mask, "label": label}, tmp_path / "data.pt")
    model = {
        "factory": "transformers:BertForSequenceClassification",
        "pretrained": "base",
        "adapter": "lora",
    }
    inputs = {"input_ids": "ids", "attention_mask": "mask"}
    data = {"path": "data.pt", "inputs": inputs, "targets": "label"}
    frame = run_cli(tmp_path, model, data, "cross_entropy")
    selected = ["*lora_*", "*modules_to_save*"]
    wrapped = Logits(trained, list(inputs))
    loss, norm = reference_norms(wrapped, (ids, mask), label, "cross_entropy", selected)
    assert_rel_close(torch.tensor(frame["loss"].to_numpy()), loss, 1e-9)
    assert_rel_close(torch.tensor(frame["grad_norm"].to_numpy()), norm, 1e-9)
    included = [
        p for p in read_metadata(tmp_path / "scores.parquet")["plan"] if p["rule"] != "excluded"
    ]
    assert len(included) == 6 and {p["rule"] for p in included} == {"linear"}
    # check compares both engines with its own loop over the adapters: exit 1 on a mismatch
    result = runner.invoke(app, ["check", str(tmp_path / "config.yaml"), "--examples", "4"])
    assert result.exit_code == 0, result.output


def test_factors_of_one_adapter_are_refused_for_another(tmp_path):
    lora_folders(tmp_path, "gpt2")
    torch.manual_seed(1)  # a second adapter of the same shapes, trained otherwise
    base = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "base")
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_proj"])
    lora.fan_in_fan_out = True
    adapted(base, lora, tmp_path / "lora2")
    ids = torch.randint(0, GPT2["vocab_size"], (5, 6))
    torch.save({"ids": ids}, tmp_path / "data.pt")
    data = {"path": "data.pt", "inputs": "ids", "targets": "ids"}
    model = {"factory": "transformers:GPT2LMHeadModel", "pretrained": "base", "adapter": "lora"}
    run_cli(tmp_path, model, data, "causal_lm")  # writes config.yaml
    config, factors = tmp_path / "config.yaml", str(tmp_path / "f.safetensors")
    assert runner.invoke(app, ["factors", str(config), "--out", factors]).exit_code == 0
    assert runner.invoke(app, ["norms", str(config), "--precondition", factors]).exit_code == 0
    config.write_text(config.read_text().replace("adapter: lora", "adapter: lora2"))
    for command in (["norms"], ["influence", "--ref", str(tmp_path / "data.pt")]):
        result = runner.invoke(
            app, [command[0], str(config), *command[1:], "--precondition", factors]
        )
        assert result.exit_code == 2, result.output
        (line,) = result.stderr.strip().splitlines()
        assert line.startswith("error: the factors were computed with another model.adapter")
        assert line.endswith(f"; run gradscope factors on this model again ({factors})")
    # TracIn over the run's adapter folders: the factors of the last one serve every one
    for order, status in ((["lora2", "lora"], 0), (["lora", "lora2"], 2)):
        checkpoints = [{"path": folder, "weight": 1.0} for folder in order]
        raw = yaml.safe_load(config.read_text())
        raw["model"] = {
            "factory": model["factory"],
            "pretrained": "base",
            "checkpoints": checkpoints,
        }
        config.write_text(yaml.safe_dump(raw))
        for command in (["norms"], ["influence", "--ref", str(tmp_path / "data.pt")]):
            args = [command[0], str(config), *command[1:], "--precondition", factors]
            result = runner.invoke(app, args)
            assert result.exit_code == status, (order, command, result.output)


def test_a_folder_without_adapter_config_is_named(tmp_path):
    from gradscope.config import ModelConfig
    from gradscope.errors import ModelError
    from gradscope.io.model import build_model

    lora_folders(tmp_path, "gpt2")
    (tmp_path / "lora" / "adapter_config.json").unlink()
    cfg = ModelConfig(
        "transformers:GPT2LMHeadModel",
        pretrained=str(tmp_path / "base"),
        adapter=str(tmp_path / "lora"),
    )
    with pytest.raises(ModelError, match="not a peft adapter folder"):
        build_model(cfg)
    # one not there was read as one lacking adapter_config.json
    with pytest.raises(ModelError, match="the adapter folder not found"):
        build_model(dataclasses.replace(cfg, adapter=str(tmp_path / "nosuchdir")))


def no_weights(folder) -> None:
    (folder / "adapter_model.safetensors").unlink()


def pickled_weights(folder) -> None:
    from safetensors.torch import load_file

    weights = load_file(folder / "adapter_model.safetensors")
    torch.save(weights | {"x": Marker(folder / "ran")}, folder / "adapter_model.bin")
    no_weights(folder)


def lfs_weights(folder) -> None:
    (folder / "adapter_model.safetensors").write_text(LFS)


@pytest.mark.parametrize(
    ("spoil", "message"),
    [
        (no_weights, "the adapter folder has no weights file (adapter_model.safetensors or "
         "adapter_model.bin) ({folder})"),
        (pickled_weights, "the adapter's adapter_model.bin holds objects other than tensors and "
         "is not loaded (that would run its pickle); save the adapter as safetensors ({folder})"),
        (lfs_weights, "a Git LFS pointer, not the file itself: run `git lfs pull` to fetch it "
         "({folder}/adapter_model.safetensors)"),
    ],
    ids=["no-weights", "pickled-bin", "lfs-pointer"],
)  # fmt: skip
def test_an_adapter_folder_whose_weights_cannot_be_loaded(tmp_path, spoil, message):
    lora_folders(tmp_path, "gpt2")
    spoil(tmp_path / "lora")
    torch.save({"ids": torch.randint(0, GPT2["vocab_size"], (3, 6))}, tmp_path / "data.pt")
    config = tmp_path / "config.yaml"
    raw = {
        "model": {
            "factory": "transformers:GPT2LMHeadModel",
            "pretrained": "base",
            "adapter": "lora",
        },
        "data": {"path": "data.pt", "inputs": "ids", "targets": "ids"},
        "loss": {"name": "causal_lm"},
        "device": "cpu",
    }
    config.write_text(yaml.safe_dump(raw))
    result = runner.invoke(app, ["norms", str(config)])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == "error: " + message.format(folder=tmp_path / "lora")
    assert not (tmp_path / "lora" / "ran").exists()


# -- half precision from the config's dtype ---------------------------------------------------

LLAMA = {
    "vocab_size": 40,
    "hidden_size": 8,
    "intermediate_size": 16,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 16,
}


def half_case(tmp_path, kind: str) -> tuple[nn.Module, dict, dict, str, tuple, torch.Tensor, list]:
    """(model as saved, config's model and data keys, loss, inputs, targets, selected globs)."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(5)
    if kind == "lora-gpt2":
        model = lora_folders(tmp_path, "gpt2")
        keys = {"factory": "transformers:GPT2LMHeadModel", "pretrained": "base", "adapter": "lora"}
    else:
        model = {
            "gpt2": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT2)),
            "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)),
            "bert": lambda: transformers.BertForSequenceClassification(
                transformers.BertConfig(**BERT)
            ),
        }[kind]().eval()
        model.save_pretrained(tmp_path / "base")
        keys = {"factory": f"transformers:{type(model).__name__}", "pretrained": "base"}
    selected = ["*lora_*"] if kind == "lora-gpt2" else ["*"]
    if kind == "bert":
        ids = torch.randint(0, BERT["vocab_size"], (8, 6), generator=g)
        mask = torch.ones_like(ids)
        mask[:3, 4:] = 0
        label = torch.randint(0, 3, (8,), generator=g)
        torch.save({"ids": ids, "mask": mask, "label": label}, tmp_path / "data.pt")
        data = {"inputs": {"input_ids": "ids", "attention_mask": "mask"}, "targets": "label"}
        return model, keys, data, "cross_entropy", (ids, mask), label, selected
    ids = torch.randint(0, 40, (8, 6), generator=g)
    torch.save({"ids": ids}, tmp_path / "data.pt")
    data = {"inputs": {"input_ids": "ids"}, "targets": "ids"}
    return model, keys, data, "causal_lm", (ids,), ids, selected


def half_errors(tmp_path, kind: str, dtype: str) -> tuple[float, float]:
    """Relative errors (to the largest norm) against the float64 loop on the same rounded
    weights: gradscope run from the config in ``dtype``, and a per-example loop in ``dtype``."""
    model, keys, data, loss, inputs, targets, selected = half_case(tmp_path, kind)
    frame = run_cli(tmp_path, keys, {"path": "data.pt", **data}, loss, dtype=dtype)
    assert frame["finite"].all()
    plan = read_metadata(tmp_path / "scores.parquet")["plan"]
    assert not [p["name"] for p in plan if "fallback" in p["rule"]]  # the self-check held
    names = list(data["inputs"])
    half = Logits(model, names).to(getattr(torch, dtype))  # the weights gradscope scored
    _, exact = reference_norms(half, inputs, targets, loss, selected)
    fn = resolve_loss(loss)
    with Engine(half, fn, selected) as engine:  # the loop, each example alone, in ``dtype``
        chosen = [p.name for p in engine.plan.included]
        _, grads = naive_grads(half, inputs, targets, fn, chosen)
    loop = torch.stack([rows(g).double().pow(2).sum(1) for g in grads.values()]).sum(0).sqrt()
    got = torch.tensor(frame["grad_norm"].to_numpy())

    def err(t: torch.Tensor) -> float:
        return ((t - exact).abs().max() / exact.abs().max()).item()

    return err(got), err(loop)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("kind", ["gpt2", "llama", "bert", "lora-gpt2"])
def test_half_precision_hf_models_no_worse_than_a_loop_in_their_dtype(tmp_path, kind, dtype):
    """Both errors come from running the forward and backward in ``dtype`` (the loop's examples
    alone, gradscope's in a batch: their roundings differ); the rules add up in float32 and add
    nothing of their own. Measured (gradscope / loop): 0.86x to 1.06x."""
    ours, loop = half_errors(tmp_path, kind, dtype)
    print(f"{kind} {dtype}: gradscope {ours:.2e}, {dtype} loop {loop:.2e} (vs float64 loop)")
    assert ours <= 1.25 * loop
    assert ours < {"bfloat16": 3e-2, "float16": 3e-3}[dtype]
