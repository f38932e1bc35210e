"""Kimi Linear <-> harts: KDA (K) + NoPE MLA (M) + DeepSeek-V3 MoE with shared experts.

Semantics honoured (transformers ``modeling_kimi_linear``):
    KDA: separate q/k/v projections, one depthwise conv over cat(q, k, v) (on disk q/k/v_conv1d),
         LOW-RANK forget gate ``f_b_proj(f_a_proj x)`` (rank = linear_head_dim) with
         ``-exp(A_log) * softplus(f + dt_bias)``, low-rank output gate ``g_b_proj(g_a_proj x)``
         into a sigmoid-gated RMSNorm (eps rms_norm_eps); heads = linear_num_heads.
    MLA: NO rotary embedding (the qk_rope_head_dim part is used unrotated), no output gate,
         latent norms with eps 1e-6, scale (nope + rope)^-1/2.
    MoE: as BailingHybrid (sigmoid router, correction bias, group routing, normalized top-k,
         routed_scaling_factor, shared experts), dense layers from ``mlp_layer_types``.

Name map: ``self_attn.forget_gate.{f_a_proj,f_b_proj,dt_bias}`` -> ``linear_attn.*``;
``forget_gate.A_log`` [1,1,H,1] <-> ``A_log`` [H]; ``conv1d`` [3C,1,w] <-> ``q/k/v_conv1d``.
On disk (Hub layout): forget-gate tensors sit on ``self_attn`` directly, MoE blocks are
``block_sparse_moe`` and experts are ``experts.{e}.w1/w3/w2``.
"""

from __future__ import annotations

from typing import Any

from harts.integrations.hf.bailing_hybrid import (
    check_common,
    deepseek_moe_fields,
    kda_mla_fields,
    mla_fields,
    mla_groups,
)
from harts.integrations.hf.base import HFAdapter, Problems, TensorGroup, conv_group, ident, reshape_group
from harts.models.config import HybridConfig

__all__ = ["KimiLinearAdapter"]


class KimiLinearAdapter(HFAdapter):
    def __init__(self) -> None:
        super().__init__(
            model_type="kimi_linear",
            architecture="KimiLinearForCausalLM",
            checkpoint_renames=[
                (r"self_attn\.f_a_proj\.", "self_attn.forget_gate.f_a_proj."),
                (r"self_attn\.f_b_proj\.", "self_attn.forget_gate.f_b_proj."),
                (r"self_attn\.dt_bias$", "self_attn.forget_gate.dt_bias"),
                (r"self_attn\.A_log$", "self_attn.forget_gate.A_log"),
                (r"\.block_sparse_moe\.", ".mlp."),
            ],
            expert_names=(("w1", "w3", "w2"), ("gate_proj", "up_proj", "down_proj")),
        )
        self.ties_embeddings = False  # transformers keeps a separate lm_head (no _tied_weights_keys)

    def config_from_hf(self, hf_config: Any, **overrides: Any) -> HybridConfig:
        c = hf_config
        p = Problems(self.architecture)
        check_common(c, p)
        fields: dict[str, Any] = dict(
            **kda_mla_fields(c, p),
            tie_word_embeddings=self.tie_word_embeddings(c),
            kda_low_rank_gates=True,
            kda_safe_gate=False,
            mla_output_gate=False,
            mla_head_gate=False,
            mla_rope=False,
            **mla_fields(c),
            **deepseek_moe_fields(c, p),
        )
        p.raise_if_any()
        fields.update(self.check_overrides(overrides))
        return HybridConfig(**fields)

    def mixer_groups(self, cfg: HybridConfig, i: int) -> list[TensorGroup]:
        if cfg.layer_pattern[i] == "M":
            return mla_groups(cfg, i)
        h, f = f"layers.{i}.linear_attn", f"model.layers.{i}.self_attn"
        H = cfg.linear_num_value_heads
        c = H * cfg.linear_key_head_dim
        out = [
            ident(f"{h}.{n}.weight", f"{f}.{n}.weight")
            for n in ("q_proj", "k_proj", "v_proj", "b_proj", "g_a_proj", "g_b_proj", "o_norm", "o_proj")
        ]
        out += [
            conv_group(h, f"{f}.conv1d.weight", (c, c, H * cfg.linear_value_head_dim)),
            ident(f"{h}.f_a_proj.weight", f"{f}.forget_gate.f_a_proj.weight"),
            ident(f"{h}.f_b_proj.weight", f"{f}.forget_gate.f_b_proj.weight"),
            ident(f"{h}.dt_bias", f"{f}.forget_gate.dt_bias"),
            reshape_group(f"{h}.A_log", f"{f}.forget_gate.A_log", (H,), (1, 1, H, 1)),
        ]
        return out
