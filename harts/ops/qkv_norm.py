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

With ``rows`` (a ``harts.ops.row_gather`` plan: compact execution's linear-attention input rows,
every round's, replayed rows again), q, k and v come out gathered, ``[N, ...]`` for the plan's N
slots: the kernel reads each slot's source row, so the three gathers the linear attention did
after the split are gone. Its backward runs over the T source rows, each reading the gradient of
its first slot (zero for a row no slot reads); the few later slots of a row (replay) are added
in float32 by torch (``index_put_``, accumulating: deterministic).

Shapes: mixed_TC with C = 2 * HK * K + HV * V; q, k [T, HK, K]; v [T, HV, V] (T -> N with rows).
"""

from __future__ import annotations

import os
import warnings

import torch

from harts.ops.compiled import cuda_compiled
from harts.ops.row_gather import RowGatherPlan, gather_rows

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
    mixed_TC: torch.Tensor, hk: int, dk: int, hv: int, dv: int, eps: float = 1e-6, rows: RowGatherPlan | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The torch formulation: (q [T, HK, K], k [T, HK, K], v [T, HV, V]); v is a view of
    ``mixed_TC``. With ``rows``: each then gathered (``gather_rows``), [N, ...]."""
    t = mixed_TC.shape[0]
    q, k, v = torch.split(mixed_TC, [hk * dk, hk * dk, hv * dv], dim=-1)
    out = l2norm(q.reshape(t, hk, dk), eps), l2norm(k.reshape(t, hk, dk), eps), v.reshape(t, hv, dv)
    if rows is None:
        return out
    q, k, v = (gather_rows(x, rows) for x in out)
    return q, k, v


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
    mixed_TC: torch.Tensor, hk: int, dk: int, hv: int, dv: int, eps: float = 1e-6, rows: RowGatherPlan | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [T, HK, K], k [T, HK, K], v [T, HV, V]), q and k l2-normed over K, from
    ``mixed_TC [T, 2 HK K + HV V]``; differentiable. The kernel where ``kernel_applies`` (all
    three outputs contiguous), else ``split_l2norm_qkv_reference``. ``rows``: gathered to the
    plan's N slots (module docstring), [N, ...] each."""
    if mixed_TC.dim() != 2 or mixed_TC.shape[1] != 2 * hk * dk + hv * dv:
        raise ValueError(
            f"split_l2norm_qkv: mixed must be [T, 2*{hk}*{dk} + {hv}*{dv}] = [T, {2 * hk * dk + hv * dv}], "
            f"got {list(mixed_TC.shape)}"
        )
    if rows is not None and rows.num_rows != mixed_TC.shape[0]:
        raise ValueError(f"split_l2norm_qkv: rows gather from {rows.num_rows} rows; mixed has {mixed_TC.shape[0]}")
    if not kernel_applies(mixed_TC, hk, dk, hv, dv):
        return split_l2norm_qkv_reference(mixed_TC, hk, dk, hv, dv, eps, rows)
    key = (mixed_TC.device.type, mixed_TC.dtype, hk, dk, hv, dv, rows is not None)
    if key not in _checked:
        # without autograd: under activation checkpointing the first call's forward and its
        # recomputation must save the same tensors
        with torch.no_grad():
            want = split_l2norm_qkv_reference(mixed_TC, hk, dk, hv, dv, eps, rows)
            try:
                got = _forward(mixed_TC, hk, dk, hv, dv, eps, None if rows is None else rows.index)
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
        return split_l2norm_qkv_reference(mixed_TC, hk, dk, hv, dv, eps, rows)
    q, k, v = _SplitL2Norm.apply(mixed_TC, hk, dk, hv, dv, eps, rows)
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
    def forward(ctx, mixed_TC, hk, dk, hv, dv, eps, rows):  # type: ignore[no-untyped-def, override]
        mixed = mixed_TC.contiguous()
        ctx.save_for_backward(mixed)
        ctx.dims, ctx.rows = (hk, dk, hv, dv, eps), rows
        return _forward(mixed, hk, dk, hv, dv, eps, None if rows is None else rows.index)

    @staticmethod
    def backward(ctx, dq, dk_, dv_):  # type: ignore[no-untyped-def, override]
        (mixed,) = ctx.saved_tensors
        hk, dk, hv, dv, eps = ctx.dims
        rows: RowGatherPlan | None = ctx.rows
        t = mixed.shape[0]
        n = t if rows is None else rows.index.numel()
        dq = torch.zeros(n, hk, dk, dtype=mixed.dtype, device=mixed.device) if dq is None else dq.contiguous()
        dk_ = torch.zeros(n, hk, dk, dtype=mixed.dtype, device=mixed.device) if dk_ is None else dk_.contiguous()
        dv_ = torch.zeros(n, hv, dv, dtype=mixed.dtype, device=mixed.device) if dv_ is None else dv_.contiguous()
        dmixed = torch.empty_like(mixed)
        if t:
            grid = (triton.cdiv(t, BLOCK_T), 2 * hk + hv)
            first = rows.primary_or_unread if rows is not None else dmixed
            _split_l2norm_bwd_kernel[grid](
                mixed, dq, dk_, dv_, dmixed, first, t,
                HK=hk, DK=dk, HV=hv, DV=dv, EPS=eps, BLOCK_T=BLOCK_T, GATHER=rows is not None,
            )  # fmt: skip
        if rows is not None and rows.extra_rows is not None and rows.extra_slots is not None:
            # a row's later slots (replay): their gradients added in float32, in torch
            x = mixed[rows.extra_rows].float()
            d = _l2norm_split_grad(x, dq[rows.extra_slots], dk_[rows.extra_slots], dv_[rows.extra_slots], hk, dk, eps)
            dmixed.index_put_((rows.extra_rows,), d.to(dmixed.dtype), accumulate=True)
        return dmixed, None, None, None, None, None, None


