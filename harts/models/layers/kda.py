"""Kimi Delta Attention (KDA) layer, Kimi Linear / Ling 3.0 semantics.

    q, k, v = conv_silu(q_proj x), conv_silu(k_proj x), conv_silu(v_proj x)   (short convs; the
              SiLU applied by the q / k / v split kernel: ``silu_in_split``)
    g       = -exp(A_log[h]) * softplus(f_b_proj(f_a_proj x) + dt_bias)    per-channel log-decay
              (kda_safe_gate: lower_bound * sigmoid(exp(A_log[h]) * (f + dt_bias)); with
              kda_low_rank_gates=False one full-rank f_proj / g_proj replaces each a/b pair; on
              CUDA fla-core's fused gate computes it: ``fla_gate``)
    beta    = sigmoid(b_proj x)
    o       = chunk_kda(l2norm q, l2norm k, v, g, beta)
    out     = o_proj(rmsnorm(o) * weight * sigmoid(g_b_proj(g_a_proj x)))

On CUDA the three input projections run as one GEMM over their stacked weights
("stacked_qkv", a fast path of the kernel record), and the three short convs, being depthwise,
as one conv over ``[q | k | v]``;
the parameters keep their separate names (``q_proj.weight``, ``q_conv1d.weight`` ``[dim, 1, w]``
etc., as checkpoints have them).
Heads: KDA uses ``H = linear_num_value_heads`` for q, k and v.

Shapes: x_TD; q/k_THK; v_THV; g_THK; beta_TH.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from harts.models.config import HybridConfig
from harts.models.execution.base import RowContext
from harts.models.layers.norms import RMSNormGated
from harts.models.layers.spec import (
    MixerSpec,
    TensorParallelPlan,
    all_linears,
    chunk_state_elements,
    fla_core_row_elements,
)
from harts.models.recompute import run_core
from harts.ops.compiled import cuda_compiled
from harts.ops.qkv_norm import split_l2norm_qkv, split_l2norm_qkv_reference

__all__ = ["SPEC", "KimiDeltaAttention", "ShortConvolution", "fla_gate_applies", "silu_in_split"]


@cuda_compiled
def kda_log_decay(
    f_THK: torch.Tensor, dt_bias_HK: torch.Tensor, A_log_H: torch.Tensor, lower_bound: float | None
) -> torch.Tensor:
    """Per-channel log-decay g [T, H, K] from the gate projection f [T, H, K]:
    ``lower_bound * sigmoid(exp(A_log) * (f + dt_bias))`` (kda_safe_gate) when ``lower_bound`` is
    given, else ``-exp(A_log) * softplus(f + dt_bias)``."""
    f = f_THK + dt_bias_HK
    a = A_log_H.exp()[None, :, None]
    if lower_bound is not None:  # bounded log-decay in (lower_bound, 0)
        return lower_bound * torch.sigmoid(a * f)
    return -a * F.softplus(f)


class ShortConvolution(nn.Module):
    """Holds a depthwise causal conv weight ``[dim, 1, w]`` (the layout of nn.Conv1d / fla) and,
    with ``bias`` (Mamba-2), its bias ``[dim]``; ``bias`` None without one."""

    def __init__(self, dim: int, kernel_size: int, *, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, 1, kernel_size))
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None

    @property
    def weight_DW(self) -> torch.Tensor:
        return self.weight[:, 0, :]


class KimiDeltaAttention(nn.Module):
    """KDA (module docstring). Its fast paths are the kernel record's (``ctx.backends``, names of
    ``harts.ops.registry.KDA_FAST_PATHS``; ``ExecutionConfig.fast_paths`` overrides them):

    * "stacked_qkv": q / k / v input projections as one GEMM over their stacked weights (a
      [3HK, D] copy of the weights instead of a [T, 3HK] one of the activations, one GEMM each
      way instead of three); by default on CUDA, where the copies and launches cost; elsewhere
      the three GEMMs (the reference: the same products, rounded per GEMM). Stacked, the q / k / v
      ``nn.Linear`` modules are not called: hooks on them do not run (turn it off for adapters
      that wrap those modules).
    * "stacked_gates": with low-rank gates, the forget and output gates' first factors
      (``f_a_proj``, ``g_a_proj``, V columns each) and ``b_proj`` (H columns) as one GEMM over
      their stacked weights. Each of them alone reads all of x for a handful of columns, and its
      backward writes a [T, D] gradient that autograd then adds into x's; stacked, x is read once
      each way and two [T, D] gradients and their additions are gone, for a [T, 2V + H] split
      gradient (``split``'s backward: small). By default on CUDA; the modules are not called.
    * "fused_qkv_norm": the split of the conv's ``[q | k | v]`` and the q / k l2 norms as one
      kernel each way (``harts.ops.qkv_norm``; no concatenation of the three gradients) where the
      kernel applies (CUDA); off: the torch split and l2 norms (the reference) everywhere.
    * "silu_in_split": the short conv's SiLU applied by the split kernel instead of by fla-core's
      conv, whose backward is then much cheaper (``harts.ops.qkv_norm``, "The SiLU"); the same
      operations in float64. On by default (``HARTS_KDA_SILU_IN_SPLIT=0`` turns the default off).
    * "fla_gate": the log-decay g by fla-core's fused gate (``fla.ops.kda.gate.fused_kda_gate``:
      one Triton pass forward, and backward one pass that writes df beside per-block partial sums
      of dA_log and ddt_bias) instead of the compiled ``kda_log_decay``, whose backward Inductor
      made a reduction and a pointwise pass (about three times what their bytes take on a GPU).
      The same arithmetic in float32, rounded once to f's dtype. Only on CUDA with fla-core and
      half or float32 f (float64 and CPU: ``kda_log_decay``); on by default there
      (``HARTS_KDA_FLA_GATE=0`` turns the default off).
    """

    def __init__(self, config: HybridConfig) -> None:
        super().__init__()
        d = config.hidden_size
        self.num_heads = h = config.linear_num_value_heads
        self.head_k_dim = k = config.linear_key_head_dim
        self.head_v_dim = v = config.linear_value_head_dim
        w = config.linear_conv_kernel_dim
        self.q_proj = nn.Linear(d, h * k, bias=False)
        self.k_proj = nn.Linear(d, h * k, bias=False)
        self.v_proj = nn.Linear(d, h * v, bias=False)
        self.q_conv1d = ShortConvolution(h * k, w)
        self.k_conv1d = ShortConvolution(h * k, w)
        self.v_conv1d = ShortConvolution(h * v, w)
        self.low_rank_gates = config.kda_low_rank_gates
        self.safe_gate, self.lower_bound = config.kda_safe_gate, config.kda_lower_bound
        if self.low_rank_gates:
            # low-rank forget/output gates (rank = head_v_dim, as in Kimi Linear)
            self.f_a_proj = nn.Linear(d, v, bias=False)
            self.f_b_proj = nn.Linear(v, h * k, bias=False)
        else:  # full-rank gates (Ling 3.0 / BailingHybrid)
            self.f_proj = nn.Linear(d, h * k, bias=False)
        self.b_proj = nn.Linear(d, h, bias=False)
        self.A_log = nn.Parameter(torch.empty(h).uniform_(1, 16).log())
        self.dt_bias = nn.Parameter(torch.ones(h * k))
        if self.low_rank_gates:
            self.g_a_proj = nn.Linear(d, v, bias=False)
            self.g_b_proj = nn.Linear(v, h * v, bias=False)
        else:
            self.g_proj = nn.Linear(d, h * v, bias=False)
        self.o_norm = RMSNormGated(v, eps=config.rms_norm_eps, activation="sigmoid")
        self.o_proj = nn.Linear(h * v, d, bias=False)

    def forward(self, x_TD: torch.Tensor, ctx: RowContext) -> torch.Tensor:
        t = x_TD.shape[0]
        h, k, v = self.num_heads, self.head_k_dim, self.head_v_dim
        kernels = ctx.backends
        if kernels.fast("stacked_qkv"):
            w_qkv = torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight], dim=0)
            mixed = torch.nn.functional.linear(x_TD, w_qkv)
        else:
            mixed = torch.cat([self.q_proj(x_TD), self.k_proj(x_TD), self.v_proj(x_TD)], dim=-1)
        weight = torch.cat([self.q_conv1d.weight_DW, self.k_conv1d.weight_DW, self.v_conv1d.weight_DW], dim=0)
        act = "silu" if kernels.fast("silu_in_split") else None
        mixed = ctx.short_conv(mixed, weight, None, None if act else "silu")
        split = split_l2norm_qkv if kernels.fast("fused_qkv_norm") else split_l2norm_qkv_reference
        # the linear attention's input rows gathered by the split itself (compact execution)
        rows = ctx.la_input_rows()
        q, kk, vv = split(mixed, h, k, h, v, rows=rows, activation=act)
        if self.low_rank_gates and kernels.fast("stacked_gates"):
            w_gates = torch.cat([self.f_a_proj.weight, self.g_a_proj.weight, self.b_proj.weight], dim=0)
            f_a, g_a, b = torch.split(torch.nn.functional.linear(x_TD, w_gates), [v, v, h], dim=-1)
        elif self.low_rank_gates:
            f_a, g_a, b = self.f_a_proj(x_TD), None, self.b_proj(x_TD)
        else:
            f_a, g_a, b = None, None, self.b_proj(x_TD)
        f = self.f_b_proj(f_a) if self.low_rank_gates else self.f_proj(x_TD)
        lower_bound = self.lower_bound if self.safe_gate else None
        if fla_gate_applies(f, kernels.fast("fla_gate")):
            from fla.ops.kda.gate import fused_kda_gate

            g = fused_kda_gate(f.reshape(t, h, k), self.A_log, self.dt_bias, lower_bound, output_dtype=f.dtype)
        else:
            g = kda_log_decay(f.reshape(t, h, k), self.dt_bias.reshape(h, k), self.A_log, lower_bound)
        beta = torch.sigmoid(b)
        kw = {} if rows is None else {"qkv_gathered": True}
        o = run_core(ctx, self, "linear_attention", ctx.linear_attention, q, kk, vv, g, beta, **kw)
        if self.low_rank_gates:
            gate = self.g_b_proj(self.g_a_proj(x_TD) if g_a is None else g_a)
        else:
            gate = self.g_proj(x_TD)
        gate = gate.reshape(t, h, v)
        o = self.o_norm(o, gate)
        return self.o_proj(o.reshape(t, h * v))


def fla_gate_applies(f: torch.Tensor, enabled: bool) -> bool:
    """Whether KDA's log-decay runs in fla-core's fused gate for the gate projection ``f``
    ([T, H * K]): the record's "fla_gate" fast path ``enabled``, f on CUDA in bfloat16, float16
    or float32, and fla-core importable."""
    if not (enabled and f.is_cuda and f.dtype in (torch.bfloat16, torch.float16, torch.float32)):
        return False
    from harts.ops.linear_attn.fla import fla_available

    return fla_available()


def silu_in_split() -> bool:
    """Whether KDA's short-conv SiLU runs in the q / k / v split by default (the "silu_in_split"
    fast path of ``default_fast_paths``: on unless ``HARTS_KDA_SILU_IN_SPLIT`` is
    0/false/no/off); then the conv runs without activation. Benchmarks of the conv alone ask it,
    to time the model's variant."""
    from harts.models.execution.backends import default_fast_paths

    return "silu_in_split" in default_fast_paths(torch.device("cpu"))


