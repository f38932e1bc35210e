"""Mamba-2 (SSD) mixer, Nemotron-H / Granite 4.0-H semantics (transformers ``NemotronHMamba2Mixer``).

    [z | xBC | dt] = in_proj x            z, x: H*P; B, C: G*N each (G groups); dt: H
    x, B, C  = split(conv_silu(xBC))      one depthwise causal conv (with bias) over [x | B | C]
    dt       = softplus(dt + dt_bias)     [T, H]
    g        = -exp(A_log) * dt           scalar log-decay per head
    y        = ssd(q=C, k=B, v=x * dt, g) S_t = exp(g_t) S_{t-1} + B_t (x_t dt_t)^T, y_t = S_t^T C_t
                                          (B and C of group h // (H / G) for head h; no scale)
    y        = y + D * x                  the skip, per head
    out      = out_proj(group_rmsnorm(y * silu(z)) * weight)     gate first, then an RMS norm
                                          over each of the G groups of H*P / G channels

The SSD recurrence is the plain (non-delta) rule of the row context's chunkwise linear attention
(``ctx.linear_attention(..., rule="plain")``): the compact, tree and replay machinery of KDA / GDN
serve it unchanged, and the short conv reads each row's true predecessors across forks.

Shapes: x_TD; q/k_THN (N = ssm_state_size); v_THP (P = mamba_head_dim); g_TH.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from harts.models.config import HybridConfig
from harts.models.execution.base import RowContext
from harts.models.layers.kda import ShortConvolution
from harts.models.layers.norms import GroupRMSNormGated
from harts.models.layers.spec import MixerSpec, all_linears, fla_core_row_elements
from harts.models.recompute import run_core

__all__ = ["SPEC", "Mamba2Mixer"]


class Mamba2Mixer(nn.Module):
    """Mamba-2 SSD mixer (module docstring). Parameter names are transformers' (``in_proj``,
    ``conv1d.weight`` [C, 1, w] and ``conv1d.bias``, ``dt_bias``, ``A_log``, ``D``, ``norm.weight``,
    ``out_proj``)."""

    def __init__(self, config: HybridConfig) -> None:
        super().__init__()
        d = config.hidden_size
        self.num_heads = h = config.mamba_num_heads
        self.head_dim = p = config.mamba_head_dim
        self.state_size = n = config.ssm_state_size
        self.n_groups = g = config.mamba_n_groups
        self.intermediate = h * p
        self.conv_dim = h * p + 2 * g * n
        self.in_proj = nn.Linear(d, h * p + self.conv_dim + h, bias=False)
        self.conv1d = ShortConvolution(self.conv_dim, config.linear_conv_kernel_dim, bias=config.mamba_conv_bias)
        self.dt_bias = nn.Parameter(torch.ones(h))
        self.A_log = nn.Parameter(torch.empty(h).uniform_(1, 16).log())
        self.D = nn.Parameter(torch.ones(h))
        self.norm = GroupRMSNormGated(h * p, g, eps=config.rms_norm_eps)
        self.out_proj = nn.Linear(h * p, d, bias=False)

    def forward(self, x_TD: torch.Tensor, ctx: RowContext) -> torch.Tensor:
        """[T, D] -> [T, D]: the module docstring's steps over ``ctx``'s rows, whose conv and
        recurrence run on each row's own predecessors (a compact tree, a trajectory or a decode
        step alike)."""
        t = x_TD.shape[0]
        h, p, n, g = self.num_heads, self.head_dim, self.state_size, self.n_groups
        z, xbc, dt = torch.split(self.in_proj(x_TD), [h * p, self.conv_dim, h], dim=-1)
        xbc = ctx.short_conv(xbc, self.conv1d.weight_DW, self.conv1d.bias, "silu")
        xs, b, c = torch.split(xbc, [h * p, g * n, g * n], dim=-1)
        dt = F.softplus(dt + self.dt_bias)
        log_decay = -self.A_log.exp() * dt
        x_THP = xs.reshape(t, h, p)
        r = h // g
        q = c.reshape(t, g, n).repeat_interleave(r, dim=1)
        k = b.reshape(t, g, n).repeat_interleave(r, dim=1)
        v = x_THP * dt[..., None]
        y = run_core(
            ctx,
            self,
            "linear_attention",
            ctx.linear_attention,
            q,
            k,
            v,
            log_decay,
            beta_TH=None,
            rule="plain",
            scale=1.0,
        )
        y = y + x_THP * self.D[:, None]
        y = self.norm(y.reshape(t, h * p), z)
        return self.out_proj(y)


# ---------------------------------------------------------------------------------- the spec
def _parameters(c: HybridConfig) -> int:
    d, h, p, n, g = c.hidden_size, c.mamba_num_heads, c.mamba_head_dim, c.ssm_state_size, c.mamba_n_groups
    conv = h * p + 2 * g * n
    in_proj = d * (h * p + conv + h)
    conv_params = conv * c.linear_conv_kernel_dim + (conv if c.mamba_conv_bias else 0)
    return in_proj + conv_params + 3 * h + h * p + h * p * d


def _row_elements(c: HybridConfig, dev: str) -> tuple[float, float]:
    """Elements one Mamba-2 layer keeps per row for its backward: (in the model's dtype, in the
    core's dtype).

    CUDA: the in_proj output, the conv's input and output, q / k repeated to the heads, v, dt and
    the decay, the skip, the gated norm's input, gate and output, the add-and-norm after it; the
    core is fla-core's. CPU (the eager reference, written from what ``saved_tensors_hooks`` sees
    there: ``benchmarks/modules/layer_memory.py``): the reference conv's W + 2 copies of its input
    and its output, dt's softplus, the skip, the out_proj input and the add-and-norm in the
    model's dtype; in float32 the reference core (chunked q, k and their decays, the in-chunk
    scores with their decays, K_end and v, the chunk start states of the loop and of the output
    product, the output's A and v) and the gated norm, which works in float32 there."""
    d, h, p, n, g, b = (
        c.hidden_size,
        c.mamba_num_heads,
        c.mamba_head_dim,
        c.ssm_state_size,
        c.mamba_n_groups,
        c.chunk_size,
    )
    conv = h * p + 2 * g * n
    if dev == "cpu":
        outside = (c.linear_conv_kernel_dim + 3) * conv + 2 * h * p + 4 * h + 3 * d
        core = 6 * h * n + 4 * h * b + 2 * h * p + 2 * h + 2 * h * n * p / b
        return outside, core + 5 * h * p + g
    outside = (h * p + conv + h) + 2 * conv + 2 * h * n + h * p + 4 * h + 2 * h * p + 3 * h * p + 3 * d
    return outside, fla_core_row_elements(h, n, p, b)


