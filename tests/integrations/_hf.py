"""Tiny random transformers models of the hybrid architectures, and logit helpers.

Every parameter and buffer is perturbed after construction so that no weight sits at an
initial value (all-ones norms, zero-centred Qwen norms, zero correction biases) that could
hide a wrong name, layout or offset.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from harts.tree.batch import RolloutBatch

VOCAB = 64


def bailing_config(**kw: Any) -> Any:
    import transformers

    base = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=2,
        n_shared_experts=1,
        kv_lora_rank=16,
        q_lora_rank=12,
        qk_rope_head_dim=4,
        v_head_dim=8,
        qk_nope_head_dim=8,
        n_group=2,
        topk_group=1,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        num_local_experts=4,
        head_dim=8,
        layer_group_size=2,
        num_mtp_layers=0,
        routed_scaling_factor=2.5,
        pad_token_id=0,
        eos_token_id=1,
    )
    base.update(kw)
    return transformers.BailingHybridConfig(**base)


def qwen3_next_config(**kw: Any) -> Any:
    import transformers

    base = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_num_key_heads=1,
        linear_num_value_heads=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
        num_experts_per_tok=2,
        num_experts=4,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    )
    base.update(kw)
    return transformers.Qwen3NextConfig(**base)


def kimi_linear_config(**kw: Any) -> Any:
    import transformers

    base = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=2,
        kv_lora_rank=16,
        q_lora_rank=None,
        qk_rope_head_dim=4,
        v_head_dim=8,
        qk_nope_head_dim=8,
        num_local_experts=4,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=2.446,
        linear_head_dim=8,
        linear_num_heads=2,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    )
    base.update(kw)
    return transformers.KimiLinearConfig(**base)


def _qwen3_5_text_fields(moe: bool, kw: dict[str, Any]) -> dict[str, Any]:
    """Two key heads of four value heads (the grouped-projection permutation is not the identity),
    rotary dims 8 of 16 in interleaved-mrope sections [2, 1, 1] (T H W T)."""
    base: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
            "mrope_section": [2, 1, 1],
            "mrope_interleaved": True,
        },
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    )
    if moe:
        base.update(moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=4, num_experts_per_tok=2)
    else:
        base.update(intermediate_size=48)
    base.update(kw)
    return base


def qwen3_5_text_config(**kw: Any) -> Any:
    import transformers

    return transformers.Qwen3_5TextConfig(**_qwen3_5_text_fields(False, kw))


def qwen3_5_moe_text_config(**kw: Any) -> Any:
    import transformers

    return transformers.Qwen3_5MoeTextConfig(**_qwen3_5_text_fields(True, kw))


#: a one-block vision tower: the VL models only need one to exist
_VISION = dict(
    depth=1,
    hidden_size=16,
    intermediate_size=16,
    num_heads=2,
    out_hidden_size=32,
    patch_size=2,
    num_position_embeddings=16,
)


def qwen3_5_config(tie_word_embeddings: bool = False, **kw: Any) -> Any:
    """The VL config (``text_config`` nested); ``kw`` go to the language model."""
    import transformers

    text = _qwen3_5_text_fields(False, kw)
    return transformers.Qwen3_5Config(text_config=text, vision_config=_VISION, tie_word_embeddings=tie_word_embeddings)


def qwen3_5_moe_config(tie_word_embeddings: bool = False, **kw: Any) -> Any:
    import transformers

    text = _qwen3_5_text_fields(True, kw)
    return transformers.Qwen3_5MoeConfig(
        text_config=text, vision_config=_VISION, tie_word_embeddings=tie_word_embeddings
    )


def nemotron_h_config(**kw: Any) -> Any:
    """Nemotron 3 Nano's layout at toy size: Mamba-2 and MoE layers around one attention layer
    (``hybrid_override_pattern``: M Mamba-2, E MoE, * attention, - MLP)."""
    import transformers

    base = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        hybrid_override_pattern="MEM*EM-",
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        mamba_num_heads=4,
        mamba_head_dim=8,
        ssm_state_size=8,
        n_groups=2,
        conv_kernel=4,
        chunk_size=8,
        intermediate_size=48,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        moe_shared_expert_intermediate_size=24,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=2.5,
        layer_norm_epsilon=1e-5,
    )
    base.update(kw)
    return transformers.NemotronHConfig(**base)


def granitemoehybrid_config(**kw: Any) -> Any:
    """Granite 4.0-H's layout at toy size: Mamba-2 layers around one NoPE attention layer, MoE
    plus the shared MLP on every layer, every scaling away from 1."""
    import transformers

    base = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=4,
        layer_types=["mamba", "mamba", "attention", "mamba"],
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=16,
        shared_intermediate_size=24,
        num_local_experts=4,
        num_experts_per_tok=2,
        mamba_n_heads=4,
        mamba_d_head=16,
        mamba_d_state=8,
        mamba_n_groups=2,
        mamba_expand=2,
        mamba_chunk_size=8,
        position_embedding_type="nope",
        embedding_multiplier=3.0,
        residual_multiplier=0.5,
        attention_multiplier=0.3,
        logits_scaling=2.5,
        rms_norm_eps=1e-5,
    )
    base.update(kw)
    return transformers.GraniteMoeHybridConfig(**base)


CONFIGS = {
    "bailing_hybrid": bailing_config,
    "qwen3_next": qwen3_next_config,
    "kimi_linear": kimi_linear_config,
    "qwen3_5_text": qwen3_5_text_config,
    "qwen3_5_moe_text": qwen3_5_moe_text_config,
    "qwen3_5": qwen3_5_config,
    "qwen3_5_moe": qwen3_5_moe_config,
    "nemotron_h": nemotron_h_config,
    "granitemoehybrid": granitemoehybrid_config,
}

#: vision-language model types: built as the full VL model (vision tower included)
VL_TYPES = ("qwen3_5", "qwen3_5_moe")


def make_hf_model(model_type: str, seed: int = 0, **kw: Any) -> Any:
    """A random transformers causal LM in float32, eager attention, eval mode, all weights perturbed
    (for a VL model type the whole image-text-to-text model)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    torch.manual_seed(seed)
    cfg = CONFIGS[model_type](**kw)
    cfg._attn_implementation = "eager"
    if model_type in VL_TYPES:
        cfg.text_config._attn_implementation = "eager"
        model = AutoModelForImageTextToText.from_config(cfg).eval()
    else:
        model = AutoModelForCausalLM.from_config(cfg).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if not t.is_floating_point() or "inv_freq" in name:
                continue
            if "A_log" in name:  # keep decays in the trained range
                t.copy_(torch.empty(t.shape).uniform_(0.0, 1.5, generator=g))
            elif t.ndim <= 1 or "norm" in name or "bias" in name:
                t.add_(0.3 * torch.randn(t.shape, generator=g))
            elif "conv1d" in name:
                t.copy_(0.5 * torch.randn(t.shape, generator=g))
            else:
                t.copy_(0.2 * torch.randn(t.shape, generator=g))
    return model


