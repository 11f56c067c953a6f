"""Every model type the installed ``transformers`` knows, built tiny from its config, random init.

The head: ``AutoModelForCausalLM`` (loss ``causal_lm`` on the input ids), else
``AutoModelForSequenceClassification``, ``...ForImageClassification``, ``...ForAudioClassification``
(``cross_entropy`` on 3 random labels), else the base ``AutoModel`` with ``mse`` of its
``last_hidden_state`` (or first tensor output) against a fixed random target. Inputs follow
``model.main_input_name``: token ids, pixel values, raw audio or log-mel features.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import Tensor, nn

HIDDEN, LAYERS, HEADS, HEAD_DIM, INTER, VOCAB, POSITIONS = 32, 2, 4, 8, 64, 64, 64
IMAGE, PATCH, AUDIO, BATCH, SEQ = 32, 8, 1600, 3, 8

_SET = {
    **dict.fromkeys(("hidden_size", "d_model", "n_embd", "embed_dim", "emb_dim", "word_embed_proj_dim"), HIDDEN),
    **dict.fromkeys(("num_hidden_layers", "n_layer", "n_layers", "num_layers", "encoder_layers",
                     "decoder_layers", "num_decoder_layers", "num_encoder_layers"), LAYERS),
    **dict.fromkeys(("num_attention_heads", "n_head", "n_heads", "num_heads",
                     "encoder_attention_heads", "decoder_attention_heads"), HEADS),
    **dict.fromkeys(("head_dim", "d_kv", "qk_nope_head_dim", "v_head_dim", "qk_rope_head_dim"),
                    HEAD_DIM),
    **dict.fromkeys(("intermediate_size", "ffn_dim", "encoder_ffn_dim", "decoder_ffn_dim", "d_ff",
                     "n_inner", "shared_expert_intermediate_size"), INTER),
    **dict.fromkeys(("moe_intermediate_size", "kv_lora_rank", "q_lora_rank", "embedding_size",
                     "projection_dim", "classifier_proj_size", "num_mel_bins",
                     "num_conv_pos_embeddings", "codevector_dim", "proj_codevector_dim"), 16),
    **dict.fromkeys(("max_position_embeddings", "n_positions", "max_target_positions",
                     "max_seq_len"), POSITIONS),
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"), 4),
    **dict.fromkeys(("num_experts_per_tok", "num_experts_per_token", "moe_topk"), 2),
    **dict.fromkeys(("n_group", "num_expert_group", "topk_group", "n_shared_experts"), 1),
    "linear_num_heads": HEADS, "linear_head_dim": HEAD_DIM,
    **dict.fromkeys(("mamba_n_heads", "mamba_d_state", "ssm_state_size", "state_size"), 4),
    "mamba_d_head": 16, "rotary_dim": HEAD_DIM // 2,
    "vocab_size": VOCAB, "max_source_positions": 16, "attention_window": 4, "use_cache": False,
}  # fmt: skip
_DROP = ("transformers_version", "_name_or_path", "model_type", "architectures", "dtype",
         "stage_names", "out_features", "out_indices", "qk_head_dim", "id2label", "label2id")  # fmt: skip

# where the generic shrink is not enough: model type -> keys to set after it
OVERRIDES: dict[str, dict] = {
    "mamba2": {"head_dim": 16, "n_groups": 1},  # heads x head_dim must fill the expanded width
    "falcon_h1": {"mamba_d_ssm": 64},
    "squeezebert": {"embedding_size": HIDDEN},  # the embeddings feed the first layer unprojected
    "xlnet": {"d_head": HIDDEN // HEADS},
    "bit": {"num_groups": 8},  # its group norms split the 16 channels of the first stage
    # the HiFi-GAN decoder's 512 channels upsampled 256 times, and the flows' 192: a forward of
    # minutes in float64; no noise, so two forwards agree
    "vits": {"upsample_initial_channel": 16, "upsample_rates": [2, 2],
             "upsample_kernel_sizes": [4, 4], "resblock_kernel_sizes": [3],
             "resblock_dilation_sizes": [[1, 3]], "flow_size": 16, "spectrogram_bins": 17,
             "duration_predictor_filter_channels": 16, "duration_predictor_num_flows": 1,
             "prior_encoder_num_flows": 1, "prior_encoder_num_wavenet_layers": 1,
             "posterior_encoder_num_wavenet_layers": 1, "noise_scale": 0.0,
             "noise_scale_duration": 0.0},
}  # fmt: skip


def _shrink(cfg: dict) -> dict:
    """Small values for the common size keys of a config dict, recursively into sub-configs."""
    layers = next((cfg[k] for k in ("num_hidden_layers", "n_layer", "num_layers") if k in cfg), 0)
    out = {}
    for key, value in cfg.items():
        if key in _DROP or value is None:
            continue
        if isinstance(value, dict) and "model_type" in value:
            value = _shrink(value)
        elif isinstance(value, dict) and len(value.get("mrope_section") or ()) == 3:
            value = value | {"mrope_section": [HEAD_DIM // 4, HEAD_DIM // 8, HEAD_DIM // 8]}
        elif isinstance(value, bool):
            value = _SET.get(key, value)
        elif key in _SET and isinstance(value, int | float) and value:
            value = _SET[key]
        elif key == "num_key_value_heads" and isinstance(value, int):
            value = HEADS if value >= cfg.get("num_attention_heads", value) else 2
        elif "dropout" in key or key.endswith(("_pdrop", "drop_path_rate", "layerdrop")):
            value = 0.0 if isinstance(value, float) else value
        elif key == "image_size":
            value = IMAGE if isinstance(value, int) else [IMAGE] * len(value)
        elif key == "patch_size" and isinstance(value, int):
            value = min(value, PATCH)
        elif key in ("depths", "num_heads", "hidden_sizes") and isinstance(value, list | tuple):
            value = {"depths": [1, 1], "num_heads": [2, 2], "hidden_sizes": [16, 32]}[key]
        elif key == "num_stages" and "depths" in cfg:
            value = 2
        elif key == "window_size" and "depths" in cfg and isinstance(value, int):
            value = 4
        elif key in ("conv_dim", "tdnn_dim") and isinstance(value, list | tuple):
            value = [16] * len(value)
        elif key.endswith(("token_id", "token_index")) and isinstance(value, int) and value >= 48:
            value = VOCAB - 1 - sum(map(ord, key)) % 8
        elif isinstance(value, list) and layers and len(value) == layers:
            value = value[:LAYERS]
        out[key] = value
    return out


def tiny_config(model_type: str):
    from transformers import AutoConfig

    base = AutoConfig.for_model(model_type)
    kwargs = _shrink(base.to_dict()) | OVERRIDES.get(model_type, {})
    config = AutoConfig.for_model(model_type, **kwargs)
    config.num_labels = 3
    if getattr(config, "pad_token_id", None) is None:
        config.pad_token_id = 0  # sequence classification of a batch needs one
    return config


def head(model_type: str) -> tuple[str, str] | None:
    """(Auto class, loss) for this type: the first mapping that has it; None when no Auto class
    builds it (a sub-config, as ``clip_vision_model``)."""
    from transformers.models.auto import modeling_auto as m

    for mapping, auto, loss in (
        (m.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, "AutoModelForCausalLM", "causal_lm"),
        (m.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES, "AutoModelForSequenceClassification",
         "cross_entropy"),
        (m.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES, "AutoModelForImageClassification",
         "cross_entropy"),
        (m.MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES, "AutoModelForAudioClassification",
         "cross_entropy"),
    ):  # fmt: skip
        if model_type in mapping:
            return auto, loss
    return ("AutoModel", "mse") if model_type in m.MODEL_MAPPING_NAMES else None


def model_types() -> list[str]:
    """Every type, those with a head first (causal LM, classifiers), then base, then sub-configs."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    order = ["AutoModelForCausalLM", "AutoModelForSequenceClassification",
             "AutoModelForImageClassification", "AutoModelForAudioClassification", "AutoModel"]  # fmt: skip
    return sorted(
        CONFIG_MAPPING_NAMES,
        key=lambda t: (order.index((head(t) or ("",))[0]) if head(t) else 9, t),
    )


