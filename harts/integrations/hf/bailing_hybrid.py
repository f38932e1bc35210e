"""BailingHybrid (Ling 3.0) <-> harts: KDA (K) + gated MLA (M) + MoE with shared experts.

Semantics honoured (transformers ``modeling_bailing_hybrid``):
    KDA: separate q/k/v projections, ONE depthwise conv over cat(q, k, v) (on disk: q/k/v_conv1d),
         full-rank forget gate ``forget_gate.f_proj`` with the safe gate
         ``kda_lower_bound * sigmoid(exp(A_log) * (f + dt_bias))`` (or softplus without it),
         full-rank output gate ``g_proj`` into a sigmoid-gated RMSNorm; heads = num_attention_heads,
         head dim = linear_head_dim.
    MLA: optional q LoRA, latent norms with eps 1e-6, interleaved RoPE on qk_rope_head_dim dims,
         one sigmoid output gate per head (``g_proj: hidden -> heads``).
    MoE: sigmoid router with e_score_correction_bias, n_group/topk_group group routing, normalized
         top-k, routed_scaling_factor, ``n_shared_experts`` shared experts, dense layers from
         ``mlp_layer_types`` (must be a prefix).

Name map (canonical HF -> harts): ``model.layers.i.self_attn.*`` of a KDA layer ->
``layers.i.linear_attn.*`` (``forget_gate.f_proj`` -> ``f_proj``, ``forget_gate.A_log/dt_bias``
-> ``A_log/dt_bias``, ``conv1d`` [3C,1,w] -> ``q/k/v_conv1d`` [C,1,w] each); everything else keeps
its name without the ``model.`` prefix. On-disk renames follow transformers' conversion mapping.
"""

from __future__ import annotations

from typing import Any

from harts.integrations.hf.base import HFAdapter, Problems, TensorGroup, conv_group, dense_prefix, ident
from harts.models.config import HybridConfig

__all__ = ["BailingHybridAdapter", "mla_groups", "deepseek_moe_fields", "rope_theta_of"]


def rope_theta_of(hf_config: Any, problems: Problems, *, partial_ok: bool = False) -> tuple[float, float]:
    """(rope_theta, partial_rotary_factor) from ``rope_parameters``; only plain RoPE is supported."""
    rp = dict(getattr(hf_config, "rope_parameters", None) or {})
    problems.expect(
        "rope_parameters.rope_type",
        rp.get("rope_type", "default"),
        "default",
        "scaled RoPE (yarn, linear, dynamic, ...) is not implemented",
    )
    theta = float(rp.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))
    partial = float(rp.get("partial_rotary_factor", 1.0))
    if not partial_ok:
        problems.expect("rope_parameters.partial_rotary_factor", partial, 1.0)
    return theta, partial


def deepseek_moe_fields(hf_config: Any, problems: Problems) -> dict[str, Any]:
    """FFN fields of the DeepSeek-V3-style MoE used by BailingHybrid and Kimi Linear."""
    c = hf_config
    L = int(c.num_hidden_layers)
    kinds = list(c.mlp_layer_types)
    bad = sorted(set(kinds) - {"dense", "sparse"})
    if bad:
        problems.add(f"mlp_layer_types: unknown entries {bad}")
    is_moe = [k == "sparse" for k in kinds[:L]]
    first_dense = dense_prefix(is_moe, "mlp_layer_types", problems)
    num_experts = int(c.num_local_experts) if any(is_moe) else 0
    top_k = c.num_experts_per_tok
    if top_k is None:
        problems.add("num_experts_per_tok=None")
        top_k = 1
    problems.expect("hidden_act", c.hidden_act, "silu")
    out = dict(
        hidden_act="silu",
        intermediate_size=int(c.intermediate_size),
        num_experts=num_experts,
        first_k_dense_replace=first_dense if num_experts else 0,
        router_score="sigmoid",
        router_bias=True,
        norm_topk_prob=bool(c.norm_topk_prob),
        routed_scaling_factor=float(c.routed_scaling_factor),
        num_shared_experts=int(c.n_shared_experts),
        shared_expert_gate=False,
    )
    if num_experts:
        out.update(
            num_experts_per_tok=int(top_k),
            moe_intermediate_size=int(c.moe_intermediate_size),
            n_group=int(c.n_group),
            topk_group=int(c.topk_group if c.topk_group is not None else 1),
        )
        n_group = int(c.n_group)
        if n_group > 1 and num_experts // n_group < 2:
            problems.add(f"n_group={c.n_group}: groups of one expert (transformers scores groups by their top-2)")
    return out


def kda_mla_fields(c: Any, p: Problems) -> dict[str, Any]:
    """The HybridConfig fields BailingHybrid and Kimi Linear spell the same way: the K/M layer
    pattern from ``layer_types``, sizes, and the KDA heads (q, k and v share ``linear_num_heads``)."""
    letters = {"linear_attention": "K", "full_attention": "M"}
    types = [str(t) for t in list(c.layer_types)[: c.num_hidden_layers]]
    bad = sorted(set(types) - set(letters))
    if bad:
        p.add(f"layer_types: unknown entries {bad}")
    return dict(
        layer_pattern="".join(letters.get(t, "K") for t in types),
        vocab_size=int(c.vocab_size),
        hidden_size=int(c.hidden_size),
        rms_norm_eps=float(c.rms_norm_eps),
        linear_conv_kernel_dim=int(c.linear_conv_kernel_dim),
        linear_num_key_heads=int(c.linear_num_heads),
        linear_num_value_heads=int(c.linear_num_heads),
        linear_key_head_dim=int(c.linear_head_dim),
        linear_value_head_dim=int(c.linear_head_dim),
    )


