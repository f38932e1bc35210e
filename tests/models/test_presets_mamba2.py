"""The Mamba-2 hybrids' presets: Nemotron 3 Nano 30B-A3B is its published config.json as
``harts.integrations.hf`` converts it, and both presets hold as many parameters as transformers'
own model of the same config (built on the meta device: nothing is allocated)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from harts import HybridConfig

pytest.importorskip("transformers")

# nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16 config.json, its architecture fields
NEMOTRON_3_NANO: dict[str, Any] = {
    "architectures": ["NemotronHForCausalLM"],
    "model_type": "nemotron_h",
    "attention_bias": False,
    "chunk_size": 128,
    "conv_kernel": 4,
    "expand": 2,
    "head_dim": 128,
    "hidden_size": 2688,
    "hybrid_override_pattern": "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
    "intermediate_size": 1856,
    "layer_norm_epsilon": 1e-05,
    "mamba_head_dim": 64,
    "mamba_hidden_act": "silu",
    "mamba_num_heads": 64,
    "mamba_proj_bias": False,
    "mlp_bias": False,
    "mlp_hidden_act": "relu2",
    "moe_intermediate_size": 1856,
    "moe_shared_expert_intermediate_size": 3712,
    "n_group": 1,
    "n_groups": 8,
    "n_routed_experts": 128,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts_per_tok": 6,
    "num_hidden_layers": 52,
    "num_key_value_heads": 2,
    "routed_scaling_factor": 2.5,
    "ssm_state_size": 128,
    "tie_word_embeddings": False,
    "topk_group": 1,
    "use_bias": False,
    "use_conv_bias": True,
    "vocab_size": 131072,
}


def _transformers_parameters(hf_config: Any) -> int:  # noqa: ANN401
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    return sum(p.numel() for p in model.parameters())


def _harts_parameters(config: HybridConfig) -> int:
    from harts.models.hybrid_lm import HybridLM
    from harts.models.memory import parameter_count

    with torch.device("meta"):
        model = HybridLM(config)
    assert model.num_parameters() == parameter_count(config)
    return model.num_parameters()


def test_nemotron_3_nano_preset_is_its_published_config() -> None:
    from harts.integrations.hf.api import adapter_for, hf_config_from_dict

    hf_config = hf_config_from_dict(NEMOTRON_3_NANO)
    converted = adapter_for("nemotron_h").config_from_hf(hf_config, dtype="bfloat16")
    preset = HybridConfig.preset("nemotron_3_nano_30b_a3b")
    assert preset == converted
    assert (preset.layer_pattern.count("S"), preset.ffn_pattern.count("E"), preset.layer_pattern.count("A")) == (
        23,
        23,
        6,
    )
    assert _harts_parameters(preset) == _transformers_parameters(hf_config)


def test_granite_4_0_h_small_preset_has_the_shapes_transformers_builds() -> None:
    import transformers

    preset = HybridConfig.preset("granite_4_0_h_small")
    assert (preset.layer_pattern.count("S"), preset.layer_pattern.count("A")) == (36, 4)
    hf_config = transformers.GraniteMoeHybridConfig(
        vocab_size=preset.vocab_size,
        hidden_size=preset.hidden_size,
        num_hidden_layers=preset.num_hidden_layers,
        layer_types=["mamba" if t == "S" else "attention" for t in preset.layer_pattern],
        num_attention_heads=preset.num_attention_heads,
        num_key_value_heads=preset.num_key_value_heads,
        intermediate_size=preset.moe_intermediate_size,
        shared_intermediate_size=preset.shared_expert_intermediate_size,
        num_local_experts=preset.num_experts,
        num_experts_per_tok=preset.num_experts_per_tok,
        mamba_n_heads=preset.mamba_num_heads,
        mamba_d_head=preset.mamba_head_dim,
        mamba_d_state=preset.ssm_state_size,
        mamba_n_groups=preset.mamba_n_groups,
        mamba_expand=2,
        tie_word_embeddings=True,
    )
    from harts.integrations.hf.api import adapter_for

    converted = adapter_for("granitemoehybrid").config_from_hf(hf_config, dtype="bfloat16")
    assert converted.replace(attn_scale=None, rms_norm_eps=preset.rms_norm_eps) == preset
    assert _harts_parameters(preset) == _transformers_parameters(hf_config)
