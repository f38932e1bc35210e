"""Packed causal attention through torch's own FlashAttention-2 varlen kernel (CUDA, half precision).

One call attends every packed sequence of queries over its own packed key/value view,
bottom-right aligned (query i of a sequence with L queries and M >= L keys sees key j iff
j <= (M - L) + i): the trajectory-wise baseline's document-causal rows (L == M per sequence)
and harts' ancestor views (``ancestor_view_attention``: a branch's h ancestors, then its own
rows) are both this one contract::

                  kv:  a0 a1 a2 b0 b1
        q  b0          x  x  x  x  .
        q  b1          x  x  x  x  x

It runs ``torch.ops.aten._flash_attention_forward`` / ``_backward`` (FlashAttention-2 as
PyTorch ships it, on every CUDA build since 2.2), so no extra package is needed. Where it
applies, the kernel visits exactly the visible (query, key) pairs of each sequence: no
FlexAttention block is computed half-masked, and head dim 256 runs at FlashAttention-2's
tiles, which fit Hopper's shared memory. Grouped-query attention runs natively (G kv heads
shared by H / G query heads; the key/value gradients are summed over each group by the
kernel). ``flash_varlen_refusal`` says why a shape does not run here; callers keep their
reference path for those.

Shapes: Tq packed query rows, Tk packed key rows, H query heads, G kv heads (G divides H),
D head dim (q, k and v share it), N sequences.
"""

from __future__ import annotations

import torch

__all__ = ["flash_varlen_attention", "flash_varlen_refusal", "FLASH_VARLEN_MAX_HEAD_DIM"]

#: FlashAttention-2's largest head dim (forward and backward)
FLASH_VARLEN_MAX_HEAD_DIM = 256


def flash_varlen_refusal(
    device: torch.device, dtype: torch.dtype, qk_dim: int, v_dim: int, heads: int = 1, kv_heads: int = 1
) -> str | None:
    """Why ``flash_varlen_attention`` cannot run these heads (None: it can).

    Args:
        device: where q, k and v live.
        dtype: their dtype.
        qk_dim: query/key head dim.
        v_dim: value head dim.
        heads: query heads H.
        kv_heads: key/value heads G.
    """
    if device.type != "cuda":
        return "FlashAttention-2 runs on CUDA only"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"FlashAttention-2 takes float16 or bfloat16, not {str(dtype).removeprefix('torch.')}"
    if qk_dim != v_dim:
        return f"FlashAttention-2 needs one head dim for q, k and v; these heads have {qk_dim} and {v_dim}"
    if qk_dim % 8 or qk_dim > FLASH_VARLEN_MAX_HEAD_DIM:
        return (
            f"FlashAttention-2 takes head dims that are multiples of 8 up to {FLASH_VARLEN_MAX_HEAD_DIM}, not {qk_dim}"
        )
    if torch.are_deterministic_algorithms_enabled():
        return "deterministic algorithms are on: FlashAttention-2's backward and the views' gradient sums use atomics"
    if kv_heads < 1 or heads % kv_heads:
        return f"kv heads {kv_heads} must divide query heads {heads}"
    if not torch.cuda.is_available():  # a plan for a CUDA device made elsewhere (a memory estimate)
        return None
    major, _ = torch.cuda.get_device_capability(torch.device(device))
    if major < 8:
        return f"FlashAttention-2 needs compute capability 8.0 or newer; this GPU has {major}.x"
    return None


class _FlashVarlen(torch.autograd.Function):
    """Forward and backward of the varlen kernel, causal, bottom-right aligned (module docstring).
    Saves q, k, v, the output and its row logsumexp (float32 [H, Tq]); nothing S-sized."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q: int, max_k: int, scale: float):  # type: ignore[override]
        out, lse, rng_state, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True, False, scale=scale
        )
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, rng_state, unused)
        ctx.max_q, ctx.max_k, ctx.scale = max_q, max_k, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        q, k, v, out, lse, cu_q, cu_k, rng_state, unused = ctx.saved_tensors
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            grad_out.contiguous(),
            q,
            k,
            v,
            out,
            lse,
            cu_q,
            cu_k,
            ctx.max_q,
            ctx.max_k,
            0.0,
            True,
            rng_state,
            unused,
            scale=ctx.scale,
        )
        return dq, dk, dv, None, None, None, None, None


def flash_varlen_attention(
    q_QHD: torch.Tensor,
    k_KGD: torch.Tensor,
    v_KGD: torch.Tensor,
    *,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    scale: float,
) -> torch.Tensor:
    """Bottom-right causal attention of each packed query sequence over its key/value sequence.

    Args:
        q_QHD: [Tq, H, D] queries, sequence after sequence.
        k_KGD: [Tk, G, D] keys, sequence after sequence (G divides H).
        v_KGD: [Tk, G, D] values.
        cu_q: int32 [N + 1] query sequence boundaries, on q's device.
        cu_k: int32 [N + 1] key sequence boundaries (each sequence at least as long as its
            queries), on q's device.
        max_q: the longest query sequence (host int: no device synchronization).
        max_k: the longest key sequence.
        scale: softmax scale.

    Returns:
        o_QHD: [Tq, H, D].

    Raises:
        ValueError: shapes or dtypes this kernel does not take (``flash_varlen_refusal``).
    """
    why = flash_varlen_refusal(
        q_QHD.device, q_QHD.dtype, q_QHD.shape[-1], v_KGD.shape[-1], q_QHD.shape[1], k_KGD.shape[1]
    )
    if why is not None:
        raise ValueError(why)
    if cu_q.dtype != torch.int32 or cu_k.dtype != torch.int32:
        raise ValueError(f"cu_q and cu_k must be int32; got {cu_q.dtype} and {cu_k.dtype}")
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q_QHD, k_KGD, v_KGD))
    return _FlashVarlen.apply(q, k, v, cu_q, cu_k, int(max_q), int(max_k), float(scale))
