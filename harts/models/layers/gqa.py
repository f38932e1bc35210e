"""Gated grouped-query attention (Qwen3-Next full-attention layer).

    [q, gate] = q_proj x           per head: (q: head_dim, gate: head_dim) when attn_output_gate
    q, k      = q_norm(q), k_norm(k_proj x)    RMSNorm over head_dim (attn_qk_norm; none otherwise)
    q, k      rotated on the first partial_rotary_factor * head_dim dims at the row's position
              (none with partial_rotary_factor 0: Nemotron-H's and Granite 4.0-H's NoPE attention)
    o         = attention(q, k, v_proj x)      G = num_key_value_heads divides H
    out       = o_proj(o * sigmoid(gate))

Shapes: x_TD; q_THD; k/v_TGD.
"""

from __future__ import annotations

import torch
from torch import nn

from harts.models.config import HybridConfig
from harts.models.execution.base import RowContext
from harts.models.layers.mla import attention_heads_cp, attention_heads_divisor
from harts.models.layers.norms import RMSNorm
from harts.models.layers.rope import apply_rope
from harts.models.layers.spec import MixerSpec, TensorParallelPlan, all_linears
from harts.models.recompute import run_core

__all__ = ["SPEC", "GatedAttention"]


class GatedAttention(nn.Module):
    def __init__(self, config: HybridConfig) -> None:
        super().__init__()
        d = config.hidden_size
        self.num_heads = h = config.num_attention_heads
        self.num_kv_heads = g = config.num_key_value_heads
        self.head_dim = hd = config.head_dim
        self.gated = config.attn_output_gate
        self.rotary_dim = int(hd * config.partial_rotary_factor)
        self.rope_theta = config.rope_theta
        self.q_proj = nn.Linear(d, h * hd * (2 if self.gated else 1), bias=False)
        self.k_proj = nn.Linear(d, g * hd, bias=False)
        self.v_proj = nn.Linear(d, g * hd, bias=False)
        self.o_proj = nn.Linear(h * hd, d, bias=False)
        if config.attn_qk_norm:
            self.q_norm = RMSNorm(hd, config.rms_norm_eps, unit_offset=config.norm_unit_offset)
            self.k_norm = RMSNorm(hd, config.rms_norm_eps, unit_offset=config.norm_unit_offset)
        self.scaling = hd**-0.5 if config.attn_scale is None else config.attn_scale

    def forward(self, x_TD: torch.Tensor, ctx: RowContext) -> torch.Tensor:
        t, h, g, hd = x_TD.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qg = self.q_proj(x_TD)
        if self.gated:
            q, gate = torch.chunk(qg.reshape(t, h, 2 * hd), 2, dim=-1)
            gate = gate.reshape(t, h * hd)
        else:
            q, gate = qg.reshape(t, h, hd), None
        k = self.k_proj(x_TD).reshape(t, g, hd)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        v = self.v_proj(x_TD).reshape(t, g, hd)
        if self.rotary_dim:
            cos, sin = ctx.rope(self.rotary_dim, self.rope_theta, x_TD.dtype)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = run_core(ctx, self, "attention", ctx.attention, q, k, v, scale=self.scaling)
        o = o.reshape(t, h * hd)
        if gate is not None:
            o = o * torch.sigmoid(gate)
        return self.o_proj(o)


# ---------------------------------------------------------------------------------- the spec
def _parameters(c: HybridConfig) -> int:
    d, h, hd, g = c.hidden_size, c.num_attention_heads, c.head_dim, c.num_key_value_heads
    norms = 2 * hd if c.attn_qk_norm else 0
    return d * h * hd * (2 if c.attn_output_gate else 1) + 2 * d * g * hd + h * hd * d + norms


def _row_elements(c: HybridConfig, dev: str) -> tuple[float, float]:
    d, h, hd, g = c.hidden_size, c.num_attention_heads, c.head_dim, c.num_key_value_heads
    outside = (2 if c.attn_output_gate else 1) * h * hd + 3 * d + 4 * h * hd + 2 * g * hd + 3 * h + g + 3
    return outside, 2 * h * hd + 2 * g * hd + h


def _tp_plan(mixer: nn.Module, tp: int) -> TensorParallelPlan:
    assert isinstance(mixer, GatedAttention)
    mixer.num_heads //= tp
    mixer.num_kv_heads //= tp
    return {"q_proj": "columns", "k_proj": "columns", "v_proj": "columns", "o_proj": "rows"}, None


def _tp_divisors(c: HybridConfig) -> list[tuple[str, int]]:
    return [*attention_heads_divisor(c), ("key-value heads (num_key_value_heads)", c.num_key_value_heads)]


def _cp_divisors(c: HybridConfig, tp: int) -> list[tuple[str, int, str]]:
    kv = ("key-value heads (num_key_value_heads)", c.num_key_value_heads // tp, "divides_or_multiple")
    return [*attention_heads_cp(c, tp), kv]


SPEC = MixerSpec(
    letter="A",
    family="full",
    description="gated grouped-query attention",
    module=GatedAttention,
    attribute="self_attn",
    core_region="attention",
    parameters=_parameters,
    row_elements=_row_elements,
    view_row_elements=lambda c, dev: 2 * c.num_key_value_heads * c.head_dim,
    core_flops=lambda c: (2 * c.num_attention_heads * 2 * c.head_dim, 0.0),
    attention_dims=lambda c: (c.head_dim, c.head_dim, c.num_key_value_heads != c.num_attention_heads),
    tp_plan=_tp_plan,
    tp_divisors=_tp_divisors,
    cp_divisors=_cp_divisors,
    lora_targets=all_linears,
)
