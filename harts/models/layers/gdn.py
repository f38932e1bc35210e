"""Gated DeltaNet (GDN) layer, Qwen3-Next semantics.

    [q k v z] = in_proj_qkvz x     grouped per key head: (q: K, k: K, v: r*V, z: r*V), r = Hv / Hk
    [b a]     = in_proj_ba x       grouped per key head: (b: r, a: r)
    q, k, v   = conv_silu(cat(q, k, v))      one depthwise conv over the concatenation
    g         = -exp(A_log) * softplus(a + dt_bias)     scalar log-decay per value head
    beta      = sigmoid(b)
    o         = chunk_gated_delta_rule(l2norm q, l2norm k, v, g, beta)   (q, k repeated to Hv heads)
    out       = out_proj(rmsnorm(o) * weight * silu(z))

Shapes: x_TD; q/k_THK (H = Hv after repeat); v_THV; g_TH; beta_TH.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from harts.models.config import HybridConfig
from harts.models.execution.base import RowContext
from harts.models.layers.kda import ShortConvolution, delta_rule_flops, linear_heads_divisor
from harts.models.layers.norms import RMSNormGated
from harts.models.layers.spec import (
    MixerSpec,
    TensorParallelPlan,
    all_linears,
    chunk_state_elements,
    fla_core_row_elements,
)
from harts.models.recompute import run_core
from harts.ops.qkv_norm import split_l2norm_qkv, split_l2norm_qkv_reference

__all__ = ["SPEC", "GatedDeltaNet"]


class GatedDeltaNet(nn.Module):
    """GDN (module docstring); its one fast path, the kernel record's "fused_qkv_norm"
    (``ctx.backends``), is KDA's: the split and l2 norms in one kernel where it applies."""

    def __init__(self, config: HybridConfig) -> None:
        super().__init__()
        d = config.hidden_size
        self.num_k_heads = hk = config.linear_num_key_heads
        self.num_v_heads = hv = config.linear_num_value_heads
        self.head_k_dim = k = config.linear_key_head_dim
        self.head_v_dim = v = config.linear_value_head_dim
        self.key_dim, self.value_dim = hk * k, hv * v
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv1d = ShortConvolution(self.conv_dim, config.linear_conv_kernel_dim)
        self.in_proj_qkvz = nn.Linear(d, 2 * self.key_dim + 2 * self.value_dim, bias=False)
        self.in_proj_ba = nn.Linear(d, 2 * hv, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(hv))
        self.A_log = nn.Parameter(torch.empty(hv).uniform_(1, 16).log())
        self.norm = RMSNormGated(v, eps=config.rms_norm_eps, activation="silu")
        self.out_proj = nn.Linear(self.value_dim, d, bias=False)

    def forward(self, x_TD: torch.Tensor, ctx: RowContext) -> torch.Tensor:
        t = x_TD.shape[0]
        hk, hv, k, v = self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim
        r = hv // hk
        qkvz = self.in_proj_qkvz(x_TD).reshape(t, hk, 2 * k + 2 * r * v)
        q, kk, vv, z = torch.split(qkvz, [k, k, r * v, r * v], dim=-1)
        ba = self.in_proj_ba(x_TD).reshape(t, hk, 2 * r)
        b, a = torch.split(ba, [r, r], dim=-1)
        mixed = torch.cat([q.reshape(t, -1), kk.reshape(t, -1), vv.reshape(t, -1)], dim=-1)
        mixed = ctx.short_conv(mixed, self.conv1d.weight_DW, None, "silu")
        split = split_l2norm_qkv if ctx.backends.fast("fused_qkv_norm") else split_l2norm_qkv_reference
        # the linear attention's input rows gathered by the split itself (compact execution)
        rows = ctx.la_input_rows()
        q, kk, vv = split(mixed, hk, k, hv, v, rows=rows)
        if r > 1:
            q = q.repeat_interleave(r, dim=1)
            kk = kk.repeat_interleave(r, dim=1)
        beta = torch.sigmoid(b.reshape(t, hv))
        g = -self.A_log.exp() * F.softplus(a.reshape(t, hv) + self.dt_bias)
        kw = {} if rows is None else {"qkv_gathered": True}
        o = run_core(ctx, self, "linear_attention", ctx.linear_attention, q, kk, vv, g, beta, **kw)
        o = self.norm(o, z.reshape(t, hv, v))
        return self.out_proj(o.reshape(t, hv * v))


# ---------------------------------------------------------------------------------- the spec
def _parameters(c: HybridConfig) -> int:
    d, w = c.hidden_size, c.linear_conv_kernel_dim
    hk, hv, k, v = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
    conv = 2 * hk * k + hv * v
    return w * conv + d * (conv + hv * v) + d * 2 * hv + 2 * hv + v + hv * v * d


def _row_elements(c: HybridConfig, dev: str) -> tuple[float, float]:
    d, h, k, v, b = (
        c.hidden_size,
        c.linear_num_value_heads,
        c.linear_key_head_dim,
        c.linear_value_head_dim,
        c.chunk_size,
    )
    hk = c.linear_num_key_heads
    m = 2 * hk * k + h * v
    outside = 6 * m + (2 * hk * k + 2 * h * v) + 3 * h * k + 4 * h * v + 3 * d + 10 * h
    if dev != "cpu":
        return outside, fla_core_row_elements(h, k, v, b)
    return outside, 8 * h * k + 5 * h * v + 7 * h * b + chunk_state_elements(h, k, v, b) + 30


def _tp_plan(mixer: nn.Module, tp: int) -> TensorParallelPlan:
    assert isinstance(mixer, GatedDeltaNet)
    blocks = (mixer.key_dim, mixer.key_dim, mixer.value_dim)
    mixer.num_k_heads //= tp
    mixer.num_v_heads //= tp
    plan = {"in_proj_qkvz": "columns", "in_proj_ba": "columns", "out_proj": "rows", "": ("heads", ("A_log", "dt_bias"))}
    return plan, blocks  # type: ignore[return-value]


def _tp_divisors(c: HybridConfig) -> list[tuple[str, int]]:
    key_heads = ("linear-attention key heads (linear_num_key_heads)", c.linear_num_key_heads)
    return [*linear_heads_divisor(c), key_heads]


def _cp_divisors(c: HybridConfig, tp: int) -> list[tuple[str, int, str]]:
    hk, hv = c.linear_num_key_heads // tp, c.linear_num_value_heads // tp
    kd, vd = c.linear_key_head_dim, c.linear_value_head_dim
    return [
        ("linear-attention heads (linear_num_value_heads)", hv, "divides"),
        ("GDN conv channels", 2 * hk * kd + hv * vd, "divides"),
    ]


SPEC = MixerSpec(
    letter="G",
    family="linear",
    description="Gated DeltaNet",
    module=GatedDeltaNet,
    attribute="linear_attn",
    core_region="linear_attention",
    parameters=_parameters,
    row_elements=_row_elements,
    view_row_elements=lambda c, dev: 0,
    core_flops=delta_rule_flops,
    attention_dims=lambda c: None,
    tp_plan=_tp_plan,
    tp_divisors=_tp_divisors,
    cp_divisors=_cp_divisors,
    lora_targets=all_linears,
)