def mla_fields(hf_config: Any) -> dict[str, Any]:
    c = hf_config
    return dict(
        num_attention_heads=int(c.num_attention_heads),
        # MLA expands the latent to every head; harts' GQA fields stay consistent but unused
        num_key_value_heads=int(c.num_attention_heads),
        q_lora_rank=None if c.q_lora_rank is None else int(c.q_lora_rank),
        kv_lora_rank=int(c.kv_lora_rank),
        qk_nope_head_dim=int(c.qk_nope_head_dim),
        qk_rope_head_dim=int(c.qk_rope_head_dim),
        v_head_dim=int(c.v_head_dim),
        # transformers builds q_a_layernorm / kv_a_layernorm with the RMSNorm default eps
        mla_norm_eps=1e-6,
    )


def mla_groups(cfg: HybridConfig, i: int) -> list[TensorGroup]:
    h, f = f"layers.{i}.self_attn", f"model.layers.{i}.self_attn"
    names = ["kv_a_proj_with_mqa.weight", "kv_a_layernorm.weight", "kv_b_proj.weight", "o_proj.weight"]
    names += (
        ["q_proj.weight"] if cfg.q_lora_rank is None else ["q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight"]
    )
    if cfg.mla_output_gate:
        names.append("g_proj.weight")
    return [ident(f"{h}.{n}", f"{f}.{n}") for n in names]


def check_common(hf_config: Any, problems: Problems) -> None:
    problems.expect("attention_bias", bool(getattr(hf_config, "attention_bias", False)), False)
    problems.expect(
        "attention_dropout", float(getattr(hf_config, "attention_dropout", 0.0) or 0.0), 0.0, "harts has no dropout"
    )


class BailingHybridAdapter(HFAdapter):
    def __init__(self) -> None:
        super().__init__(
            model_type="bailing_hybrid",
            architecture="BailingHybridForCausalLM",
            checkpoint_renames=[
                (r"^model\.word_embeddings\.", "model.embed_tokens."),
                (r"\.attention\.", ".self_attn."),
                (r"self_attn\.f_proj\.", "self_attn.forget_gate.f_proj."),
                (r"self_attn\.dt_bias$", "self_attn.forget_gate.dt_bias"),
                (r"self_attn\.A_log$", "self_attn.forget_gate.A_log"),
                (r"\.self_attn\.dense\.", ".self_attn.o_proj."),
                (r"\.mlp\.gate\.expert_bias$", ".mlp.gate.e_score_correction_bias"),
            ],
        )
        self.ties_embeddings = False  # transformers keeps a separate lm_head (no _tied_weights_keys)

    def config_from_hf(self, hf_config: Any, **overrides: Any) -> HybridConfig:
        c = hf_config
        p = Problems(self.architecture)
        check_common(c, p)
        theta, _ = rope_theta_of(c, p)
        fields: dict[str, Any] = dict(
            **kda_mla_fields(c, p),
            tie_word_embeddings=self.tie_word_embeddings(c),
            kda_low_rank_gates=False,
            kda_safe_gate=bool(c.kda_safe_gate),
            kda_lower_bound=float(c.kda_lower_bound),
            mla_output_gate=True,
            mla_head_gate=True,
            mla_rope=True,
            rope_interleave=True,
            rope_theta=theta,
            **mla_fields(c),
            **deepseek_moe_fields(c, p),
        )
        p.raise_if_any()
        fields.update(self.check_overrides(overrides))
        return HybridConfig(**fields)

    def num_hidden_layers_on_disk(self, hf_config: Any) -> int:
        return int(hf_config.num_hidden_layers)

    def mixer_groups(self, cfg: HybridConfig, i: int) -> list[TensorGroup]:
        if cfg.layer_pattern[i] == "M":
            return mla_groups(cfg, i)
        h, f = f"layers.{i}.linear_attn", f"model.layers.{i}.self_attn"
        c = cfg.linear_num_value_heads * cfg.linear_key_head_dim
        out = [
            ident(f"{h}.{n}.weight", f"{f}.{n}.weight")
            for n in ("q_proj", "k_proj", "v_proj", "b_proj", "g_proj", "o_norm", "o_proj")
        ]
        out += [
            conv_group(h, f"{f}.conv1d.weight", (c, c, cfg.linear_num_value_heads * cfg.linear_value_head_dim)),
            ident(f"{h}.f_proj.weight", f"{f}.forget_gate.f_proj.weight"),
            ident(f"{h}.A_log", f"{f}.forget_gate.A_log"),
            ident(f"{h}.dt_bias", f"{f}.forget_gate.dt_bias"),
        ]
        return out
