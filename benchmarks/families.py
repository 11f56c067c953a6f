"""Model families as their libraries write them: hand-written copies of library layers and models
(nanoGPT, a timm-style ViT) that import no library, and tiny Hugging Face models built from configs.

The tests and ``bench.py`` both build their models here. ``transformers`` is imported only inside
the ``hf_*`` builders, so everything else runs without it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# ---------------------------------------------------------------- library layers, copied


class Conv1D(nn.Module):
    """transformers.pytorch_utils.Conv1D: a Linear whose weight is stored (in, out)."""

    def __init__(self, nf: int, nx: int, bias: bool = True):
        super().__init__()
        self.nf, self.nx = nf, nx
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.02)
        self.bias = nn.Parameter(torch.randn(nf) * 0.02) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        size_out = x.size()[:-1] + (self.nf,)
        flat = x.view(-1, x.size(-1))
        y = flat @ self.weight if self.bias is None else torch.addmm(self.bias, flat, self.weight)
        return y.view(size_out)


class LlamaRMSNorm(nn.Module):
    """HF's LlamaRMSNorm (and Mistral's, Qwen2's): float32 math, cast back, then the weight."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: Tensor) -> Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class T5LayerNorm(nn.Module):
    """HF's T5LayerNorm: the variance in float32, the product in the input's dtype."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: Tensor) -> Tensor:
        variance = hidden_states.to(torch.float32).pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        if self.weight.dtype in [torch.float16, torch.bfloat16]:
            hidden_states = hidden_states.to(self.weight.dtype)
        return self.weight * hidden_states


class LayerNorm(nn.LayerNorm):
    """timm.layers.LayerNorm: an nn.LayerNorm subclass with its own forward."""

    def forward(self, x: Tensor) -> Tensor:
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)


class LayerNorm2d(nn.LayerNorm):
    """timm.layers.LayerNorm2d: LayerNorm over the channels of (B, C, H, W)."""

    def forward(self, x: Tensor) -> Tensor:
        x = x.permute(0, 2, 3, 1)
        x = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return x.permute(0, 3, 1, 2)


class NanoGPTLayerNorm(nn.Module):
    """nanoGPT's LayerNorm "with an optional bias": a plain Module, eps fixed at 1e-5."""

    def __init__(self, ndim: int, bias: bool = True):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


# ---------------------------------------------------------------- nanoGPT


class CausalSelfAttention(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.c_attn, self.c_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.c_attn(x).split(d, dim=2)  # (B, T, d) each
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, heads, T, d/heads)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, d))


class GPTBlock(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln_1, self.ln_2 = NanoGPTLayerNorm(d), NanoGPTLayerNorm(d)
        self.attn = CausalSelfAttention(d, heads)
        self.c_fc, self.c_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.c_proj(F.gelu(self.c_fc(self.ln_2(x))))


class NanoGPT(nn.Module):
    """nanoGPT's GPT: token and position tables (``wpe(arange(T))``), a tied head."""

    def __init__(self, vocab: int, block_size: int, d: int, heads: int, layers: int):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(block_size, d)
        self.h = nn.ModuleList(GPTBlock(d, heads) for _ in range(layers))
        self.ln_f = NanoGPTLayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        for table in (self.wte, self.wpe):
            nn.init.normal_(table.weight, std=0.02)  # as nanoGPT: no denormal softmax (bench.py)

    def forward(self, idx: Tensor) -> Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)  # (T,) shared by the batch
        x = self.wte(idx) + self.wpe(pos)  # (B, T, d)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))  # (B, T, vocab)


# ---------------------------------------------------------------- timm-style ViT


class LayerScale(nn.Module):
    """timm's LayerScale: a learned per-channel ``gamma * x``."""

    def __init__(self, d: int, init_values: float):
        super().__init__()
        self.gamma = nn.Parameter(init_values * torch.ones(d))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.gamma


class Attention(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x: Tensor) -> Tensor:
        b, n, d = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(*qkv.unbind(0))  # (B, heads, N, d/heads)
        return self.proj(y.transpose(1, 2).reshape(b, n, d))


class ViTBlock(nn.Module):
    def __init__(self, d: int, heads: int, init_values: float):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(d, eps=1e-6), nn.LayerNorm(d, eps=1e-6)
        self.attn, self.ls1 = Attention(d, heads), LayerScale(d, init_values)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.ls2 = LayerScale(d, init_values)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.ls1(self.attn(self.norm1(x)))
        return x + self.ls2(self.mlp(self.norm2(x)))


