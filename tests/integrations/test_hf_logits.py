"""harts vs transformers' own forward on tiny random BailingHybrid, Qwen3-Next, Kimi Linear and Qwen3.5.

transformers' CPU reference paths cast to float32 internally (RMSNorm statistics, routers,
the chunked KDA / gated-delta-rule cores, eager softmax), so a float64 comparison would only
measure those casts; every comparison here is float32 at <= 1e-4 relative to the logit scale.
Compact mode (forks at B-1, B, B+1, 2B+1, deep handoff chains) is checked against
transformers' per-trajectory log-probs of the same weights.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import torch  # noqa: E402

from harts.integrations.hf import from_hf  # noqa: E402
from tests.integrations._hf import (  # noqa: E402
    batch_of,
    hf_logprobs,
    make_hf_model,
    max_rel_logit_diff,
    trajectories,
)

B = 8
TOL = 1e-4

VARIANTS = [
    ("bailing_hybrid", {}),  # safe gate, q LoRA, group routing, shared expert, 1 dense layer
    (
        "bailing_hybrid",
        dict(
            kda_safe_gate=False,
            q_lora_rank=None,
            tie_word_embeddings=True,
            first_k_dense_replace=2,
            n_shared_experts=2,
            norm_topk_prob=False,
        ),
    ),
    ("qwen3_next", {}),  # GDN r=2, gated GQA with partial RoPE, gated shared expert
    (
        "qwen3_next",
        dict(
            norm_topk_prob=False,
            mlp_only_layers=[0],
            linear_num_key_heads=2,
            rope_parameters={"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.5},
        ),
    ),
    ("kimi_linear", {}),  # low-rank gates, NoPE MLA, group routing
    ("kimi_linear", dict(q_lora_rank=12, mlp_layer_types=["dense", "dense", "sparse", "sparse"], n_group=1)),
    ("qwen3_next", dict(num_experts_per_tok=1)),  # top-1 with normalized top-k: weight 1
    ("qwen3_5_text", {}),  # separate GDN projections Hk=2 Hv=4, mrope sections [2, 1, 1] on 8 rotary dims
    (
        "qwen3_5_text",
        dict(
            tie_word_embeddings=True,
            linear_num_key_heads=1,
            linear_num_value_heads=2,
            head_dim=8,
            rope_parameters={"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.25},
        ),
    ),
    ("qwen3_5_moe_text", {}),  # experts on every layer, gated shared expert
    ("qwen3_5_moe_text", dict(num_experts_per_tok=1)),
    ("qwen3_5", {}),  # the VL model's language model
    ("qwen3_5_moe", dict(tie_word_embeddings=True)),
]


def _ids(v):
    if not v[1]:
        return f"{v[0]}-default"
    return f"{v[0]}-top1" if v[1].get("num_experts_per_tok") == 1 else f"{v[0]}-variant"


@pytest.mark.parametrize("model_type,kw", VARIANTS, ids=[_ids(v) for v in VARIANTS])
def test_trajectory_logits_match_transformers(model_type, kw):
    hf = make_hf_model(model_type, seed=3, **kw)
    model = from_hf(hf, chunk_size=B)
    assert model.config.dtype == "float32"
    trajs = trajectories([1, 5, B - 1, B, B + 1, 3 * B + 3], seed=1)
    assert max_rel_logit_diff(hf, model, trajs) <= TOL


def _tree_trajectories(seed: int) -> list[list[int]]:
    """Forks at B-1, B, B+1 and 2B+1 off one base, plus a chain of six nested handoffs."""
    base = trajectories([3 * B + 5], seed=seed)[0]
    extra = trajectories([40] * 12, seed=seed + 1)
    out = [base]
    for i, (p, n) in enumerate([(B - 1, 5), (B, B + 3), (B + 1, 2), (2 * B + 1, 7)]):
        tail = extra[i][:n]
        tail[0] = (base[p] + 1) % 64 if p < len(base) else tail[0]
        out.append(base[:p] + tail)
    chain = trajectories([6 * B], seed=seed + 2)[0]
    out.append(chain)
    for i, p in enumerate([3, B + 2, 2 * B - 1, 3 * B + 3, 4 * B + 1, 5 * B + 2]):
        tail = extra[4 + i][: 6 * B - p]
        tail[0] = (chain[p] + 1) % 64
        chain = chain[:p] + tail
        out.append(chain)
    return out


@pytest.mark.parametrize(
    "model_type", ["bailing_hybrid", "qwen3_next", "kimi_linear", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_5_moe"]
)
def test_compact_logprobs_match_transformers(model_type):
    hf = make_hf_model(model_type, seed=5)
    model = from_hf(hf, chunk_size=B)
    trajs = _tree_trajectories(seed=7)
    batch = batch_of(trajs)
    with torch.no_grad():
        ours = model(batch, mode="compact").logprobs.double()
        traj = model(batch, mode="trajectory").logprobs.double()
    ref = hf_logprobs(hf, trajs)
    assert ours.shape == ref.shape
    scale = max(1.0, float(ref.abs().max()))
    assert float((ours - ref).abs().max()) <= TOL * scale
    assert float((ours - traj).abs().max()) <= TOL * scale
