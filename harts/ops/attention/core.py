"""The dense attention core shared by the compact-attention ops, plus argument checks.

``attend`` takes an explicit [L, M] mask. ``attend_causal`` is the bottom-right causal case
(every op here but the tree mask's) without any mask: on the CPU it runs torch's flash kernel
(``_scaled_dot_product_flash_attention_for_cpu``, tiled, keeping only the output and its row
logsumexp for the backward), so memory is linear in L + M; an [L, M] mask or score matrix is
never made. That kernel is top-left aligned and wants one head dim for q, k and v, so a view
of h = M - L leading keys runs as two calls merged by their logsumexps (the h keys every query
sees, then the L x L causal square), and unequal head dims (MLA) are zero-padded to the larger
one (padding adds nothing to q . k and gives zero output columns, which are dropped).

Shapes: L query rows, M key/value rows, H query heads, G key/value heads (G divides H; query
head h reads kv head h // (H / G)), D query/key dim, E value dim (E may differ from D: MLA).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["attend", "attend_causal", "check_qkv"]


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


def attend_causal(q_LHD: torch.Tensor, k_MGD: torch.Tensor, v_MGE: torch.Tensor, scale: float) -> torch.Tensor:
    """Bottom-right causal attention of L queries over M >= L keys: query i sees key j iff
    j <= (M - L) + i (h = M - L keys before the queries' own, as an ancestor view)::

                  kv:  a0 a1 a2 b0 b1
        q  b0          x  x  x  x  .
        q  b1          x  x  x  x  x

    No [L, M] mask is made on the CPU (module docstring); elsewhere it is ``attend`` with the
    bottom-right causal mask. Returns o_LHE.
    """
    L, M = q_LHD.shape[0], k_MGD.shape[0]
    if M < L:
        raise ValueError(f"bottom-right causal attention needs at least as many keys as queries; got {M} < {L}")
    if q_LHD.device.type != "cpu":  # the GPU's default is the tree-mask path; this one is as it was
        mask = torch.ones(L, M, dtype=torch.bool, device=q_LHD.device).tril(M - L)
        return attend(q_LHD, k_MGD, v_MGE, mask, scale)
    D, E = q_LHD.shape[2], v_MGE.shape[2]
    width = max(D, E)
    if D < width:  # zero columns add nothing to q . k
        q_LHD, k_MGD = F.pad(q_LHD, (0, width - D)), F.pad(k_MGD, (0, width - D))
    if E < width:  # zero columns of v give zero output columns
        v_MGE = F.pad(v_MGE, (0, width - E))
    q, k, v = (t.transpose(0, 1)[None] for t in (q_LHD, k_MGD, v_MGE))
    if L == M:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=k.shape[1] != q.shape[1])
    else:
        o = _PrefixCausal.apply(q, k, v, M - L, scale)
    return o[0].transpose(0, 1)[..., :E]


def _flash_cpu(q, k, v, causal: bool, scale: float):  # noqa: ANN001, ANN202
    """(o [1, H, L, E], lse [1, H, L]) of torch's CPU flash kernel (G may divide H)."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)


def _flash_cpu_backward(grad, q, k, v, o, lse, causal: bool, scale: float):  # noqa: ANN001, ANN202
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad, q, k, v, o, lse, 0.0, causal, scale=scale
    )


class _PrefixCausal(torch.autograd.Function):
    """Attention of L queries over h leading keys (all visible) and then L causal keys, as two
    CPU flash calls merged by their logsumexps (q [1, H, L, D], k [1, G, h + L, D], v [1, G, h +
    L, D]). The backward hands each part the merged output and logsumexp: the kernel's
    probabilities exp(s - lse) and its row term sum(dO * o) are then those of the whole row, so
    each part's key gradients and its share of the query gradient are exact; dq is their sum."""

    @staticmethod
    def forward(ctx, q, k, v, h: int, scale: float):  # type: ignore[override]
        parts = ((k[:, :, :h], v[:, :, :h], False), (k[:, :, h:], v[:, :, h:], True))
        (o_a, lse_a), (o_b, lse_b) = (_flash_cpu(q, kp, vp, causal, scale) for kp, vp, causal in parts)
        lse = torch.logaddexp(lse_a, lse_b)  # the compute dtype: float32 for half inputs
        o = ((lse_a - lse).exp()[..., None] * o_a.to(lse.dtype) + (lse_b - lse).exp()[..., None] * o_b).to(q.dtype)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.h, ctx.scale = h, scale
        return o

    @staticmethod
    def backward(ctx, grad_o):  # type: ignore[override]
        q, k, v, o, lse = ctx.saved_tensors
        h, scale = ctx.h, ctx.scale
        grad_o = grad_o.contiguous()
        dq_a, dk_a, dv_a = _flash_cpu_backward(grad_o, q, k[:, :, :h], v[:, :, :h], o, lse, False, scale)
        dq_b, dk_b, dv_b = _flash_cpu_backward(grad_o, q, k[:, :, h:], v[:, :, h:], o, lse, True, scale)
        return dq_a + dq_b, torch.cat([dk_a, dk_b], dim=2), torch.cat([dv_a, dv_b], dim=2), None, None
