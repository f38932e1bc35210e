"""The HybridConfig fields added for transformers checkpoints hold in BOTH execution modes.

float64, no transformers needed: compact log-probs and every parameter gradient equal the
trajectory-wise ones with full-rank KDA gates + safe gate (Ling 3.0), per-head MLA gates,
NoPE MLA (Kimi Linear) and a separate latent-norm eps, on a tree with forks at B-1, B, B+1.
"""

from __future__ import annotations

import numpy as np
import torch

from harts.models import HybridConfig, HybridLM
from harts.models.execution.base import RowContext
from harts.tree.batch import RolloutBatch

B = 8


def _batch() -> RolloutBatch:
    rng = np.random.default_rng(0)
    base = rng.integers(0, 64, 3 * B + 2).tolist()
    trajs = [base] + [base[:p] + rng.integers(0, 64, n).tolist() for p, n in [(B - 1, 4), (B, B + 2), (B + 1, 3)]]
    return RolloutBatch.from_trajectories(trajs, advantages=rng.normal(size=len(trajs)))


def test_new_fields_compact_equals_trajectory_float64():
    torch.manual_seed(0)
    cfg = HybridConfig.tiny(
        layer_pattern="KMKM",
        chunk_size=B,
        dtype="float64",
        kda_low_rank_gates=False,
        kda_safe_gate=True,
        kda_lower_bound=-3.0,
        mla_head_gate=True,
        mla_rope=False,
        mla_norm_eps=1e-5,
        rope_interleave=True,
    )
    model = HybridLM(cfg)
    names = {n for n, _ in model.named_parameters()}
    assert "layers.0.linear_attn.f_proj.weight" in names and "layers.0.linear_attn.f_a_proj.weight" not in names
    assert model.layers[1].self_attn.g_proj.weight.shape == (cfg.num_attention_heads, cfg.hidden_size)
    assert model.layers[1].self_attn.q_a_layernorm.eps == 1e-5
    batch = _batch()
    outs, grads = [], []
    for mode in ("trajectory", "compact"):
        model.zero_grad()
        lp = model(batch, mode=mode).logprobs
        (lp * torch.linspace(-1, 1, lp.numel(), dtype=lp.dtype)).sum().backward()
        outs.append(lp.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert torch.allclose(outs[0], outs[1], rtol=0, atol=1e-10)
    for n, g in grads[0].items():
        assert torch.allclose(g, grads[1][n], rtol=1e-9, atol=1e-11), n


def test_safe_gate_bounds_the_decay():
    torch.manual_seed(1)
    cfg = HybridConfig.tiny(
        layer_pattern="K",
        chunk_size=B,
        dtype="float64",
        kda_low_rank_gates=False,
        kda_safe_gate=True,
        kda_lower_bound=-2.0,
        num_experts=0,
    )
    layer = HybridLM(cfg).layers[0].linear_attn
    seen = {}

    class Ctx(RowContext):  # the record's defaults: the CPU's kernels
        def short_conv(self, x, w, b, act):
            return torch.nn.functional.silu(x)

        def la_input_rows(self):  # noqa: ANN202 - the rows as they are
            return None

        def linear_attention(self, q, k, v, g, beta, scale=None):
            seen["g"] = g
            return v

    x = 10 * torch.randn(6, cfg.hidden_size, dtype=torch.float64)
    layer(x, Ctx())
    g = seen["g"].detach()
    assert g.shape == (6, cfg.linear_num_value_heads, cfg.linear_key_head_dim)
    # lower_bound * sigmoid(.) lies in [lower_bound, 0] whatever the input scale
    assert bool((g <= 0).all() and (g >= -2.0).all()) and float(g.min()) < -1.0 and float(g.max()) > -1.0
