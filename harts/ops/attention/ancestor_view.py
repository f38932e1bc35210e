"""Full attention on compact rows through per-branch ancestor K/V views (paper §4.2, Eqs. 21-22).

A branch b owns l_b query rows (its own tokens, which need outputs) and reads a KV view of
h_b + l_b rows: the ancestors of its first own row (root first), then its own rows. Query i of
the branch sees KV entry j iff j <= h_b + i: bottom-right causal alignment. The gathers are
plain indexing, so in backward the gradients of every view that reads a shared ancestor row
accumulate into that one compact row.

Shapes: P physical rows, H query heads, G kv heads, D qk dim, E v dim, nb branches.
"""

from __future__ import annotations

import numpy as np
import torch

from harts.ops.attention.core import attend_causal, check_qkv
from harts.ops.attention.flash_varlen import flash_varlen_attention, flash_varlen_refusal

__all__ = ["ancestor_view_attention", "bottom_right_causal_mask"]


def bottom_right_causal_mask(num_q: int, num_kv: int, device: torch.device | None = None) -> torch.Tensor:
    """bool [num_q, num_kv]: query i sees key j iff j <= (num_kv - num_q) + i."""
    return torch.ones(num_q, num_kv, dtype=torch.bool, device=device).tril(num_kv - num_q)


def ancestor_view_attention(
    q_PHD: torch.Tensor,
    k_PGD: torch.Tensor,
    v_PGE: torch.Tensor,
    *,
    q_rows: torch.Tensor,
    cu_q: torch.Tensor,
    kv_rows: torch.Tensor,
    cu_kv: torch.Tensor,
    scale: float,
    cu_q_host: np.ndarray | None = None,
    cu_kv_host: np.ndarray | None = None,
    q_rows_host: np.ndarray | None = None,
) -> torch.Tensor:
    """Attend each branch's own rows over its gathered ancestor+own K/V view; scatter back.

    On CUDA in half precision, where FlashAttention-2 takes the heads (``flash_varlen_refusal``),
    every branch runs in one varlen call over the gathered K/V views (``flash_varlen_attention``):
    the kernel visits exactly the visible pairs. Elsewhere each branch runs ``attend_causal``.

    The mask of a branch with h = 3 ancestors and l = 2 own rows (bottom-right aligned; a
    top-left alignment would wrongly hide the ancestors from the first queries)::

                  kv:  a0 a1 a2 b0 b1
        q  b0          x  x  x  x  .
        q  b1          x  x  x  x  x

    Args:
        q_PHD: [P, H, D] queries on physical rows.
        k_PGD: [P, G, D] keys (G divides H: grouped-query attention).
        v_PGE: [P, G, E] values (E may differ from D: MLA).
        q_rows: int [sum l_b] physical rows of each branch's own rows, branch by branch.
        cu_q: int [nb + 1] boundaries of the branches in q_rows.
        kv_rows: int [sum (h_b + l_b)] physical rows of each branch's KV view (ancestors root
            first, then its own rows).
        cu_kv: int [nb + 1] boundaries of the branches in kv_rows.
        scale: softmax scale.
        cu_q_host, cu_kv_host, q_rows_host: the same three on the host, where the caller has
            them (a compact layout does): the boundaries are then read without a device
            synchronization, and own rows that are already every physical row in order are not
            gathered and scattered.

    Returns:
        o_PHE: [P, H, E]; rows not in q_rows are zero.
    """
    check_qkv(q_PHD, k_PGD, v_PGE)
    if cu_q.shape != cu_kv.shape or cu_q.dim() != 1:
        raise ValueError(f"cu_q and cu_kv must both be [nb + 1]; got {tuple(cu_q.shape)} and {tuple(cu_kv.shape)}")
    bq = cu_q.tolist() if cu_q_host is None else cu_q_host.tolist()
    bkv = cu_kv.tolist() if cu_kv_host is None else cu_kv_host.tolist()
    if bq[0] != 0 or bq[-1] != q_rows.numel() or bkv[0] != 0 or bkv[-1] != kv_rows.numel():
        raise ValueError("cu_q / cu_kv must run from 0 to the lengths of q_rows / kv_rows")
    P, H = q_PHD.shape[:2]
    E = v_PGE.shape[2]
    if flash_varlen_refusal(q_PHD.device, q_PHD.dtype, q_PHD.shape[2], E, H, k_PGD.shape[1]) is None:
        return _flash_views(q_PHD, k_PGD, v_PGE, q_rows, cu_q, kv_rows, cu_kv, bq, bkv, q_rows_host, scale)
    outs = []
    for b in range(len(bq) - 1):
        lq, lkv = bq[b + 1] - bq[b], bkv[b + 1] - bkv[b]
        if lkv < lq:
            raise ValueError(
                f"branch {b} has {lq} query rows but only {lkv} kv rows (its view must end with its own rows)"
            )
        if lq == 0:
            continue
        qr, kvr = q_rows[bq[b] : bq[b + 1]], kv_rows[bkv[b] : bkv[b + 1]]
        # bottom-right causal without an [lq, lkv] mask on the CPU (``attend_causal``)
        outs.append(attend_causal(q_PHD[qr], k_PGD[kvr], v_PGE[kvr], scale))
    out = q_PHD.new_zeros(P, H, E, dtype=v_PGE.dtype)
    if not outs:
        return out
    return out.index_copy(0, q_rows.to(q_PHD.device), torch.cat(outs))


def _flash_views(q_PHD, k_PGD, v_PGE, q_rows, cu_q, kv_rows, cu_kv, bq, bkv, q_rows_host, scale):  # noqa: ANN001, ANN202
    """``ancestor_view_attention`` as one varlen FlashAttention-2 call (checked arguments)."""
    lq, lkv = np.diff(bq), np.diff(bkv)
    short = np.flatnonzero(lkv < lq)
    if short.size:
        b = int(short[0])
        raise ValueError(
            f"branch {b} has {lq[b]} query rows but only {lkv[b]} kv rows (its view must end with its own rows)"
        )
    P = q_PHD.shape[0]
    own_is_all = q_rows_host is not None and len(q_rows_host) == P and np.array_equal(q_rows_host, np.arange(P))
    q = q_PHD if own_is_all else q_PHD.index_select(0, q_rows)
    o = flash_varlen_attention(
        q,
        _GatherRows.apply(k_PGD, kv_rows),
        _GatherRows.apply(v_PGE, kv_rows),
        cu_q=cu_q.to(torch.int32),
        cu_k=cu_kv.to(torch.int32),
        max_q=int(lq.max(initial=0)),
        max_k=int(lkv.max(initial=0)),
        scale=scale,
    )
    if own_is_all:
        return o
    return q_PHD.new_zeros(P, q_PHD.shape[1], v_PGE.shape[2]).index_copy(0, q_rows, o)


class _GatherRows(torch.autograd.Function):
    """``x.index_select(0, rows)`` whose backward sums the gradients of a row read by many views
    in float32 (a shared ancestor's K/V row is read once per descendant branch; summing those in
    half precision, as ``index_select``'s own backward does, loses what the per-path reference
    keeps)."""

    @staticmethod
    def forward(ctx, x, rows):  # type: ignore[override]
        ctx.save_for_backward(rows)
        ctx.rows_of_x = x.shape[0]
        return x.index_select(0, rows)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        (rows,) = ctx.saved_tensors
        wide = torch.promote_types(grad.dtype, torch.float32)  # float64 stays float64
        acc = grad.new_zeros((ctx.rows_of_x, *grad.shape[1:]), dtype=wide)
        return acc.index_add_(0, rows, grad.to(wide)).to(grad.dtype), None
