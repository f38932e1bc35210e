"""Loop references for the causal short convolutions (slow; for tests).

Shapes: P rows, D channels, W kernel width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["naive_tree_causal_conv1d", "naive_causal_conv1d_varlen"]


def naive_tree_causal_conv1d(
    x_PD: torch.Tensor,
    weight_DW: torch.Tensor,
    parent_P: torch.Tensor,
    bias_D: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Row by row: walk up the parent chain W-1 times and sum the weighted ancestors.

    Args:
        x_PD: [P, D] inputs.
        weight_DW: [D, W] depthwise kernel.
        parent_P: int [P] parent row of each row, -1 for a root (or a padding row).
        bias_D: [D] or None.
        activation: None or "silu"/"swish".
    """
    P, D = x_PD.shape
    W = weight_DW.shape[1]
    rows = []
    for i in range(P):
        acc = weight_DW[:, W - 1] * x_PD[i]
        j = i
        for d in range(1, W):
            j = int(parent_P[j]) if j >= 0 else -1
            if j >= 0:
                acc = acc + weight_DW[:, W - 1 - d] * x_PD[j]
        if bias_D is not None:
            acc = acc + bias_D
        rows.append(acc)
    y = torch.stack(rows) if rows else x_PD.new_zeros(0, D)
    return y if activation is None else F.silu(y)


def naive_causal_conv1d_varlen(
    x_TD: torch.Tensor,
    weight_DW: torch.Tensor,
    cu_seqlens: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Per sequence: F.conv1d with W-1 zeros of left padding and one group per channel."""
    D, W = weight_DW.shape
    outs = []
    for a, b in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
        seq = F.pad(x_TD[a:b].T[None], (W - 1, 0))  # [1, D, W-1 + L]
        outs.append(F.conv1d(seq, weight_DW[:, None, :], bias, groups=D)[0].T)
    y = torch.cat(outs)
    return y if activation is None else F.silu(y)
