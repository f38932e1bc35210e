"""Rotary position embeddings indexed by each row's ORIGINAL position id.

Compact rows keep the position of their token inside its trajectory (``Layout.position``),
so RoPE runs once per compact row and agrees with trajectory-wise execution.

Shapes: ``position_T`` int64; ``x_THR`` rows x heads x rotary dims; ``cos_TR``/``sin_TR``.
"""

from __future__ import annotations

import torch

from harts.ops.compiled import cuda_compiled

__all__ = ["apply_rope", "mla_key_value", "rope_cos_sin"]


def rope_cos_sin(
    position_T: torch.Tensor, rotary_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin ``[T, rotary_dim]`` in the half-split layout (``cat(freqs, freqs)``)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    # non_blocking: a synchronous upload would first wait for the device's queue
    freqs = position_T.to(torch.float64)[:, None] * inv_freq.to(position_T.device, non_blocking=True)[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


@cuda_compiled(rows=(0, 1, 2))
def apply_rope(
    x_THD: torch.Tensor,
    cos_TR: torch.Tensor,
    sin_TR: torch.Tensor,
    *,
    interleaved: bool = False,
    rotary_last: bool = False,
) -> torch.Tensor:
    """Rotate the first ``R = cos.shape[-1]`` dims of every head; the rest pass through.

    ``interleaved``: the rotary dims are stored as (x0, y0, x1, y1, ...) pairs (DeepSeek-V3
    checkpoints with ``rope_interleave``); they are de-interleaved before the rotation.
    ``rotary_last``: rotate the last R dims instead, the rest passing through in front (MLA's
    ``[nope | rope]`` query heads: one pass over the whole head, forward and backward, where a
    split, a rotation of the slice and a concatenation took three, and the split's backward a
    fourth).
    """
    r = cos_TR.shape[-1]
    if rotary_last:
        d = x_THD.shape[-1]
        rest, rot = x_THD[..., : d - r], x_THD[..., d - r :]
    else:
        rot, rest = x_THD[..., :r], x_THD[..., r:]
    if interleaved:
        t, h = rot.shape[:2]
        rot = rot.reshape(t, h, r // 2, 2).transpose(-1, -2).reshape(t, h, r)
    cos, sin = cos_TR[:, None, :], sin_TR[:, None, :]
    rot = rot * cos + _rotate_half(rot) * sin
    if not rest.shape[-1]:
        return rot
    return torch.cat([rest, rot] if rotary_last else [rot, rest], dim=-1)


@cuda_compiled(rows=(0, 1, 2, 3))
def mla_key_value(
    kv_THC: torch.Tensor,
    k_rot_T1R: torch.Tensor,
    cos_TR: torch.Tensor | None,
    sin_TR: torch.Tensor | None,
    *,
    nope: int,
    interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA's attention keys and values from ``kv_b_proj``'s ``[k_nope | v]`` heads ``kv_THC``
    ([T, H, N + V], N = ``nope``) and the rows' one shared rotary key ``k_rot`` [T, 1, R]:
    keys ``[T, H, N + R]`` (each head's ``k_nope``, then ``k_rot`` rotated by ``apply_rope``
    unless ``cos_TR`` is None) and contiguous values [T, H, V].

    One compiled pass each way on CUDA. Eager, the keys were a ``torch.cat`` of a strided
    ``k_nope`` slice and the broadcast ``k_rot``, after a rotation of ``k_rot``, with the values
    copied apart, and backward ``split``'s concatenation of the two gradients; in a GPU profile
    the keys' concatenation took about three times what its bytes take (the profile:
    ``benchmarks/results/ling3-tiny_h200_2026-12-02_conv-no-state/profile_per_round/``). The
    eager function (CPU, float64) is the former code: the same operations."""
    t, h = kv_THC.shape[:2]
    k_nope, v = kv_THC[..., :nope], kv_THC[..., nope:]
    rot = k_rot_T1R
    if cos_TR is not None and sin_TR is not None:
        rot = apply_rope.eager(rot, cos_TR, sin_TR, interleaved=interleaved)  # type: ignore[attr-defined]
    return torch.cat([k_nope, rot.expand(t, h, rot.shape[-1])], dim=-1), v.contiguous()