class ViT(nn.Module):
    """timm's VisionTransformer: patch embedding, a class token expanded over the batch and
    concatenated, a learned position table added, LayerScale blocks, the class token's head."""

    def __init__(
        self,
        img: int = 32,
        patch: int = 4,
        d: int = 192,
        layers: int = 6,
        heads: int = 3,
        classes: int = 10,
        init_values: float = 1e-5,
    ):
        super().__init__()
        self.patch_embed = nn.Conv2d(3, d, patch, patch)
        self.cls_token = nn.Parameter(torch.randn(1, 1, d) * 0.02)
        self.pos_embed = nn.Parameter(torch.randn(1, (img // patch) ** 2 + 1, d) * 0.02)
        self.blocks = nn.Sequential(*(ViTBlock(d, heads, init_values) for _ in range(layers)))
        self.norm, self.head = nn.LayerNorm(d, eps=1e-6), nn.Linear(d, classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.patch_embed(x).flatten(2).transpose(1, 2)  # (B, N, d)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)  # (B, N+1, d)
        x = self.norm(self.blocks(x + self.pos_embed))
        return self.head(x[:, 0])  # (B, classes)


# ---------------------------------------------------------------- Hugging Face, tiny and random


class Logits(nn.Module):
    """A Hugging Face model called with ``input_ids`` (and ``attention_mask``), returning its
    logits; with ``next_token``, those of positions 0..T-2, to compare with ids 1..T-1."""

    def __init__(self, model: nn.Module, next_token: bool = False):
        super().__init__()
        self.model, self.next_token = model, next_token

    def forward(self, ids: Tensor, mask: Tensor | None = None) -> Tensor:
        logits = self.model(input_ids=ids, attention_mask=mask).logits
        return logits[:, :-1] if self.next_token else logits


def hf_gpt2(vocab: int, d: int, layers: int, heads: int, seq: int, **kw: object) -> Logits:
    import transformers

    config = transformers.GPT2Config(
        vocab_size=vocab, n_embd=d, n_layer=layers, n_head=heads, n_positions=seq,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, **kw,
    )  # fmt: skip
    return Logits(transformers.GPT2LMHeadModel(config), next_token=True)


def hf_bert(vocab: int, d: int, layers: int, heads: int, seq: int, **kw: object) -> Logits:
    import transformers

    config = transformers.BertConfig(
        vocab_size=vocab, hidden_size=d, num_hidden_layers=layers, num_attention_heads=heads,
        intermediate_size=4 * d, max_position_embeddings=seq, num_labels=3,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **kw,
    )  # fmt: skip
    return Logits(transformers.BertForSequenceClassification(config))


def hf_llama(
    vocab: int, d: int, layers: int, heads: int, kv_heads: int, seq: int, **kw: object
) -> Logits:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=d, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, intermediate_size=2 * d, max_position_embeddings=seq, **kw,
    )  # fmt: skip
    return Logits(transformers.LlamaForCausalLM(config), next_token=True)


def hf_mixtral(
    vocab: int, d: int, layers: int, heads: int, experts: int, seq: int, **kw: object
) -> Logits:
    """transformers 5's Mixtral: a router weight read by F.linear, fused 3-D expert weights run by
    grouped_mm on the tokens routed to each expert (top 2)."""
    import transformers

    config = transformers.MixtralConfig(
        vocab_size=vocab, hidden_size=d, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=heads // 2, intermediate_size=2 * d, max_position_embeddings=seq,
        num_local_experts=experts, num_experts_per_tok=2, **kw,
    )  # fmt: skip
    return Logits(transformers.MixtralForCausalLM(config), next_token=True)


def hf_bart(vocab: int, d: int, layers: int, heads: int, seq: int, **kw: object) -> Logits:
    """BART encoder-decoder (scaled word embeddings, learned positions), decoding its input."""
    import transformers

    config = transformers.BartConfig(
        vocab_size=vocab, d_model=d, encoder_layers=layers, decoder_layers=layers,
        encoder_attention_heads=heads, decoder_attention_heads=heads, encoder_ffn_dim=4 * d,
        decoder_ffn_dim=4 * d, max_position_embeddings=seq, dropout=0.0, **kw,
    )  # fmt: skip
    return Logits(transformers.BartForConditionalGeneration(config))


def padding_mask(batch: int, seq: int, generator: torch.Generator | None = None) -> Tensor:
    """(B, T) ones then zeros: example i keeps a random length between T/2 and T, the first all."""
    lengths = torch.randint(math.ceil(seq / 2), seq + 1, (batch,), generator=generator)
    lengths[0] = seq
    return (torch.arange(seq) < lengths.unsqueeze(1)).long()
