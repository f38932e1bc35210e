"""Full attention on compact rows: per-branch ancestor views, a tree mask, and the per-sequence baseline."""

from __future__ import annotations

from harts.ops.attention.ancestor_view import ancestor_view_attention, bottom_right_causal_mask
from harts.ops.attention.tree_mask import tree_mask_attention, tree_visibility
from harts.ops.attention.varlen import varlen_causal_attention

__all__ = [
    "ancestor_view_attention",
    "bottom_right_causal_mask",
    "tree_mask_attention",
    "tree_visibility",
    "varlen_causal_attention",
]
