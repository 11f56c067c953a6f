"""Hugging Face families that once put parameters on the fallback or gave wrong numbers, built from
tiny configs: exact against the float64 loop on two batches, through fresh API calls and one
Engine, with every parameter on a rule (issue 16's list: scaled embeddings, learned positions,
Linear subclasses, (1 + w) norms, routed and fused experts), Wav2Vec2's in-place edit, and the
state-space and linear-attention scans replayed batch after batch."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from oracle import assert_fallback, assert_rel_close, reference_norms
from torch import Tensor, nn

import gradscope
from gradscope.engine import Engine, Forward, naive_grads, total
from gradscope.losses import resolve_loss

transformers = pytest.importorskip("transformers")

VOCAB, T, B = 64, 8, 3
SMALL = dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
             intermediate_size=24, max_position_embeddings=32)  # fmt: skip


class Logits(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids: Tensor) -> Tensor:
        return self.model(input_ids=ids).logits


def causal(config: str, model: str, **kw: object) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        cfg = getattr(transformers, config)(**{**SMALL, **kw})
        return Logits(getattr(transformers, model)(cfg))

    return build


FAMILIES = {
    "gemma": causal("GemmaConfig", "GemmaForCausalLM", num_key_value_heads=1, head_dim=8),
    "falcon": causal("FalconConfig", "FalconForCausalLM"),
    "opt": causal("OPTConfig", "OPTForCausalLM", ffn_dim=24, word_embed_proj_dim=16),
    "bart": causal("BartConfig", "BartForCausalLM", d_model=16, decoder_layers=1,
                   decoder_attention_heads=2, decoder_ffn_dim=24),
    # the decoder reads its input shifted right after a start token that no example gave
    "bart-seq2seq": causal("BartConfig", "BartForConditionalGeneration", d_model=16,
                           encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                           decoder_attention_heads=2, encoder_ffn_dim=24, decoder_ffn_dim=24),
    # the decoder's weight tied to the embedding, its bias held by the head around it
    "bert-lm-head": causal("BertConfig", "BertLMHeadModel", is_decoder=True),
    "mixtral-eager": causal("MixtralConfig", "MixtralForCausalLM", num_key_value_heads=1,
                            num_local_experts=4, num_experts_per_tok=2,
                            experts_implementation="eager"),
    "qwen2-moe-eager": causal("Qwen2MoeConfig", "Qwen2MoeForCausalLM", num_key_value_heads=1,
                              num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
                              shared_expert_intermediate_size=8, experts_implementation="eager"),
    # once all on the fallback, the trace wrong about one op: alibi.baddbmm(batch1=, batch2=),
    # JetMoE's out-of-place index_add, ImageGPT's mean(axis=-1)
    "bloom": causal("BloomConfig", "BloomForCausalLM", n_head=2, n_layer=1),
    "jetmoe": causal("JetMoeConfig", "JetMoeForCausalLM", num_key_value_heads=2, kv_channels=8,
                     num_local_experts=4, num_experts_per_tok=2),
    "imagegpt": causal("ImageGPTConfig", "ImageGPTForCausalImageModeling", n_embd=16, n_layer=1,
                       n_head=2, n_positions=32, vocab_size=VOCAB + 1),  # one class fewer
}  # fmt: skip


# state-space and linear-attention mixers: transformers 5.25 runs their scans through
# `kernels`-wrapped functions that split an empty tail off the sequence (`tensor_split(x, [T])`)
SCANS = {
    "mamba": causal("MambaConfig", "MambaForCausalLM", state_size=4, expand=2, conv_kernel=4,
                    time_step_rank=4),
    "falcon-mamba": causal("FalconMambaConfig", "FalconMambaForCausalLM", state_size=4,
                           expand=2, conv_kernel=4, time_step_rank=4),
    "mamba2": causal("Mamba2Config", "Mamba2ForCausalLM", state_size=4, expand=2, num_heads=4,
                     head_dim=8, n_groups=1, conv_kernel=4, chunk_size=4),
    "bamba": causal("BambaConfig", "BambaForCausalLM", num_hidden_layers=2, num_key_value_heads=1,
                    mamba_n_heads=4, mamba_d_head=8, mamba_d_state=4, mamba_expand=2,
                    mamba_chunk_size=4, attn_layer_indices=[1]),
    "falcon-h1": causal("FalconH1Config", "FalconH1ForCausalLM", num_key_value_heads=1,
                        head_dim=8, mamba_n_heads=4, mamba_d_head=8, mamba_d_state=4,
                        mamba_expand=2, mamba_chunk_size=4, mamba_d_ssm=32),
    "jamba": causal("JambaConfig", "JambaForCausalLM", num_hidden_layers=2, num_key_value_heads=1,
                    num_experts=2, num_experts_per_tok=1, expert_layer_period=2,
                    expert_layer_offset=1, attn_layer_period=2, attn_layer_offset=1,
                    mamba_d_state=4, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4,
                    use_mamba_kernels=False, experts_implementation="eager"),
    "qwen3-next": causal("Qwen3NextConfig", "Qwen3NextForCausalLM", num_hidden_layers=2,
                         num_key_value_heads=1, head_dim=8, num_experts=2, num_experts_per_tok=1,
                         moe_intermediate_size=8, shared_expert_intermediate_size=8,
                         linear_num_key_heads=2, linear_num_value_heads=2,
                         linear_key_head_dim=8, linear_value_head_dim=8,
                         linear_conv_kernel_dim=4, experts_implementation="eager",
                         layer_types=["linear_attention", "full_attention"]),
}  # fmt: skip


def batch(seed: int, b: int = B) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (b, T), generator=g), torch.randint(
        0, VOCAB, (b, T), generator=g
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_family_is_exact_on_rules(family: str):
    torch.manual_seed(0)
    model = FAMILIES[family]().double().eval()
    with Engine(model, resolve_loss("cross_entropy")) as engine:
        for seed in range(2):
            ids, y = batch(seed)
            got = total(engine.norms((ids,), y).norm_sq).sqrt()
            assert_rel_close(got, reference_norms(model, (ids,), y, "cross_entropy")[1], 1e-6)
    assert_fallback(engine)
    ids, y = batch(5, b=2)  # a fresh call, another batch size
    got = gradscope.per_example_norms(model, ids, y)
    assert_rel_close(got, reference_norms(model, (ids,), y, "cross_entropy")[1], 1e-6)


@pytest.mark.parametrize("family", SCANS)
def test_scan_family_replays_exactly(family: str):
    """Each batch after the first replayed, every parameter on a rule, exact, with the lock's
    transformers and the newest alike (.ci/newest): 5.25's scans once took every parameter to
    the fallback, and Mamba2's, Bamba's and Falcon-H1's second batch failed in the replay."""
    torch.manual_seed(0)
    model = SCANS[family]().double().eval()
    with Engine(model, resolve_loss("cross_entropy")) as engine:
        for seed in range(3):
            ids, y = batch(seed)
            got = total(engine.norms((ids,), y).norm_sq).sqrt()
            assert_rel_close(got, reference_norms(model, (ids,), y, "cross_entropy")[1], 1e-6)
        findings = engine.record.at((ids,), y)
    assert_fallback(engine)
    assert findings.replays == 2, findings.why


