"""RMS norms used by every layer type, and the l2 normalization of linear-attention q/k.

Shapes: ``x_TD`` rows x features; the gated norm works on ``[..., V]`` head slices.

The arithmetic lives in functions that are compiled on CUDA (``harts.ops.compiled``;
``HARTS_COMPILE=0`` keeps them eager); eager, each is several float32 passes over the rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from harts.ops.compiled import cuda_compiled
from harts.ops.qkv_norm import l2norm  # the l2 norm lives beside its fused split kernel

__all__ = [
    "GroupRMSNormGated",
    "RMSNorm",
    "RMSNormGated",
    "add_rms_norm",
    "group_rms_norm_gated",
    "l2norm",
    "rms_norm",
    "rms_norm_gated",
]


@cuda_compiled
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool) -> torch.Tensor:
    """``x / rms(x) * weight`` (``* (1 + weight)`` with ``unit_offset``) over the last dim; statistics
    in at least float32, result in ``x``'s dtype. x: [..., D], weight: [D]."""
    work = torch.promote_types(x.dtype, torch.float32)
    h = x.to(work)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    w = weight.to(work)
    return (h * (1.0 + w if unit_offset else w)).to(x.dtype)


@cuda_compiled(rows=(0, 1))
def add_rms_norm(
    h: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(h + y, rms_norm(h + y))``: a pre-norm block's residual add and the norm after it, one
    pass each way on CUDA (eager, the add then ``rms_norm``: the same operations). Backward, the
    residual's gradient and the norm's are summed in the same kernel, where autograd had added
    them in a pass of its own. h, y: [T, D], weight: [D]."""
    s = h + y
    return s, rms_norm.eager(s, weight, eps, unit_offset)  # type: ignore[attr-defined]


@cuda_compiled(rows=(0, 1))
def rms_norm_gated(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, activation: str
) -> torch.Tensor:
    """``rmsnorm(x) * weight * act(gate)`` over the last dim (act: silu or sigmoid).
    x, gate: [..., V], weight: [V]."""
    work = torch.promote_types(x.dtype, torch.float32)
    h = x.to(work)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.to(work)
    g = gate.to(work)
    g = F.silu(g) if activation == "silu" else torch.sigmoid(g)
    return (h * g).to(x.dtype)


@cuda_compiled(rows=(0, 1))
def group_rms_norm_gated(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, groups: int, eps: float
) -> torch.Tensor:
    """``rmsnorm(x * silu(gate)) * weight`` with the statistics taken over each of ``groups`` equal
    channel groups of the last dim (Mamba-2's gated norm: gate before norm), in at least float32;
    the weight multiplies the result in ``x``'s dtype, as transformers' ``NemotronHRMSNormGated``.
    x, gate: [T, I], weight: [I]."""
    work = torch.promote_types(x.dtype, torch.float32)
    h = x.to(work) * F.silu(gate.to(work))
    hg = h.reshape(*h.shape[:-1], groups, -1)
    hg = hg * torch.rsqrt(hg.pow(2).mean(-1, keepdim=True) + eps)
    return hg.reshape(h.shape).to(x.dtype) * weight


class RMSNorm(nn.Module):
    """``x / rms(x) * weight`` (``* (1 + weight)`` with ``unit_offset``, Qwen3-Next's zero-centred form).

    Statistics are taken in at least float32, as in the reference implementations.
    """

    def __init__(self, dim: int, eps: float = 1e-6, *, unit_offset: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.unit_offset = unit_offset
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.unit_offset)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, unit_offset={self.unit_offset}"


class RMSNormGated(nn.Module):
    """Norm-then-gate over the last dim: ``rmsnorm(x) * weight * act(gate)`` (fla FusedRMSNormGated).

    GDN uses ``activation="silu"``, KDA ``"sigmoid"``.
    """

    def __init__(self, dim: int, eps: float = 1e-6, *, activation: str = "silu") -> None:
        super().__init__()
        if activation not in ("silu", "sigmoid"):
            raise ValueError(f"RMSNormGated: activation must be silu or sigmoid, got {activation!r}")
        self.eps = eps
        self.activation = activation
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return rms_norm_gated(x, gate, self.weight, self.eps, self.activation)


class GroupRMSNormGated(nn.Module):
    """Gate-then-norm over ``groups`` channel groups: ``rmsnorm_g(x * silu(gate)) * weight`` (Mamba-2,
    ``norm_before_gate=False``; ``group_rms_norm_gated``)."""

    def __init__(self, dim: int, groups: int, eps: float = 1e-6) -> None:
        super().__init__()
        if dim % groups:
            raise ValueError(f"GroupRMSNormGated: {groups} groups do not divide {dim} channels")
        self.groups = groups
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return group_rms_norm_gated(x, gate, self.weight, self.groups, self.eps)