def _core_flops(c: HybridConfig) -> tuple[float, float]:
    """Per row and head, chunk B, state N, head dim P: in-chunk C B^T (2 B N), the intra-chunk
    output (2 B P), the state products C S and B^T (x dt) (4 N P); no triangular solve."""
    b, n, p, h = c.chunk_size, c.ssm_state_size, c.mamba_head_dim, c.mamba_num_heads
    return 0.0, h * (2 * b * n + 2 * b * p + 4 * n * p)


def _cp_divisors(c: HybridConfig, tp: int) -> list[tuple[str, int, str]]:
    """The SSD's heads (q / k repeated from the groups to the heads first) and the conv's x, B, C
    channels; ``tp`` is 1 (no tensor-parallel plan)."""
    h = c.mamba_num_heads
    return [
        ("Mamba-2 heads (mamba_num_heads)", h, "divides"),
        ("Mamba-2 conv channels", h * c.mamba_head_dim + 2 * c.mamba_n_groups * c.ssm_state_size, "divides"),
    ]


SPEC = MixerSpec(
    letter="S",
    family="linear",
    description="Mamba-2 SSD",
    module=Mamba2Mixer,
    attribute="mamba",
    core_region="linear_attention",
    parameters=_parameters,
    row_elements=_row_elements,
    view_row_elements=lambda c, dev: 0,
    core_flops=_core_flops,
    attention_dims=lambda c: None,
    # in_proj's [z | x B C | dt] rows are not one block per head, so no column split gives each
    # rank whole heads: no tensor-parallel plan (check_tensor_parallel refuses the layer kind by
    # name). Context parallelism splits rows, not weights: the conv by channels and the SSD by
    # heads, as for GDN
    tp_plan=None,
    tp_divisors=lambda c: [],
    cp_divisors=_cp_divisors,
    lora_targets=all_linears,
)
