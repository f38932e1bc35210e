"""Causal depthwise short convolution over compact tree rows (true ancestors) and plain sequences.

Two implementations of one function: ``tree_causal_conv1d`` / ``causal_conv1d_varlen`` (torch
gathers: the reference, any device) and ``runs_causal_conv1d`` (fla-core's varlen kernel over
runs with initial states, CUDA). ``conv_uses_fla`` says which one runs beside a resolved
linear-attention operator (the kernel record, ``harts.models.execution.backends``, asks it).
"""

from __future__ import annotations

from harts.ops.conv.causal_conv import causal_conv1d_varlen, sequence_ancestors, tree_causal_conv1d
from harts.ops.conv.naive import naive_causal_conv1d_varlen, naive_tree_causal_conv1d
from harts.ops.conv.runs import (
    ConvRuns,
    conv_runs_from_ancestors,
    conv_runs_from_offsets,
    conv_uses_fla,
    runs_causal_conv1d,
)

__all__ = [
    "ConvRuns",
    "causal_conv1d_varlen",
    "conv_runs_from_ancestors",
    "conv_runs_from_offsets",
    "conv_uses_fla",
    "runs_causal_conv1d",
    "naive_causal_conv1d_varlen",
    "naive_tree_causal_conv1d",
    "sequence_ancestors",
    "tree_causal_conv1d",
]
