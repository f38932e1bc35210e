"""Multi-head Latent Attention (DeepSeek-V3 MLA; Ling 3.0's gated variant).

    q            = q_b_proj(q_a_layernorm(q_a_proj x))        (or q_proj x without a q LoRA)
    [c, k_rot]   = kv_a_proj_with_mqa x                       c: kv_lora_rank latent, k_rot shared by heads
    [k_nope, v]  = kv_b_proj(kv_a_layernorm c)
    q_rot, k_rot rotated by RoPE at the row's original position
    o            = attention([q_nope, q_rot], [k_nope, k_rot], v), scale (nope + rope)^-1/2
    out          = o_proj(o * sigmoid(g_proj x))               (gate only with mla_output_gate;
                                                                per head with mla_head_gate)
    mla_rope=False skips the rotation (Kimi Linear's NoPE MLA); mla_norm_eps sets the latent norms' eps.

Projections and RoPE run once per row; only the attention core sees the tree (through the
context). Shapes: x_TD; q/k_THD with D = nope + rope; v_THE with E = v_head_dim.
"""

from __future__ import annotations

import torch
from torch import nn

from harts.models.config import HybridConfig
from harts.models.execution.base import RowContext
from harts.models.layers.norms import RMSNorm
from harts.models.layers.rope import apply_rope, mla_key_value
from harts.models.layers.spec import MixerSpec, TensorParallelPlan, all_linears
from harts.models.recompute import run_core

__all__ = ["SPEC", "MultiheadLatentAttention", "attention_heads_cp", "attention_heads_divisor"]


class MultiheadLatentAttention(nn.Module):
    def __init__(self, config: HybridConfig) -> None:
        super().__init__()
        d = config.hidden_size
        self.num_heads = h = config.num_attention_heads
        self.nope, self.rope_dim, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.qk_head_dim = self.nope + self.rope_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.rope_theta = config.rope_theta
        self.rope_interleave = config.rope_interleave
        eps = config.rms_norm_eps if config.mla_norm_eps is None else config.mla_norm_eps
        self.use_rope = config.mla_rope
        self.head_gate = config.mla_head_gate
        if config.q_lora_rank is None:
            self.q_proj = nn.Linear(d, h * self.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(d, config.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, eps)
            self.q_b_proj = nn.Linear(config.q_lora_rank, h * self.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, self.kv_lora_rank + self.rope_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, eps)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, h * (self.nope + self.v_dim), bias=False)
        gate_dim = h if self.head_gate else h * self.v_dim
        self.g_proj = nn.Linear(d, gate_dim, bias=False) if config.mla_output_gate else None
        self.o_proj = nn.Linear(h * self.v_dim, d, bias=False)
        self.scaling = self.qk_head_dim**-0.5

    def forward(self, x_TD: torch.Tensor, ctx: RowContext) -> torch.Tensor:
        t, h = x_TD.shape[0], self.num_heads
        if hasattr(self, "q_proj"):
            q = self.q_proj(x_TD)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x_TD)))
        query = q.reshape(t, h, self.qk_head_dim)  # [nope | rope] per head
        c, k_rot = torch.split(self.kv_a_proj_with_mqa(x_TD), [self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(c)).reshape(t, h, self.nope + self.v_dim)
        cos = sin = None
        if self.use_rope:
            cos, sin = ctx.rope(self.rope_dim, self.rope_theta, x_TD.dtype)
            # the query's rope dims rotated in place of a split and a concatenation
            query = apply_rope(query, cos, sin, interleaved=self.rope_interleave, rotary_last=True)
        # keys (the shared rotary key rotated, behind every head's k_nope) and contiguous values
        # in one pass each way
        # (k_rot made contiguous, 2 x R bytes a row: as a strided slice it would need its own
        # compiled variant beside the padded, contiguous one of microbatches below MIN_ROWS)
        k_rot = k_rot.contiguous()[:, None, :]
        key, value = mla_key_value(kv, k_rot, cos, sin, nope=self.nope, interleaved=self.rope_interleave)
        o = run_core(ctx, self, "attention", ctx.attention, query, key, value, scale=self.scaling)
        o = o.reshape(t, h * self.v_dim)
        if self.g_proj is not None and self.head_gate:  # one gate per head (Ling 3.0)
            o = (o.reshape(t, h, self.v_dim) * torch.sigmoid(self.g_proj(x_TD))[..., None]).reshape(t, -1)
        elif self.g_proj is not None:
            o = o * torch.sigmoid(self.g_proj(x_TD))
        return self.o_proj(o)


# ---------------------------------------------------------------------------------- the spec
def _parameters(c: HybridConfig) -> int:
    d, h = c.hidden_size, c.num_attention_heads
    qk, ql, kvl = c.qk_nope_head_dim + c.qk_rope_head_dim, c.q_lora_rank, c.kv_lora_rank
    q = d * h * qk if ql is None else d * ql + ql + ql * h * qk
    kv = d * (kvl + c.qk_rope_head_dim) + kvl + kvl * h * (c.qk_nope_head_dim + c.v_head_dim)
    gate = (d * (h if c.mla_head_gate else h * c.v_head_dim)) if c.mla_output_gate else 0
    return q + kv + gate + h * c.v_head_dim * d


def _row_elements(c: HybridConfig, dev: str) -> tuple[float, float]:
    d, h = c.hidden_size, c.num_attention_heads
    qk, hv = c.qk_nope_head_dim + c.qk_rope_head_dim, h * c.v_head_dim
    ql = 3 * c.q_lora_rank if c.q_lora_rank is not None else h * qk
    outside = 3 * d + ql + 3 * hv + 3 * c.kv_lora_rank + 3 * c.qk_rope_head_dim + 3
    # the CPU kernel pads q, k, v and the output to one head dim
    width = max(qk, c.v_head_dim) if dev == "cpu" else None
    core = 4 * h * width + 4 * h if width else 2 * h * qk + 2 * hv + 4 * h
    return outside, core


def _view_row_elements(c: HybridConfig, dev: str) -> int:
    """A K and V per head; the CPU kernel pads both to one head dim."""
    qk, v = c.qk_nope_head_dim + c.qk_rope_head_dim, c.v_head_dim
    return c.num_attention_heads * (2 * max(qk, v) if dev == "cpu" else qk + v)


def _core_flops(c: HybridConfig) -> tuple[float, float]:
    """QK^T and PV per visible pair: 2 H (d_qk + d_v)."""
    return 2 * c.num_attention_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim + c.v_head_dim), 0.0


