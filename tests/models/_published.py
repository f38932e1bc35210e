"""The published config.json of each real-model preset (harts.models.presets), its architecture
fields as the Hugging Face repository named above it ships them (token ids, context lengths and
vision towers left out), and the same config cut to its first N layers."""

from __future__ import annotations

import copy
from typing import Any

_QWEN3_5_ROPE = {
    "mrope_interleaved": True,
    "mrope_section": [11, 11, 10],
    "partial_rotary_factor": 0.25,
    "rope_theta": 10000000,
    "rope_type": "default",
}

_QWEN3_5_LINEAR = {
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_value_head_dim": 128,
}

# Qwen/Qwen3.5-9B
QWEN3_5_9B: dict[str, Any] = {
    "architectures": ["Qwen3_5ForConditionalGeneration"],
    "model_type": "qwen3_5",
    "tie_word_embeddings": False,
    "text_config": {
        "model_type": "qwen3_5_text",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_output_gate": True,
        "full_attention_interval": 4,
        "head_dim": 256,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 12288,
        **_QWEN3_5_LINEAR,
        "linear_num_value_heads": 32,
        "num_attention_heads": 16,
        "num_hidden_layers": 32,
        "num_key_value_heads": 4,
        "rms_norm_eps": 1e-06,
        "rope_parameters": _QWEN3_5_ROPE,
        "tie_word_embeddings": False,
        "vocab_size": 248320,
    },
}

# Qwen/Qwen3.5-27B
QWEN3_5_27B: dict[str, Any] = {
    "architectures": ["Qwen3_5ForConditionalGeneration"],
    "model_type": "qwen3_5",
    "tie_word_embeddings": False,
    "text_config": {
        "model_type": "qwen3_5_text",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_output_gate": True,
        "full_attention_interval": 4,
        "head_dim": 256,
        "hidden_act": "silu",
        "hidden_size": 5120,
        "initializer_range": 0.02,
        "intermediate_size": 17408,
        **_QWEN3_5_LINEAR,
        "linear_num_value_heads": 48,
        "num_attention_heads": 24,
        "num_hidden_layers": 64,
        "num_key_value_heads": 4,
        "rms_norm_eps": 1e-06,
        "rope_parameters": _QWEN3_5_ROPE,
        "tie_word_embeddings": False,
        "vocab_size": 248320,
    },
}

# Qwen/Qwen3.5-35B-A3B
QWEN3_5_35B_A3B: dict[str, Any] = {
    "architectures": ["Qwen3_5MoeForConditionalGeneration"],
    "model_type": "qwen3_5_moe",
    "tie_word_embeddings": False,
    "text_config": {
        "model_type": "qwen3_5_moe_text",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_output_gate": True,
        "full_attention_interval": 4,
        "head_dim": 256,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        **_QWEN3_5_LINEAR,
        "linear_num_value_heads": 32,
        "moe_intermediate_size": 512,
        "num_attention_heads": 16,
        "num_experts": 256,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 40,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06,
        "rope_parameters": _QWEN3_5_ROPE,
        "router_aux_loss_coef": 0.001,
        "shared_expert_intermediate_size": 512,
        "tie_word_embeddings": False,
        "vocab_size": 248320,
    },
}

# Qwen/Qwen3-Next-80B-A3B-Instruct
QWEN3_NEXT_80B_A3B: dict[str, Any] = {
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "decoder_sparse_step": 1,
    "full_attention_interval": 4,
    "head_dim": 256,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 5120,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_value_head_dim": 128,
    "mlp_only_layers": [],
    "moe_intermediate_size": 512,
    "norm_topk_prob": True,
    "num_attention_heads": 16,
    "num_experts": 512,
    "num_experts_per_tok": 10,
    "num_hidden_layers": 48,
    "num_key_value_heads": 2,
    "partial_rotary_factor": 0.25,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000000,
    "router_aux_loss_coef": 0.001,
    "shared_expert_intermediate_size": 512,
    "tie_word_embeddings": False,
    "vocab_size": 151936,
}

# moonshotai/Kimi-Linear-48B-A3B-Instruct
KIMI_LINEAR_48B_A3B: dict[str, Any] = {
    "architectures": ["KimiLinearForCausalLM"],
    "model_type": "kimi_linear",
    "first_k_dense_replace": 1,
    "hidden_act": "silu",
    "hidden_size": 2304,
    "initializer_range": 0.02,
    "intermediate_size": 9216,
    "kv_lora_rank": 512,
    "linear_attn_config": {
        "full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
        "head_dim": 128,
        "kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26],
        "num_heads": 32,
        "short_conv_kernel_size": 4,
    },
    "mla_use_nope": True,
    "moe_intermediate_size": 1024,
    "moe_layer_freq": 1,
    "moe_renormalize": True,
    "moe_router_activation_func": "sigmoid",
    "num_attention_heads": 32,
    "num_expert_group": 1,
    "num_experts": 256,
    "num_experts_per_token": 8,
    "num_hidden_layers": 27,
    "num_key_value_heads": 32,
    "num_nextn_predict_layers": 0,
    "num_shared_experts": 1,
    "q_lora_rank": None,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0,
    "routed_scaling_factor": 2.446,
    "tie_word_embeddings": False,
    "topk_group": 1,
    "use_grouped_topk": True,
    "v_head_dim": 128,
    "vocab_size": 163840,
}

#: preset name -> its model's published config.json
PUBLISHED: dict[str, dict[str, Any]] = {
    "qwen3_5_9b": QWEN3_5_9B,
    "qwen3_5_27b": QWEN3_5_27B,
    "qwen3_5_35b_a3b": QWEN3_5_35B_A3B,
    "qwen3_next_80b_a3b": QWEN3_NEXT_80B_A3B,
    "kimi_linear_48b_a3b": KIMI_LINEAR_48B_A3B,
}


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The decoder's config (Qwen3.5 nests it as ``text_config``)."""
    return config.get("text_config", config)


def cut(config: dict[str, Any], layers: int, *, full_attention_first: bool = False) -> dict[str, Any]:
    """``config`` with its first ``layers`` layers, as a transformers config of that depth reads
    (Qwen: ``layer_types`` from ``full_attention_interval``; Kimi: the 1-based layer lists cut);
    ``full_attention_first``: one full-attention layer instead (``layers`` must be 1)."""
    out = copy.deepcopy(config)
    text = text_config(out)
    text["num_hidden_layers"] = layers
    if full_attention_first:
        assert layers == 1
        if "linear_attn_config" in text:
            text["linear_attn_config"].update(kda_layers=[], full_attn_layers=[1])
        else:
            text["layer_types"] = ["full_attention"]
        return out
    lists = text.get("linear_attn_config", {})
    for key in ("kda_layers", "full_attn_layers"):
        if key in lists:
            lists[key] = [i for i in lists[key] if i <= layers]
    return out
