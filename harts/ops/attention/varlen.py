"""Plain per-sequence causal attention on packed sequences: the trajectory-wise baseline.

Shapes: T packed rows, H query heads, G kv heads (G divides H), D qk dim, E v dim, N sequences.
"""

from __future__ import annotations

import torch

from harts.ops.attention.core import attend_causal, check_qkv

__all__ = ["varlen_causal_attention"]


def varlen_causal_attention(
    q_THD: torch.Tensor,
    k_TGD: torch.Tensor,
    v_TGE: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor,
    scale: float,
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

    Returns:
        o_THE: [T, H, E].
    """
    check_qkv(q_THD, k_TGD, v_TGE)
    T = q_THD.shape[0]
    if k_TGD.shape[0] != T:
        raise ValueError(f"q has {T} rows but k has {k_TGD.shape[0]}")
    bounds = cu_seqlens.tolist()
    if cu_seqlens.dim() != 1 or bounds[0] != 0 or bounds[-1] != T or any(a > b for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens must be non-decreasing from 0 to T={T}; got {bounds}")
    outs = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        if b > a:  # the kernels' own causal flag: no [b - a, b - a] mask (``attend_causal``)
            outs.append(attend_causal(q_THD[a:b], k_TGD[a:b], v_TGE[a:b], scale))
    if not outs:
        return q_THD.new_zeros(0, q_THD.shape[1], v_TGE.shape[2], dtype=v_TGE.dtype)
    return torch.cat(outs)
