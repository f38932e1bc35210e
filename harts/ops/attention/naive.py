"""Dense references for the attention ops: explicit visibility matrices and a plain softmax.

Shapes: P rows, H query heads, G kv heads (G divides H), D qk dim, E v dim.
"""

from __future__ import annotations

import torch

__all__ = ["naive_masked_attention", "ancestor_view_visibility", "tree_mask_visibility", "causal_visibility"]


def naive_masked_attention(
    q_PHD: torch.Tensor, k_PGD: torch.Tensor, v_PGE: torch.Tensor, visible_PP: torch.Tensor, scale: float
) -> torch.Tensor:
    """o[i] = softmax_j(scale q_i . k_j over visible j) v_j; rows that see nothing are zero."""
    rep = q_PHD.shape[1] // k_PGD.shape[1]
    k = k_PGD.repeat_interleave(rep, dim=1)
    v = v_PGE.repeat_interleave(rep, dim=1)
    scores = torch.einsum("ihd,jhd->hij", q_PHD, k) * scale
    scores = scores.masked_fill(~visible_PP, float("-inf"))
    any_visible = visible_PP.any(1)
    probs = torch.softmax(scores.masked_fill(~any_visible[None, :, None], 0.0), dim=-1) * any_visible[None, :, None]
    return torch.einsum("hij,jhe->ihe", probs, v)


def ancestor_view_visibility(P: int, q_rows, cu_q, kv_rows, cu_kv) -> torch.Tensor:
    """bool [P, P] from branch views: own query i of branch b sees kv entry j iff j <= h_b + i."""
    vis = torch.zeros(P, P, dtype=torch.bool)
    for b in range(len(cu_q) - 1):
        own = q_rows[cu_q[b] : cu_q[b + 1]].tolist()
        view = kv_rows[cu_kv[b] : cu_kv[b + 1]].tolist()
        h = len(view) - len(own)
        for i, row in enumerate(own):
            for j in range(h + i + 1):
                vis[row, view[j]] = True
    return vis


def tree_mask_visibility(tree_pre: torch.Tensor, tree_end: torch.Tensor) -> torch.Tensor:
    """bool [P, P] by a double loop over the tree-mask rule (padding rows see themselves)."""
    P = tree_pre.numel()
    vis = torch.zeros(P, P, dtype=torch.bool)
    for i in range(P):
        for j in range(P):
            pi, pj = int(tree_pre[i]), int(tree_pre[j])
            vis[i, j] = (i == j) or (pi >= 0 and pj >= 0 and pj <= pi < int(tree_end[j]))
    return vis


def causal_visibility(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """bool [T, T]: block-diagonal lower triangles of the packed sequences."""
    T = int(cu_seqlens[-1])
    vis = torch.zeros(T, T, dtype=torch.bool)
    for a, b in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
        vis[a:b, a:b] = torch.ones(b - a, b - a, dtype=torch.bool).tril()
    return vis
