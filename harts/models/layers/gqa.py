"""Gated grouped-query attention (Qwen3-Next full-attention layer).

    [q, gate] = q_proj x           per head: (q: head_dim, gate: head_dim) when attn_output_gate
    q, k      = q_norm(q), k_norm(k_proj x)    RMSNorm over head_dim
    q, k      rotated on the first partial_rotary_factor * head_dim dims at the row's position
    o         = attention(q, k, v_proj x)      G = num_key_value_heads divides H
    out       = o_proj(o * sigmoid(gate))

Shapes: x_TD; q_THD; k/v_TGD.
"""

from __future__ import annotations

import torch
from torch import nn

from harts.models.config import HybridConfig
from harts.models.execution.base import RowContext
from harts.models.layers.norms import RMSNorm
from harts.models.layers.rope import apply_rope
from harts.models.recompute import run_core

__all__ = ["GatedAttention"]


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
        self.q_norm = RMSNorm(hd, config.rms_norm_eps, unit_offset=config.norm_unit_offset)
        self.k_norm = RMSNorm(hd, config.rms_norm_eps, unit_offset=config.norm_unit_offset)
        self.scaling = hd**-0.5

    def forward(self, x_TD: torch.Tensor, ctx: RowContext) -> torch.Tensor:
        t, h, g, hd = x_TD.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qg = self.q_proj(x_TD)
        if self.gated:
            q, gate = torch.chunk(qg.reshape(t, h, 2 * hd), 2, dim=-1)
            gate = gate.reshape(t, h * hd)
        else:
            q, gate = qg.reshape(t, h, hd), None
        q = self.q_norm(q)
        k = self.k_norm(self.k_proj(x_TD).reshape(t, g, hd))
        v = self.v_proj(x_TD).reshape(t, g, hd)
        cos, sin = ctx.rope(self.rotary_dim, self.rope_theta, x_TD.dtype)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = run_core(ctx, self, "attention", ctx.attention, q, k, v, scale=self.scaling)
        o = o.reshape(t, h * hd)
        if gate is not None:
            o = o * torch.sigmoid(gate)
        return self.o_proj(o)
