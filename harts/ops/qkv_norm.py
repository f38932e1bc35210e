"""The linear-attention input split: ``[q | k | v]`` after the short conv into l2-normed q, k and
a contiguous v, in one kernel each way.

    q_THK = l2norm(mixed[:, :H*K])          k_THK = l2norm(mixed[:, H*K:2*H*K])
    v_THV = mixed[:, 2*H*K:]                (l2norm(x) = x / sqrt(sum(x^2) + eps), last dim)

The torch formulation (``split_l2norm_qkv_reference``: ``split``, two l2 norms, reshapes) costs
three passes forward and, backward, two l2-norm gradients followed by a concatenation of the
three gradients into ``[T, 2HK + HV]`` (``split``'s backward), plus a copy of v wherever the
linear attention wants it contiguous. ``split_l2norm_qkv`` reads ``mixed`` once and writes q, k,
v forward, and backward reads the three gradients and the q / k inputs once and writes
``d mixed`` directly: no concatenation, no copy. On an H200, one ``ling3_tiny`` KDA layer at
65,536 rows (bf16) took 0.460 ms forward and 1.025 ms forward + backward against the
reference's 1.038 and 2.227 (``python -m harts.bench.qkv_norm_bench --device cuda``), and one
profiled trajectory-wise ``swe`` microbatch (18 KDA layers) about 29 ms less device time
(README, session 18).

Numerics: both forms take each row's sum of squares in float32 and round the result once to the
input dtype; the kernel's q / k equal the reference's up to float32 summation order (a rounding
step of the output dtype at most), v exactly.

Triton only, because no maintained kernel fuses this split (fla-core's l2norm kernel normalizes
one tensor; its conv has no split). The kernel runs on CUDA and, on a CPU machine with Triton,
through Triton's interpreter (the tests); elsewhere, for head dims that are not powers of two,
and for float64, the reference runs. The first call of each shape in a process also runs the
reference and compares; where the kernel fails or differs it warns once and the reference runs
from then on.

Shapes: mixed_TC with C = 2 * HK * K + HV * V; q, k [T, HK, K]; v [T, HV, V].
"""

from __future__ import annotations

import os
import warnings

import torch

from harts.ops.compiled import cuda_compiled

__all__ = ["kernel_applies", "l2norm", "split_l2norm_qkv", "split_l2norm_qkv_reference"]

try:  # Triton is a GPU extra; the torch reference runs without it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on machines without Triton
    triton = None  # type: ignore[assignment]