def _tp_plan(mixer: nn.Module, tp: int) -> TensorParallelPlan:
    assert isinstance(mixer, MultiheadLatentAttention)
    mixer.num_heads //= tp
    plan: dict[str, str | tuple[str, tuple[str, ...]]] = {"kv_b_proj": "columns", "o_proj": "rows"}
    plan["q_proj" if hasattr(mixer, "q_proj") else "q_b_proj"] = "columns"
    if mixer.g_proj is not None:
        plan["g_proj"] = "columns"
    return plan, None


def attention_heads_divisor(c: HybridConfig) -> list[tuple[str, int]]:
    """What tensor parallelism splits in every full-attention mixer: the query heads."""
    return [("attention heads (num_attention_heads)", c.num_attention_heads)]


def attention_heads_cp(c: HybridConfig, tp: int) -> list[tuple[str, int, str]]:
    """What context parallelism splits in every full-attention mixer: one tp rank's query heads."""
    return [("attention heads (num_attention_heads)", c.num_attention_heads // tp, "divides")]


SPEC = MixerSpec(
    letter="M",
    family="full",
    description="Multi-head Latent Attention",
    module=MultiheadLatentAttention,
    attribute="self_attn",
    core_region="attention",
    parameters=_parameters,
    row_elements=_row_elements,
    view_row_elements=_view_row_elements,
    core_flops=_core_flops,
    attention_dims=lambda c: (c.qk_nope_head_dim + c.qk_rope_head_dim, c.v_head_dim, False),
    tp_plan=_tp_plan,
    tp_divisors=attention_heads_divisor,
    cp_divisors=attention_heads_cp,
    lora_targets=all_linears,
)