def _l2norm_split_grad(
    x_EC: torch.Tensor, dq: torch.Tensor, dk_: torch.Tensor, dv_: torch.Tensor, hk: int, dk: int, eps: float
) -> torch.Tensor:
    """The split's gradient of rows ``x_EC`` (float32 [E, C]) from their q / k / v gradients
    [E, H, *], in float32: ``d x = r dy - x r^3 (dy . x)`` per q / k head, ``d v`` for v."""
    e = x_EC.shape[0]
    parts = []
    for i, dy in enumerate((dq, dk_)):
        x = x_EC[:, i * hk * dk : (i + 1) * hk * dk].reshape(e, hk, dk)
        dyf = dy.float()
        r = torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)
        parts.append((dyf * r - x * (r**3 * (dyf * x).sum(-1, keepdim=True))).reshape(e, -1))
    parts.append(dv_.float().reshape(e, -1))
    return torch.cat(parts, dim=-1)


def _forward(
    mixed: torch.Tensor, hk: int, dk: int, hv: int, dv: int, eps: float, index: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward kernel: q, k, v of every row, or of the rows ``index`` [N] reads."""
    mixed = mixed.contiguous()
    n = mixed.shape[0] if index is None else index.numel()
    q = torch.empty(n, hk, dk, dtype=mixed.dtype, device=mixed.device)
    k = torch.empty_like(q)
    v = torch.empty(n, hv, dv, dtype=mixed.dtype, device=mixed.device)
    if n:
        grid = (triton.cdiv(n, BLOCK_T), 2 * hk + hv)
        _split_l2norm_fwd_kernel[grid](
            mixed, q, k, v, mixed if index is None else index, n,
            HK=hk, DK=dk, HV=hv, DV=dv, EPS=eps, BLOCK_T=BLOCK_T, GATHER=index is not None,
        )  # fmt: skip
    return q, k, v


if triton is not None:
    # the row count T is not specialized (Triton would compile one variant for counts divisible
    # by 16 and one for the rest: a step's microbatches have both, and the second variant was
    # compiled inside a timed step)
    @triton.jit(do_not_specialize=["T"])
    def _split_l2norm_fwd_kernel(
        X,
        Q,
        K,
        V,
        IDX,
        T,
        HK: tl.constexpr,
        DK: tl.constexpr,
        HV: tl.constexpr,
        DV: tl.constexpr,
        EPS: tl.constexpr,
        BLOCK_T: tl.constexpr,
        GATHER: tl.constexpr,
    ):
        rows = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
        live = rows < T
        head = tl.program_id(1)
        width = 2 * HK * DK + HV * DV
        if GATHER:  # output row i reads source row IDX[i]
            src = tl.load(IDX + rows, mask=live, other=0).to(tl.int64)
        else:
            src = rows
        # (the branches name their values apart: Triton types a name across both branches)
        if head < 2 * HK:  # a q or k head: normalize
            ck = tl.arange(0, DK)
            x = tl.load(X + src[:, None] * width + head * DK + ck[None, :], mask=live[:, None], other=0.0)
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
            xv = tl.load(X + src[:, None] * width + 2 * HK * DK + vh * DV + cv[None, :], mask=live[:, None])
            tl.store(V + rows[:, None] * (HV * DV) + vh * DV + cv[None, :], xv, mask=live[:, None])

    @triton.jit(do_not_specialize=["T"])
    def _split_l2norm_bwd_kernel(
        X,
        DQ,
        DKK,
        DVV,
        DX,
        FIRST,
        T,
        HK: tl.constexpr,
        DK: tl.constexpr,
        HV: tl.constexpr,
        DV: tl.constexpr,
        EPS: tl.constexpr,
        BLOCK_T: tl.constexpr,
        GATHER: tl.constexpr,
    ):
        rows = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
        live = rows < T
        head = tl.program_id(1)
        width = 2 * HK * DK + HV * DV
        if GATHER:  # source row p takes the gradient of its first slot FIRST[p] (-1: none, zero)
            slot = tl.load(FIRST + rows, mask=live, other=-1).to(tl.int64)
            has = live & (slot >= 0)
            dyr = tl.maximum(slot, 0)
        else:
            has = live
            dyr = rows
        if head < 2 * HK:  # d x = r dy - x r^3 (dy . x), r = (sum x^2 + eps)^-1/2
            ck = tl.arange(0, DK)
            at = rows[:, None] * width + head * DK + ck[None, :]
            x = tl.load(X + at, mask=live[:, None], other=0.0).to(tl.float32)
            if head < HK:
                dy = tl.load(DQ + dyr[:, None] * (HK * DK) + head * DK + ck[None, :], mask=has[:, None], other=0.0)
            else:
                dy = tl.load(
                    DKK + dyr[:, None] * (HK * DK) + (head - HK) * DK + ck[None, :], mask=has[:, None], other=0.0
                )
            dyf = dy.to(tl.float32)
            r = tl.rsqrt(tl.sum(x * x, axis=1) + EPS)
            dot = tl.sum(dyf * x, axis=1)
            dx = dyf * r[:, None] - x * (r * r * r * dot)[:, None]
            tl.store(DX + at, dx.to(DX.dtype.element_ty), mask=live[:, None])
        else:
            cv = tl.arange(0, DV)
            vh = head - 2 * HK
            dv = tl.load(DVV + dyr[:, None] * (HV * DV) + vh * DV + cv[None, :], mask=has[:, None], other=0.0)
            tl.store(DX + rows[:, None] * width + 2 * HK * DK + vh * DV + cv[None, :], dv, mask=live[:, None])
