"""Model presets by name, with the real shapes of the hybrid models people train.

``HybridConfig.preset("qwen3_next_80b_a3b")`` is Qwen3-Next-80B-A3B's architecture at full
size (random init); ``HybridConfig.preset(name, layers=N)`` keeps its first N decoder layers, so
the real widths, heads and experts run at a depth that fits one device. Every field here is
what ``harts.integrations.hf`` derives from the model's published ``config.json`` (the Hugging
Face repository is named above each); fields the architecture does not use keep
``HybridConfig``'s defaults, as the adapters leave them.

This module is data only (``harts.models.config`` reads it); ``tiny`` and ``ling3_tiny`` are
``HybridConfig``'s own classmethods.
"""

from __future__ import annotations

from typing import Any

__all__ = ["MODEL_FIELDS", "SOFTMAX_ROUTER"]

#: Qwen3-Next / Qwen3.5 semantics that no config.json field spells (transformers
#: ``modeling_qwen3_next``, ``modeling_qwen3_5``): RMSNorm weights are zero-centred
#: (``1 + weight``), and the GQA output is gated by ``sigmoid`` of a second query half
_QWEN_SEMANTICS: dict[str, Any] = dict(norm_unit_offset=True, attn_output_gate=True, hidden_act="silu")

#: the router fields of a plain softmax top-k (Qwen3-Next, Qwen3.5, Granite 4.0-H): no correction
#: bias, no expert groups, the routed output not rescaled
SOFTMAX_ROUTER: dict[str, Any] = dict(
    router_score="softmax", router_bias=False, routed_scaling_factor=1.0, n_group=1, topk_group=1
)

#: the Qwen MoE router (``modeling_qwen3_next`` / ``modeling_qwen3_5_moe``): a softmax with no
#: correction bias and no expert groups, the routed output not rescaled, and one shared expert
#: scaled by sigmoid(shared_expert_gate x)
_QWEN_ROUTER: dict[str, Any] = dict(**SOFTMAX_ROUTER, num_shared_experts=1, shared_expert_gate=True)

#: a dense Qwen3.5: one SwiGLU FFN per layer, no experts
_QWEN_DENSE: dict[str, Any] = dict(num_experts=0, first_k_dense_replace=0, num_shared_experts=0)


#: Qwen3.5-9B's text model: 8 x (3 Gated DeltaNet + 1 gated GQA) layers, dense FFN.
#: From Qwen/Qwen3.5-9B config.json, text_config (transformers' Qwen3_5TextConfig defaults are
#: this shape too): full_attention_interval 4, rope_parameters rope_theta 1e7 with
#: partial_rotary_factor 0.25 (mrope_section [11, 11, 10] reduces to plain RoPE for text)
QWEN3_5_9B: dict[str, Any] = dict(
    **_QWEN_SEMANTICS,
    **_QWEN_DENSE,
    layer_pattern="GGGA" * 8,
    vocab_size=248_320,
    hidden_size=4096,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    dtype="bfloat16",
    linear_conv_kernel_dim=4,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=256,
    partial_rotary_factor=0.25,
    rope_theta=10_000_000.0,
    intermediate_size=12_288,
)


#: Qwen3.5-27B's text model: 16 x (3 Gated DeltaNet + 1 gated GQA) layers, dense FFN; 48 value
#: heads over 16 key heads in the DeltaNet (the other Qwen presets have 32).
#: From Qwen/Qwen3.5-27B config.json, text_config: full_attention_interval 4, rope_theta 1e7,
#: partial_rotary_factor 0.25
QWEN3_5_27B: dict[str, Any] = dict(
    **_QWEN_SEMANTICS,
    **_QWEN_DENSE,
    layer_pattern="GGGA" * 16,
    vocab_size=248_320,
    hidden_size=5120,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    dtype="bfloat16",
    linear_conv_kernel_dim=4,
    linear_num_key_heads=16,
    linear_num_value_heads=48,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    num_attention_heads=24,
    num_key_value_heads=4,
    head_dim=256,
    partial_rotary_factor=0.25,
    rope_theta=10_000_000.0,
    intermediate_size=17_408,
)