@pytest.mark.parametrize("family", ["mixtral", "qwen2-moe"])
def test_grouped_experts_float32(family: str):
    """transformers 5's default experts: torch's grouped_mm over fused 3-D weights, which has no
    float64 kernel: against the float32 loop, on batches routed otherwise through one Engine,
    the later ones replayed as routed regions."""
    torch.manual_seed(0)
    build = FAMILIES[f"{family}-eager"]
    model = build().eval()
    model.model.config._experts_implementation = "grouped_mm"
    loss = resolve_loss("cross_entropy")
    with Engine(model, loss) as engine:
        for seed in range(3):
            ids, y = batch(seed)
            got = total(engine.norms((ids,), y).norm_sq).sqrt()
            names = [p.name for p in engine.plan.included]
            _, grads = naive_grads(model, (ids,), y, loss, names, Forward())
            expected = [g.reshape(B, -1).double().pow(2).sum(1) for g in grads.values()]
            assert_rel_close(got, torch.stack(expected).sum(0).sqrt(), 1e-5)
        findings = engine.record.at((ids,), y)
    assert_fallback(engine)
    assert findings.replays == 2 and not findings.programs[-1].varies, findings.why


def test_wav2vec2_edited_output_stays_exact_on_a_second_call():
    """Wav2Vec2 with a layer-norm feature extractor and an attention mask zeroes padded frames in
    place after its feature projection: the first call moves those parameters to the fallback,
    and the second (a new Engine) must keep them there (it once gave them zero norms)."""
    config = transformers.Wav2Vec2Config(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        conv_dim=(8, 8), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=4,
        num_conv_pos_embedding_groups=2, feat_extract_norm="layer", do_stable_layer_norm=True,
        num_labels=3, classifier_proj_size=8, vocab_size=10,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Wav2Vec2ForSequenceClassification(config).double().eval()
    x = torch.randn(3, 200, dtype=torch.float64)
    mask = torch.ones(3, 200, dtype=torch.long)
    mask[1, 120:], mask[2, 80:] = 0, 0
    y = torch.tensor([0, 2, 1])
    expected = reference_norms(model, (x, mask), y, "cross_entropy")[1]
    for _ in range(2):
        assert_rel_close(gradscope.per_example_norms(model, (x, mask), y), expected, 1e-9)