class Call(nn.Module):
    """The model called with its inputs by keyword; returns the tensor the loss reads."""

    def __init__(self, model: nn.Module, names: tuple[str, ...]):
        super().__init__()
        self.model, self.names = model, names

    def forward(self, *tensors: Tensor) -> Tensor:
        out = self.model(**dict(zip(self.names, tensors, strict=True)))
        if getattr(out, "logits_per_image", None) is not None:
            # a dual encoder's (B, B) similarities mix the examples by construction: each
            # example's own image-text similarity, the diagonal, is its per-example output
            return out["logits_per_image"].diagonal()
        for key in ("logits", "last_hidden_state"):
            if getattr(out, key, None) is not None:
                return out[key]
        return next(v for v in out.values() if isinstance(v, Tensor) and v.is_floating_point())


@dataclass
class Problem:
    model: nn.Module
    batches: list[tuple[tuple[Tensor, ...], Tensor]]
    loss: str
    auto: str


class Unbuildable(Exception):
    """The family cannot be built or run offline as it is: a skip, not a gradscope failure."""


def _inputs(model: nn.Module, config, g: torch.Generator, both: bool) -> dict[str, Tensor]:
    """The main input; with ``both``, token ids and pixel values (CLIP-like dual encoders)."""
    x = main_input(model.main_input_name, model, config, g)
    if both:
        x |= main_input("input_ids", model, getattr(config, "text_config", config), g)
        x |= main_input("pixel_values", model, getattr(config, "vision_config", config), g)
    return x