#: Qwen3.5-35B-A3B's text model: 10 x (3 Gated DeltaNet + 1 gated GQA) layers, every FFN a
#: 256-expert top-8 MoE with one sigmoid-gated shared expert.
#: From Qwen/Qwen3.5-35B-A3B config.json, text_config (transformers' Qwen3_5MoeTextConfig defaults
#: are this shape too): full_attention_interval 4, rope_theta 1e7, partial_rotary_factor 0.25.
#: It has no intermediate_size (no layer is dense): harts.integrations.hf.qwen3_5 fills the
#: unused field with moe_intermediate_size. The router renormalizes its top-k always.
QWEN3_5_35B_A3B: dict[str, Any] = dict(
    **_QWEN_SEMANTICS,
    **_QWEN_ROUTER,
    layer_pattern="GGGA" * 10,
    vocab_size=248_320,
    hidden_size=2048,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    dtype="bfloat16",
    linear_conv_kernel_dim=4,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    num_attention_heads=16,
    num_key_value_heads=2,
    head_dim=256,
    partial_rotary_factor=0.25,
    rope_theta=10_000_000.0,
    intermediate_size=512,
    num_experts=256,
    num_experts_per_tok=8,
    moe_intermediate_size=512,
    first_k_dense_replace=0,
    norm_topk_prob=True,
    shared_expert_intermediate_size=512,
    router_aux_loss_coef=0.001,
)


#: Qwen3-Next-80B-A3B: 12 x (3 Gated DeltaNet + 1 gated GQA) layers, every FFN a 512-expert top-10
#: MoE with one sigmoid-gated shared expert.
#: From Qwen/Qwen3-Next-80B-A3B-Instruct config.json: full_attention_interval 4, rope_theta 1e7,
#: partial_rotary_factor 0.25, decoder_sparse_step 1 with mlp_only_layers [] (every layer
#: MoE; intermediate_size 5120 is declared but no layer uses it), norm_topk_prob true
QWEN3_NEXT_80B_A3B: dict[str, Any] = dict(
    **_QWEN_SEMANTICS,
    **_QWEN_ROUTER,
    layer_pattern="GGGA" * 12,
    vocab_size=151_936,
    hidden_size=2048,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    dtype="bfloat16",
    linear_conv_kernel_dim=4,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    num_attention_heads=16,
    num_key_value_heads=2,
    head_dim=256,
    partial_rotary_factor=0.25,
    rope_theta=10_000_000.0,
    intermediate_size=5120,
    num_experts=512,
    num_experts_per_tok=10,
    moe_intermediate_size=512,
    first_k_dense_replace=0,
    norm_topk_prob=True,
    shared_expert_intermediate_size=512,
    router_aux_loss_coef=0.001,
)


#: Kimi-Linear-48B-A3B: 27 layers, KDA with MLA at every fourth layer and the last (KKKM x 6 +
#: KKM), a dense first FFN, then 256-expert top-8 MoE with one shared expert.
#: From moonshotai/Kimi-Linear-48B-A3B-Instruct config.json: linear_attn_config full_attn_layers
#: [4, 8, 12, 16, 20, 24, 27] (1-based; the other 20 are kda_layers), num_heads 32, head_dim
#: 128, short_conv_kernel_size 4; mla_use_nope true (rope_theta 10000 is not applied),
#: q_lora_rank null; first_k_dense_replace 1; moe_router_activation_func sigmoid,
#: moe_renormalize true, num_expert_group 1, topk_group 1. transformers' KimiLinearConfig
#: builds q_a/kv_a layernorms with eps 1e-6 and a low-rank KDA forget and output gate.
KIMI_LINEAR_48B_A3B: dict[str, Any] = dict(
    layer_pattern="KKKM" * 6 + "KKM",
    vocab_size=163_840,
    hidden_size=2304,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    dtype="bfloat16",
    linear_conv_kernel_dim=4,
    linear_num_key_heads=32,
    linear_num_value_heads=32,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    kda_low_rank_gates=True,
    kda_safe_gate=False,
    num_attention_heads=32,
    num_key_value_heads=32,
    q_lora_rank=None,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    mla_output_gate=False,
    mla_head_gate=False,
    mla_rope=False,
    mla_norm_eps=1e-6,
    hidden_act="silu",
    intermediate_size=9216,
    num_experts=256,
    num_experts_per_tok=8,
    moe_intermediate_size=1024,
    first_k_dense_replace=1,
    num_shared_experts=1,
    shared_expert_gate=False,
    router_score="sigmoid",
    router_bias=True,
    norm_topk_prob=True,
    routed_scaling_factor=2.446,
    n_group=1,
    topk_group=1,
)


#: Nemotron 3 Nano 30B-A3B's block layout (``hybrid_override_pattern``: M Mamba-2, E MoE,
#: * attention): 23 Mamba-2, 23 MoE and 6 attention blocks, one block per decoder layer
_NEMOTRON_3_NANO_BLOCKS = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"

