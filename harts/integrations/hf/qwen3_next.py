"""Qwen3-Next <-> harts: Gated DeltaNet (G) + gated GQA (A) + MoE with a gated shared expert.

Semantics honoured (transformers ``modeling_qwen3_next``):
    GDN: in_proj_qkvz / in_proj_ba grouped per key head, one depthwise conv over cat(q, k, v),
         ``g = -exp(A_log) * softplus(a + dt_bias)``, beta = sigmoid(b), q/k l2-normed and
         repeated to the value heads, output RMSNorm gated by silu(z) (plain weight).
    A:   q_proj emits (query, gate) per head, zero-centred q_norm/k_norm (``1 + weight``),
         partial RoPE on ``partial_rotary_factor * head_dim`` dims, sigmoid output gate.
    Norms: every RMSNorm except the gated one is zero-centred (``norm_unit_offset``).
    MoE: softmax router (no correction bias, no groups), optional top-k renormalization, one
         shared expert of ``shared_expert_intermediate_size`` scaled by
         sigmoid(shared_expert_gate x); MoE layers from ``decoder_sparse_step`` and
         ``mlp_only_layers`` (the dense ones must be a prefix).

Every canonical name equals the harts name with a ``model.`` prefix except the shared expert
(``mlp.shared_expert.*`` -> ``mlp.shared_experts.*``). On disk experts are per-expert
``experts.{e}.gate_proj/up_proj/down_proj``.
"""

from __future__ import annotations

from typing import Any

from harts.integrations.hf.bailing_hybrid import check_common, rope_theta_of
from harts.integrations.hf.base import HFAdapter, Problems, TensorGroup, dense_prefix, ident
from harts.models.config import HybridConfig
from harts.models.presets import SOFTMAX_ROUTER

__all__ = ["Qwen3NextAdapter", "gdn_gqa_fields"]


def gdn_gqa_fields(c: Any, p: Problems, *, tie_word_embeddings: bool) -> dict[str, Any]:
    """The ``HybridConfig`` fields of a Qwen3-Next / Qwen3.5 text config ``c`` other than its FFN:
    the layer pattern from ``layer_types`` (G for linear attention, A for full attention), the
    Gated DeltaNet and gated GQA widths, partial RoPE, zero-centred norms. Problems go to ``p``."""
    check_common(c, p)
    p.expect("hidden_act", c.hidden_act, "silu")
    L = int(c.num_hidden_layers)
    letters = {"linear_attention": "G", "full_attention": "A"}
    types = [str(t) for t in list(c.layer_types)[:L]]
    bad = sorted(set(types) - set(letters))
    if bad:
        p.add(f"layer_types: unknown entries {bad}")
    if len(types) < L:
        p.add(f"layer_types: {len(types)} entries for num_hidden_layers={L}")
    theta, partial = rope_theta_of(c, p, partial_ok=True)
    hk, hv = int(c.linear_num_key_heads), int(c.linear_num_value_heads)
    if hk < 1 or hv % hk:
        p.add(f"linear_num_value_heads={hv} is not a multiple of linear_num_key_heads={hk}")
    return dict(
        layer_pattern="".join(letters.get(t, "G") for t in types),
        vocab_size=int(c.vocab_size),
        hidden_size=int(c.hidden_size),
        rms_norm_eps=float(c.rms_norm_eps),
        norm_unit_offset=True,
        tie_word_embeddings=tie_word_embeddings,
        linear_conv_kernel_dim=int(c.linear_conv_kernel_dim),
        linear_num_key_heads=hk,
        linear_num_value_heads=hv,
        linear_key_head_dim=int(c.linear_key_head_dim),
        linear_value_head_dim=int(c.linear_value_head_dim),
        num_attention_heads=int(c.num_attention_heads),
        num_key_value_heads=int(c.num_key_value_heads),
        head_dim=int(c.head_dim),
        partial_rotary_factor=partial,
        attn_output_gate=True,
        rope_theta=theta,
        hidden_act="silu",
    )


class Qwen3NextAdapter(HFAdapter):
    def __init__(self) -> None:
        super().__init__(model_type="qwen3_next", architecture="Qwen3NextForCausalLM")
        self.shared_expert_name = "shared_expert"

    def config_from_hf(self, hf_config: Any, **overrides: Any) -> HybridConfig:
        c = hf_config
        p = Problems(self.architecture)
        fields = gdn_gqa_fields(c, p, tie_word_embeddings=self.tie_word_embeddings(c))
        L = int(c.num_hidden_layers)
        only = set(c.mlp_only_layers or [])
        is_moe = [i not in only and c.num_experts > 0 and (i + 1) % c.decoder_sparse_step == 0 for i in range(L)]
        first_dense = dense_prefix(is_moe, "decoder_sparse_step / mlp_only_layers", p)
        num_experts = int(c.num_experts) if any(is_moe) else 0
        shared = int(c.shared_expert_intermediate_size or 0)
        fields.update(
            intermediate_size=int(c.intermediate_size),
            num_experts=num_experts,
            first_k_dense_replace=first_dense if num_experts else 0,
            **SOFTMAX_ROUTER,
            norm_topk_prob=bool(c.norm_topk_prob),
            num_shared_experts=1 if shared else 0,
            shared_expert_intermediate_size=shared or None,
            shared_expert_gate=bool(shared),
            router_aux_loss_coef=float(c.router_aux_loss_coef),
        )
        if num_experts:
            fields.update(
                num_experts_per_tok=int(c.num_experts_per_tok), moe_intermediate_size=int(c.moe_intermediate_size)
            )
        p.raise_if_any()
        fields.update(self.check_overrides(overrides))
        return HybridConfig(**fields)

    def mixer_groups(self, cfg: HybridConfig, i: int) -> list[TensorGroup]:
        if cfg.layer_pattern[i] == "A":
            names = ["q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"]
            return [ident(f"layers.{i}.self_attn.{n}.weight", f"model.layers.{i}.self_attn.{n}.weight") for n in names]
        h, f = f"layers.{i}.linear_attn", f"model.layers.{i}.linear_attn"
        names = [
            "conv1d.weight",
            "in_proj_qkvz.weight",
            "in_proj_ba.weight",
            "dt_bias",
            "A_log",
            "norm.weight",
            "out_proj.weight",
        ]
        return [ident(f"{h}.{n}", f"{f}.{n}") for n in names]
