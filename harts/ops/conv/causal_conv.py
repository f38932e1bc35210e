"""Causal depthwise short convolution whose window reads true ancestors through an index tensor.

On compact tree rows a token's previous W-1 tokens are its ancestors in the trie, which need not
be the rows packed just before it (a side branch sits after other branches; the first row of a
sequence is preceded by another sequence). `tree_causal_conv1d` therefore gathers each row's
window through `ancestors_PW1`; the gather's backward accumulates the gradients of every reader
into the shared ancestor row. `causal_conv1d_varlen` is the plain per-sequence conv of the
trajectory-wise baseline, expressed through the same gather with sequence-local ancestors.

    y[i] = act(bias + weight[:, W-1] * x[i] + sum_{d=1}^{W-1} weight[:, W-1-d] * x[anc_d(i)])

Shapes: P rows, D channels, W kernel width; anc_d(i) = ancestors[i, d-1], -1 reads zero.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["tree_causal_conv1d", "causal_conv1d_varlen", "sequence_ancestors"]

_ACTIVATIONS = (None, "silu", "swish")


def tree_causal_conv1d(
    x_PD: torch.Tensor,
    weight_DW: torch.Tensor,
    ancestors_PW1: torch.Tensor,
    bias_D: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Depthwise causal conv where row i's window is [anc_{W-1}(i), ..., anc_1(i), i].

    Args:
        x_PD: [P, D] inputs on physical rows.
        weight_DW: [D, W] depthwise kernel; column W-1 multiplies the row itself.
        ancestors_PW1: int [P, W-1]; column d-1 is the physical row of the d-th true ancestor
            of row i, or -1 (none: before the root, or a padding row) which reads zero. Range-
            checked when on the host.
        bias_D: [D] or None.
        activation: None, "silu" or "swish" (the same).

    Returns:
        y_PD: [P, D].
    """
    P, D = x_PD.shape
    if weight_DW.dim() != 2 or weight_DW.shape[0] != D:
        raise ValueError(f"weight must be [D={D}, W]; got {tuple(weight_DW.shape)}")
    W = weight_DW.shape[1]
    if ancestors_PW1.shape != (P, W - 1):
        raise ValueError(f"ancestors must be [P={P}, W-1={W - 1}]; got {tuple(ancestors_PW1.shape)}")
    if bias_D is not None and bias_D.shape != (D,):
        raise ValueError(f"bias must be [D={D}]; got {tuple(bias_D.shape)}")
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation must be one of {_ACTIVATIONS}; got {activation!r}")
    # checked where the indices live on the host (no device sync); a device tensor is the
    # caller's (an executor's, built from a Layout) and an index out of range is a device assert
    if (
        not ancestors_PW1.is_cuda
        and ancestors_PW1.numel()
        and (int(ancestors_PW1.min()) < -1 or int(ancestors_PW1.max()) >= P)
    ):
        raise ValueError(
            f"ancestors must hold row ids in [-1, {P}); got [{int(ancestors_PW1.min())}, {int(ancestors_PW1.max())}]"
        )
    # Row P of the padded input is the zero row that -1 reads.
    x_pad = torch.cat([x_PD, x_PD.new_zeros(1, D)])
    index = torch.where(ancestors_PW1 < 0, P, ancestors_PW1).to(device=x_PD.device, dtype=torch.int64)
    y = x_PD * weight_DW[:, W - 1]
    for d in range(1, W):
        y = y + x_pad[index[:, d - 1]] * weight_DW[:, W - 1 - d]
    if bias_D is not None:
        y = y + bias_D
    return y if activation is None else F.silu(y)


def sequence_ancestors(cu_seqlens: torch.Tensor, width_minus_one: int) -> torch.Tensor:
    """int64 [T, W-1]: column d-1 holds row t-d when it lies in t's own sequence, else -1.

    Args:
        cu_seqlens: int [N + 1] packed sequence boundaries.
        width_minus_one: W - 1.
    """
    T = int(cu_seqlens[-1])
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    starts = torch.repeat_interleave(cu_seqlens[:-1], lengths, output_size=T)
    t = torch.arange(T, device=cu_seqlens.device)[:, None]
    prev = t - torch.arange(1, width_minus_one + 1, device=cu_seqlens.device)
    return torch.where(prev >= starts[:, None], prev, -1)


def causal_conv1d_varlen(
    x_TD: torch.Tensor,
    weight_DW: torch.Tensor,
    cu_seqlens: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Plain causal depthwise conv per packed sequence (the trajectory-wise baseline).

    Args:
        x_TD: [T, D] packed rows.
        weight_DW: [D, W] depthwise kernel.
        cu_seqlens: int [N + 1] boundaries (host or device; the host costs no synchronization);
            a window never reaches into the previous sequence.
        bias: [D] or None.
        activation: None, "silu" or "swish".

    Returns:
        y_TD: [T, D].
    """
    cu = cu_seqlens.cpu()  # host boundaries (pass them on the host: no device sync)
    if cu.dim() != 1 or int(cu[0]) != 0 or int(cu[-1]) != x_TD.shape[0]:
        raise ValueError(f"cu_seqlens must run from 0 to T={x_TD.shape[0]}; got {cu.tolist()}")
    ancestors = sequence_ancestors(cu, weight_DW.shape[-1] - 1).to(x_TD.device, non_blocking=True)
    return tree_causal_conv1d(x_TD, weight_DW, ancestors, bias, activation)