def trajectories(lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, n).tolist() for n in lengths]


def batch_of(trajs: list[list[int]]) -> RolloutBatch:
    return RolloutBatch.from_trajectories(trajs, advantages=[0.0] * len(trajs))


def harts_trajectory_logits(model: Any, batch: RolloutBatch) -> torch.Tensor:
    """[S, V] logits of a harts model run trajectory-wise (captured after the final norm)."""
    cap: dict[str, torch.Tensor] = {}
    hook = model.norm.register_forward_hook(lambda mod, inp, out: cap.__setitem__("h", out))
    try:
        with torch.no_grad():
            model(batch, mode="trajectory")
    finally:
        hook.remove()
    with torch.no_grad():  # the head divides by Granite's logits_scaling (1.0 elsewhere)
        return cap["h"] @ model.lm_head_weight.T / model.config.logits_scaling


def hf_logits(hf_model: Any, traj: list[int]) -> torch.Tensor:
    """[len, V] transformers logits of one trajectory (its own forward, batch of one)."""
    with torch.no_grad():
        return hf_model(torch.tensor([traj])).logits[0]


def hf_logits_many(hf_model: Any, trajs: list[list[int]]) -> list[torch.Tensor]:
    """Each trajectory's transformers logits from ONE right-padded forward.

    The models are causal (attention, conv and recurrences only look back; routing is per
    token), so padding after a trajectory cannot change its logits; no mask is passed.
    """
    n = max(len(t) for t in trajs)
    ids = torch.tensor([t + [0] * (n - len(t)) for t in trajs])
    with torch.no_grad():
        logits = hf_model(ids).logits
    return [logits[j, : len(t)] for j, t in enumerate(trajs)]


def hf_logprobs(hf_model: Any, trajs: list[list[int]]) -> torch.Tensor:
    """Per-trajectory next-token log-probs concatenated in batch order ([S - N])."""
    out = []
    for t, lg in zip(trajs, hf_logits_many(hf_model, trajs)):
        lp = torch.log_softmax(lg.double(), dim=-1)
        out.append(lp[:-1].gather(1, torch.tensor(t[1:])[:, None])[:, 0])
    return torch.cat(out)


def max_rel_logit_diff(hf_model: Any, model: Any, trajs: list[list[int]]) -> float:
    """max |harts - transformers| over every logit, relative to transformers' logit scale."""
    batch = batch_of(trajs)
    ours = harts_trajectory_logits(model, batch)
    off = batch.offsets
    worst = 0.0
    for j, ref in enumerate(hf_logits_many(hf_model, trajs)):
        worst = max(worst, float((ours[off[j] : off[j + 1]] - ref).abs().max() / ref.abs().max()))
    return worst