#: Nemotron 3 Nano 30B-A3B (``harts.integrations.hf.nemotron_h``). From
#: nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16 config.json: hidden 2688, vocab 131072, Mamba-2
#: 64 heads x 64 with 8 groups of state 128 and a width-4 conv with bias, GQA 32 heads / 2 kv of
#: 128 without RoPE, 128 relu2 experts (top-6, width 1856) plus one shared expert of 3712, the
#: sigmoid router with correction bias, normalized top-k scaled by 2.5, layer_norm_epsilon 1e-5,
#: untied head. ``chunk_size`` is harts' execution chunk, not a checkpoint field
NEMOTRON_3_NANO_30B_A3B: dict[str, Any] = dict(
    layer_pattern="".join({"M": "S", "*": "A"}.get(b, "-") for b in _NEMOTRON_3_NANO_BLOCKS),
    ffn_pattern="".join("E" if b == "E" else "-" for b in _NEMOTRON_3_NANO_BLOCKS),
    vocab_size=131_072,
    hidden_size=2688,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    dtype="bfloat16",
    linear_conv_kernel_dim=4,
    mamba_num_heads=64,
    mamba_head_dim=64,
    ssm_state_size=128,
    mamba_n_groups=8,
    mamba_conv_bias=True,
    num_attention_heads=32,
    num_key_value_heads=2,
    head_dim=128,
    partial_rotary_factor=0.0,
    attn_output_gate=False,
    attn_qk_norm=False,
    hidden_act="relu2",
    intermediate_size=1856,
    num_experts=128,
    num_experts_per_tok=6,
    moe_intermediate_size=1856,
    first_k_dense_replace=0,
    num_shared_experts=1,
    shared_expert_intermediate_size=3712,
    shared_expert_gate=False,
    router_score="sigmoid",
    router_bias=True,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    n_group=1,
    topk_group=1,
)

#: Granite 4.0-H Small (``harts.integrations.hf.granitemoehybrid``): 40 layers, each a Mamba-2
#: or GQA block and an MoE block with the shared MLP. From ibm-granite/granite-4.0-h-small
#: config.json: hidden 4096, vocab 100352, 36 Mamba-2 and 4 attention layers, GQA 32 heads /
#: 8 kv, 72 experts top-10 of width 768 plus the shared MLP of 1536, mamba_expand 2 (8192
#: channels), mamba_d_state 128, mamba_d_conv 4, tied embeddings. The four attention layers sit
#: at 5, 15, 25 and 35, and the 8192 channels are 128 heads of 64 in one group, as in the
#: Granite 4.0-H family's published configs. Only shapes: Granite's scalings (embedding,
#: residual, attention, logits multipliers) change no shape and come with a loaded checkpoint
GRANITE_4_0_H_SMALL: dict[str, Any] = dict(
    layer_pattern="".join("A" if i % 10 == 5 else "S" for i in range(40)),
    vocab_size=100_352,
    hidden_size=4096,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    dtype="bfloat16",
    linear_conv_kernel_dim=4,
    mamba_num_heads=128,
    mamba_head_dim=64,
    ssm_state_size=128,
    mamba_n_groups=1,
    mamba_conv_bias=True,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    partial_rotary_factor=0.0,
    attn_output_gate=False,
    attn_qk_norm=False,
    hidden_act="silu",
    intermediate_size=1536,
    num_experts=72,
    num_experts_per_tok=10,
    moe_intermediate_size=768,
    first_k_dense_replace=0,
    num_shared_experts=1,
    shared_expert_intermediate_size=1536,
    shared_expert_gate=False,
    norm_topk_prob=True,
    **SOFTMAX_ROUTER,
)


#: preset name -> the ``HybridConfig`` fields of that model (``HybridConfig.preset`` takes the
#: names, with ``tiny`` and ``ling3_tiny``)
MODEL_FIELDS: dict[str, dict[str, Any]] = {
    "qwen3_5_9b": QWEN3_5_9B,
    "qwen3_5_27b": QWEN3_5_27B,
    "qwen3_5_35b_a3b": QWEN3_5_35B_A3B,
    "qwen3_next_80b_a3b": QWEN3_NEXT_80B_A3B,
    "kimi_linear_48b_a3b": KIMI_LINEAR_48B_A3B,
    "nemotron_3_nano_30b_a3b": NEMOTRON_3_NANO_30B_A3B,
    "granite_4_0_h_small": GRANITE_4_0_H_SMALL,
}
