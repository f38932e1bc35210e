"""Causal depthwise short convolution over compact tree rows (true ancestors) and plain sequences."""

from __future__ import annotations

from harts.ops.conv.causal_conv import causal_conv1d_varlen, sequence_ancestors, tree_causal_conv1d
from harts.ops.conv.naive import naive_causal_conv1d_varlen, naive_tree_causal_conv1d

__all__ = [
    "causal_conv1d_varlen",
    "naive_causal_conv1d_varlen",
    "naive_tree_causal_conv1d",
    "sequence_ancestors",
    "tree_causal_conv1d",
]
