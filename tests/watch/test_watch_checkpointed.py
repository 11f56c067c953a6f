"""The watch of a model trained with activation (gradient) checkpointing, as transformers
enables it (``use_reentrant=False``, and the embeddings' output flagged ``requires_grad_``
for the checkpointed layers, as PEFT's LoRA fine-tuning has it): its layers' forward runs
again in the backward, and each number is still the loop's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from oracle import trained_alike, watched_as_looped
from project import trainer_args

transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")


def _gpt2(checkpointed: bool) -> torch.nn.Module:
    """A two-layer GPT-2 with its dropout on (0.1)."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=16, n_positions=8, n_embd=8, n_layer=2, n_head=2)
    model = transformers.GPT2LMHeadModel(config).double().train()
    if checkpointed:
        model.gradient_checkpointing_enable()
    return model


def _lm_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The mean over the next tokens."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())


@pytest.mark.parametrize("adapted", [False, True], ids=["full", "lora"])
def test_each_norm_of_a_checkpointed_model_is_the_loops(tmp_path, adapted):
    """Analysed and replayed steps: no parameter on the fallback, each row's norm its own
    loss's under the batch's masks (a loop on the model without checkpointing), ``.grad``
    the plain step's; a LoRA model's over its adapters alone, their dropout included."""
    wrap = _lora if adapted else (lambda model: model)
    model, plain = wrap(_gpt2(True)), wrap(_gpt2(False))
    batches = []
    for seed in (1, 2):  # one shape, other values
        tokens = torch.randint(0, 16, (4, 6), generator=torch.Generator().manual_seed(seed))
        batches.append(((tokens,), tokens))

    def losses(inputs, tokens):
        return (lambda i: _lm_loss(plain(tokens).logits[i : i + 1], tokens[i : i + 1]),
                lambda: _lm_loss(plain(tokens).logits, tokens))  # fmt: skip

    watched_as_looped(model, plain, tmp_path / "w.parquet", batches, losses,
                      loss="causal_lm", reduction="tokens", output="logits")  # fmt: skip
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trained and (not adapted or all("lora" in n for n in trained))


@pytest.mark.parametrize("adapted", [False, True], ids=["full", "lora"])
def test_a_trainer_with_gradient_checkpointing_trains_as_without_the_watch(tmp_path, adapted):
    """``gradient_checkpointing=True`` (the second step failed: every parameter was sent to
    the fallback at the flag set on the embeddings' output, and the pass then kept no graph
    for the training step's batch gradient); and a PEFT LoRA model's (its kind was refused:
    a ``PeftModel`` is its base model's kind)."""
    tokens = torch.randint(0, 16, (8, 6), generator=torch.Generator().manual_seed(1))
    data = datasets.Dataset.from_dict(
        {"input_ids": tokens.tolist(), "labels": tokens.tolist(), "example_id": list(range(8))}
    )
    args = trainer_args(
        str(tmp_path / "out"), per_device_train_batch_size=4, num_train_epochs=2,
        learning_rate=1e-2, gradient_checkpointing=True, seed=0,
    )  # fmt: skip

    def train(callbacks: list) -> torch.nn.Module:
        model = _lora(_gpt2(False)) if adapted else _gpt2(False)
        transformers.Trainer(model, args, train_dataset=data, callbacks=callbacks).train()
        return model

    table = trained_alike(tmp_path, train)
    assert sorted(table["example_id"]) == sorted(list(range(8)) * 2)


def _lora(model: torch.nn.Module) -> torch.nn.Module:
    """LoRA adapters of rank 2 on GPT-2's attention and projections, their dropout on."""
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["c_attn", "c_proj"],
                             lora_dropout=0.1, fan_in_fan_out=True)  # fmt: skip
    torch.manual_seed(5)
    return peft.get_peft_model(model, config)