@cuda_compiled
def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim (fla's ``use_qk_l2norm_in_kernel``)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


#: rows per program (each program normalizes BLOCK_T rows of one head)
BLOCK_T = 32


def split_l2norm_qkv_reference(
    mixed_TC: torch.Tensor, hk: int, dk: int, hv: int, dv: int, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The torch formulation: (q [T, HK, K], k [T, HK, K], v [T, HV, V]); v is a view of
    ``mixed_TC``."""
    t = mixed_TC.shape[0]
    q, k, v = torch.split(mixed_TC, [hk * dk, hk * dk, hv * dv], dim=-1)
    return l2norm(q.reshape(t, hk, dk), eps), l2norm(k.reshape(t, hk, dk), eps), v.reshape(t, hv, dv)


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def kernel_applies(mixed_TC: torch.Tensor, hk: int, dk: int, hv: int, dv: int) -> bool:
    """Whether ``split_l2norm_qkv`` runs the kernel for this input (module docstring)."""
    return (
        triton is not None
        and mixed_TC.dim() == 2
        and mixed_TC.shape[1] == 2 * hk * dk + hv * dv
        and mixed_TC.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and _pow2(dk)
        and _pow2(dv)
        and 16 <= min(dk, dv)
        and max(dk, dv) <= 256
        and (mixed_TC.is_cuda or _interpreted())
    )


#: per (device type, dtype, HK, K, HV, V): whether the kernel's first forward matched the reference
_checked: dict[tuple, bool] = {}


def split_l2norm_qkv(
    mixed_TC: torch.Tensor, hk: int, dk: int, hv: int, dv: int, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [T, HK, K], k [T, HK, K], v [T, HV, V]), q and k l2-normed over K, from
    ``mixed_TC [T, 2 HK K + HV V]``; differentiable. The kernel where ``kernel_applies`` (all
    three outputs contiguous), else ``split_l2norm_qkv_reference``."""
    if mixed_TC.dim() != 2 or mixed_TC.shape[1] != 2 * hk * dk + hv * dv:
        raise ValueError(
            f"split_l2norm_qkv: mixed must be [T, 2*{hk}*{dk} + {hv}*{dv}] = [T, {2 * hk * dk + hv * dv}], "
            f"got {list(mixed_TC.shape)}"
        )
    if not kernel_applies(mixed_TC, hk, dk, hv, dv):
        return split_l2norm_qkv_reference(mixed_TC, hk, dk, hv, dv, eps)
    key = (mixed_TC.device.type, mixed_TC.dtype, hk, dk, hv, dv)
    if key not in _checked:
        # without autograd: under activation checkpointing the first call's forward and its
        # recomputation must save the same tensors
        with torch.no_grad():
            want = split_l2norm_qkv_reference(mixed_TC, hk, dk, hv, dv, eps)
            try:
                got = _forward(mixed_TC, hk, dk, hv, dv, eps)
                why = None if _close(got, want) else "its output differed from the torch reference"
            except Exception as e:  # noqa: BLE001 - any compile or launch failure means: use the reference
                why = f"it failed ({type(e).__name__}: {e})"
        _checked[key] = why is None
        if why is not None:
            warnings.warn(
                f"harts' split-l2norm kernel is off for {key}: {why}; the torch split and l2 norms run",
                stacklevel=2,
            )
    if not _checked[key]:
        return split_l2norm_qkv_reference(mixed_TC, hk, dk, hv, dv, eps)
    q, k, v = _SplitL2Norm.apply(mixed_TC, hk, dk, hv, dv, eps)
    return q, k, v


def _close(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> bool:
    """Equal up to a rounding step of the dtype (q, k) and exactly (v)."""
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}[want[0].dtype]
    return (
        all(g.shape == w.shape and g.dtype == w.dtype for g, w in zip(got, want, strict=True))
        and all(
            torch.allclose(g.float(), w.float(), rtol=tol, atol=tol) for g, w in zip(got[:2], want[:2], strict=True)
        )
        and torch.equal(got[2], want[2])
    )


class _SplitL2Norm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, mixed_TC, hk, dk, hv, dv, eps):  # type: ignore[no-untyped-def, override]
        mixed = mixed_TC.contiguous()
        ctx.save_for_backward(mixed)
        ctx.dims = (hk, dk, hv, dv, eps)
        return _forward(mixed, hk, dk, hv, dv, eps)

    @staticmethod
    def backward(ctx, dq, dk_, dv_):  # type: ignore[no-untyped-def, override]
        (mixed,) = ctx.saved_tensors
        hk, dk, hv, dv, eps = ctx.dims
        t = mixed.shape[0]
        dq = torch.zeros(t, hk, dk, dtype=mixed.dtype, device=mixed.device) if dq is None else dq.contiguous()
        dk_ = torch.zeros(t, hk, dk, dtype=mixed.dtype, device=mixed.device) if dk_ is None else dk_.contiguous()
        dv_ = torch.zeros(t, hv, dv, dtype=mixed.dtype, device=mixed.device) if dv_ is None else dv_.contiguous()
        dmixed = torch.empty_like(mixed)
        if t:
            grid = (triton.cdiv(t, BLOCK_T), 2 * hk + hv)
            _split_l2norm_bwd_kernel[grid](
                mixed, dq, dk_, dv_, dmixed, t, HK=hk, DK=dk, HV=hv, DV=dv, EPS=eps, BLOCK_T=BLOCK_T
            )
        return dmixed, None, None, None, None, None


def _forward(
    mixed: torch.Tensor, hk: int, dk: int, hv: int, dv: int, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    mixed = mixed.contiguous()
    t = mixed.shape[0]
    q = torch.empty(t, hk, dk, dtype=mixed.dtype, device=mixed.device)
    k = torch.empty_like(q)
    v = torch.empty(t, hv, dv, dtype=mixed.dtype, device=mixed.device)
    if t:
        grid = (triton.cdiv(t, BLOCK_T), 2 * hk + hv)
        _split_l2norm_fwd_kernel[grid](mixed, q, k, v, t, HK=hk, DK=dk, HV=hv, DV=dv, EPS=eps, BLOCK_T=BLOCK_T)
    return q, k, v


if triton is not None:

    @triton.jit
    def _split_l2norm_fwd_kernel(
        X,
        Q,
        K,
        V,
        T,
        HK: tl.constexpr,
        DK: tl.constexpr,
        HV: tl.constexpr,
        DV: tl.constexpr,
        EPS: tl.constexpr,
        BLOCK_T: tl.constexpr,
    ):
        rows = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
        live = rows < T
        head = tl.program_id(1)
        width = 2 * HK * DK + HV * DV
        # (the branches name their values apart: Triton types a name across both branches)
        if head < 2 * HK:  # a q or k head: normalize
            ck = tl.arange(0, DK)
            x = tl.load(X + rows[:, None] * width + head * DK + ck[None, :], mask=live[:, None], other=0.0)
            xf = x.to(tl.float32)
            r = tl.rsqrt(tl.sum(xf * xf, axis=1) + EPS)
            y = (xf * r[:, None]).to(Q.dtype.element_ty)
            if head < HK:
                tl.store(Q + rows[:, None] * (HK * DK) + head * DK + ck[None, :], y, mask=live[:, None])
            else:
                tl.store(K + rows[:, None] * (HK * DK) + (head - HK) * DK + ck[None, :], y, mask=live[:, None])
        else:  # a v head: copy
            cv = tl.arange(0, DV)
            vh = head - 2 * HK
            xv = tl.load(X + rows[:, None] * width + 2 * HK * DK + vh * DV + cv[None, :], mask=live[:, None])
            tl.store(V + rows[:, None] * (HV * DV) + vh * DV + cv[None, :], xv, mask=live[:, None])

    @triton.jit
    def _split_l2norm_bwd_kernel(
        X,
        DQ,
        DKK,
        DVV,
        DX,
        T,
        HK: tl.constexpr,
        DK: tl.constexpr,
        HV: tl.constexpr,
        DV: tl.constexpr,
        EPS: tl.constexpr,
        BLOCK_T: tl.constexpr,
    ):
        rows = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
        live = rows < T
        head = tl.program_id(1)
        width = 2 * HK * DK + HV * DV
        if head < 2 * HK:  # d x = r dy - x r^3 (dy . x), r = (sum x^2 + eps)^-1/2
            ck = tl.arange(0, DK)
            at = rows[:, None] * width + head * DK + ck[None, :]
            x = tl.load(X + at, mask=live[:, None], other=0.0).to(tl.float32)
            if head < HK:
                dy = tl.load(DQ + rows[:, None] * (HK * DK) + head * DK + ck[None, :], mask=live[:, None], other=0.0)
            else:
                dy = tl.load(
                    DKK + rows[:, None] * (HK * DK) + (head - HK) * DK + ck[None, :], mask=live[:, None], other=0.0
                )
            dyf = dy.to(tl.float32)
            r = tl.rsqrt(tl.sum(x * x, axis=1) + EPS)
            dot = tl.sum(dyf * x, axis=1)
            dx = dyf * r[:, None] - x * (r * r * r * dot)[:, None]
            tl.store(DX + at, dx.to(DX.dtype.element_ty), mask=live[:, None])
        else:
            cv = tl.arange(0, DV)
            vh = head - 2 * HK
            dv = tl.load(DVV + rows[:, None] * (HV * DV) + vh * DV + cv[None, :], mask=live[:, None])
            tl.store(DX + rows[:, None] * width + 2 * HK * DK + vh * DV + cv[None, :], dv, mask=live[:, None])