# ---------------------------------------------------------------------------------- the spec
def _parameters(c: HybridConfig) -> int:
    d, w = c.hidden_size, c.linear_conv_kernel_dim
    h, k, v = c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
    n = d * (2 * h * k + h * v) + w * (2 * h * k + h * v) + d * h + h + h * k + v + h * v * d
    gates = d * v + v * h * k + d * v + v * h * v if c.kda_low_rank_gates else d * h * k + d * h * v
    return n + gates


def _row_elements(c: HybridConfig, dev: str) -> tuple[float, float]:
    d, h, k, v, b = (
        c.hidden_size,
        c.linear_num_value_heads,
        c.linear_key_head_dim,
        c.linear_value_head_dim,
        c.chunk_size,
    )
    m = 2 * h * k + h * v
    outside = 6 * m + 3 * d + 4 * h * k + 4 * h * v + (2 * v if c.kda_low_rank_gates else 0) + 7 * h
    if dev != "cpu":
        return outside, fla_core_row_elements(h, k, v, b)
    sub = 16 if b % 16 == 0 else b  # the chunk op's sub-block of per-channel decays
    states = chunk_state_elements(h, k, v, b)
    return outside, 11 * h * k + 4 * h * v + 4 * h * sub * k + 3 * h * (b // sub) * k + 3 * h * b + states + 20


def delta_rule_flops(c: HybridConfig) -> tuple[float, float]:
    """Per row and head, chunk B: in-chunk Q K^T and K K^T (4 B K), the WY factors (2 B K + 2 B V),
    the intra-chunk output (2 B V), the triangular solve (2/3 B^2), three state products (6 K V)."""
    b, k, v, h = c.chunk_size, c.linear_key_head_dim, c.linear_value_head_dim, c.linear_num_value_heads
    return 0.0, h * (6 * b * k + 4 * b * v + 2 / 3 * b * b + 6 * k * v)


def _tp_plan(mixer: nn.Module, tp: int) -> TensorParallelPlan:
    assert isinstance(mixer, KimiDeltaAttention)
    h, k, v = mixer.num_heads, mixer.head_k_dim, mixer.head_v_dim
    mixer.num_heads //= tp
    plan: dict[str, str | tuple[str, tuple[str, ...]]] = {
        n: "columns" for n in ("q_proj", "k_proj", "v_proj", "b_proj")
    }
    gates = ("f_b_proj", "g_b_proj") if mixer.low_rank_gates else ("f_proj", "g_proj")
    plan |= {n: "columns" for n in gates}
    plan |= {"o_proj": "rows", "": ("heads", ("A_log", "dt_bias"))}
    return plan, (h * k, h * k, h * v)


def linear_heads_divisor(c: HybridConfig) -> list[tuple[str, int]]:
    """What tensor parallelism splits in KDA and GDN alike: the value heads."""
    return [("linear-attention heads (linear_num_value_heads)", c.linear_num_value_heads)]


def _cp_divisors(c: HybridConfig, tp: int) -> list[tuple[str, int, str]]:
    hv, kd, vd = c.linear_num_value_heads // tp, c.linear_key_head_dim, c.linear_value_head_dim
    return [
        ("linear-attention heads (linear_num_value_heads)", hv, "divides"),
        ("KDA conv channels", 2 * hv * kd + hv * vd, "divides"),
    ]


SPEC = MixerSpec(
    letter="K",
    family="linear",
    description="Kimi Delta Attention",
    module=KimiDeltaAttention,
    attribute="linear_attn",
    core_region="linear_attention",
    parameters=_parameters,
    row_elements=_row_elements,
    view_row_elements=lambda c, dev: 0,
    core_flops=delta_rule_flops,
    attention_dims=lambda c: None,
    tp_plan=_tp_plan,
    tp_divisors=linear_heads_divisor,
    cp_divisors=_cp_divisors,
    lora_targets=all_linears,
)
