"""The dense attention core shared by the compact-attention ops, plus argument checks.

Shapes: L query rows, M key/value rows, H query heads, G key/value heads (G divides H; query
head h reads kv head h // (H / G)), D query/key dim, E value dim (E may differ from D: MLA).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["attend", "check_qkv"]


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Raise ValueError unless q [P, H, D], k [P', G, D], v [P', G, E] with G dividing H."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(
            f"q, k, v must be [rows, heads, dim]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    H, G = q.shape[1], k.shape[1]
    if k.shape[0] != v.shape[0] or v.shape[1] != G:
        raise ValueError(f"k and v must share rows and heads; got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"q and k head dims differ: {q.shape[2]} vs {k.shape[2]}")
    if G == 0 or H % G:
        raise ValueError(f"kv heads G={G} must divide query heads H={H}")


def attend(
    q_LHD: torch.Tensor, k_MGD: torch.Tensor, v_MGE: torch.Tensor, mask_LM: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """Softmax attention of L queries over M keys; mask_LM True = visible (None: all visible).

    Every query must see at least one key. Returns o_LHE.
    """
    q = q_LHD.transpose(0, 1)[None]
    k = k_MGD.transpose(0, 1)[None]
    v = v_MGE.transpose(0, 1)[None]
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask_LM, scale=scale, enable_gqa=k.shape[1] != q.shape[1])
    return o[0].transpose(0, 1)