def main_input(
    name: str, model: nn.Module, config, g: torch.Generator, batch: int = BATCH
) -> dict[str, Tensor]:
    """The input ``name`` of ``batch`` rows: token ids, an image's pixels, a sound's samples or
    its mel bins' frames, as the config sizes them."""
    if name == "input_ids":
        ids = torch.randint(3, 48, (batch, SEQ), generator=g)
        eos = getattr(config, "eos_token_id", None)
        if isinstance(eos, int) and eos < VOCAB:
            ids[:, -1] = eos  # encoder-decoder classifiers read the last <eos>
        x = {"input_ids": ids}
        params = inspect.signature(model.forward).parameters
        if getattr(config, "is_encoder_decoder", False) and "decoder_input_ids" in params:
            x["decoder_input_ids"] = ids.clone()
        return x
    if name == "pixel_values":
        size = getattr(config, "image_size", IMAGE)
        h, w = (size, size) if isinstance(size, int) else tuple(size)[-2:]
        c = getattr(config, "num_channels", 3)
        return {name: torch.randn(batch, c, h, w, generator=g, dtype=torch.float64)}
    if name == "input_values":
        return {name: torch.randn(batch, AUDIO, generator=g, dtype=torch.float64)}
    if name == "input_features":
        bins = getattr(config, "num_mel_bins", 16)
        frames = 2 * getattr(config, "max_source_positions", 16)
        return {name: torch.randn(batch, bins, frames, generator=g, dtype=torch.float64)}
    raise Unbuildable(f"inputs: main input {name!r} is not generated")


def build(model_type: str) -> Problem:
    """The tiny model in float64 eval mode and three batches of the same shape with other values
    (the first analysed, the later ones replayed), with targets."""
    import transformers

    if head(model_type) is None:
        raise Unbuildable("no Auto class builds it (a sub-config of another type)")
    auto, loss = head(model_type)
    try:
        config = tiny_config(model_type)
        torch.manual_seed(0)
        # grouped_mm (the MoE default) has no float64 kernel: the experts' loop instead
        auto_class = getattr(transformers, auto)
        model = auto_class.from_config(config, experts_implementation="eager").double().eval()
    except Exception as e:
        raise Unbuildable(f"build ({auto}): {type(e).__name__}: {' '.join(str(e).split())}") from e
    params = inspect.signature(model.forward).parameters
    dual = {"input_ids", "pixel_values"} <= set(params)
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(3):
        for both in (False, True) if dual else (False,):
            x = _inputs(model, config, g, both)
            wrapped = Call(model, tuple(x))
            try:
                with torch.no_grad():
                    out, again = wrapped(*x.values()), wrapped(*x.values())
                break
            except Exception as e:
                if dual and not both:
                    continue  # a dual encoder: run again with both inputs
                raise Unbuildable(f"forward: {type(e).__name__}: {' '.join(str(e).split())}") from e
        if not torch.equal(out, again):  # random masking or sampling: no oracle to compare with
            raise Unbuildable("forward is random in eval mode (two calls differ)")
        if loss == "causal_lm":
            y = x["input_ids"]
        elif loss == "cross_entropy":
            y = torch.randint(0, out.shape[-1], (BATCH,), generator=g)
        else:
            y = torch.randn(out.shape, generator=g, dtype=out.dtype)
        batches.append((tuple(x.values()), y))
    return Problem(wrapped, batches, loss, auto)
