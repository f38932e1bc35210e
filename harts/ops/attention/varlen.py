"""Plain per-sequence causal attention on packed sequences: the trajectory-wise baseline.

Shapes: T packed rows, H query heads, G kv heads (G divides H), D qk dim, E v dim, N sequences.
"""

from __future__ import annotations

import numpy as np
import torch

from harts.ops.attention.core import attend_causal, check_qkv
from harts.ops.attention.flash_varlen import flash_varlen_attention, flash_varlen_refusal

__all__ = ["varlen_causal_attention"]


def varlen_causal_attention(
    q_THD: torch.Tensor,
    k_TGD: torch.Tensor,
    v_TGE: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor,
    scale: float,
    cu_seqlens_host: np.ndarray | None = None,
) -> torch.Tensor:
    """Causal attention inside each packed sequence (square per sequence, so alignment is moot)::

        q0  x . .
        q1  x x .
        q2  x x x

    Args:
        q_THD: [T, H, D] queries.
        k_TGD: [T, G, D] keys.
        v_TGE: [T, G, E] values.
        cu_seqlens: int [N + 1] packed sequence boundaries.
        scale: softmax scale.
        cu_seqlens_host: the same boundaries on the host, where the caller has them (read
            without a device synchronization).

    On CUDA in half precision, where FlashAttention-2 takes the heads (``flash_varlen_refusal``),
    every sequence runs in one varlen call (``flash_varlen_attention``); elsewhere one
    ``attend_causal`` per sequence.

    Returns:
        o_THE: [T, H, E].
    """
    check_qkv(q_THD, k_TGD, v_TGE)
    T = q_THD.shape[0]
    if k_TGD.shape[0] != T:
        raise ValueError(f"q has {T} rows but k has {k_TGD.shape[0]}")
    bounds = cu_seqlens.tolist() if cu_seqlens_host is None else np.asarray(cu_seqlens_host).tolist()
    if cu_seqlens.dim() != 1 or bounds[0] != 0 or bounds[-1] != T or any(a > b for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens must be non-decreasing from 0 to T={T}; got {bounds}")
    if (
        flash_varlen_refusal(q_THD.device, q_THD.dtype, q_THD.shape[2], v_TGE.shape[2], q_THD.shape[1], k_TGD.shape[1])
        is None
    ):
        cu = cu_seqlens.to(device=q_THD.device, dtype=torch.int32)
        longest = max((b - a for a, b in zip(bounds[:-1], bounds[1:])), default=0)
        return flash_varlen_attention(q_THD, k_TGD, v_TGE, cu_q=cu, cu_k=cu, max_q=longest, max_k=longest, scale=scale)
    outs = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        if b > a:  # the kernels' own causal flag: no [b - a, b - a] mask (``attend_causal``)
            outs.append(attend_causal(q_THD[a:b], k_TGD[a:b], v_TGE[a:b], scale))
    if not outs:
        return q_THD.new_zeros(0, q_THD.shape[1], v_TGE.shape[2], dtype=v_TGE.dtype)
    return torch.cat(outs)
