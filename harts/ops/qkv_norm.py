"""The linear-attention input split: ``[q | k | v]`` after the short conv into l2-normed q, k and
a contiguous v, in one kernel each way, optionally with the conv's SiLU applied first.

    a = silu(mixed) with activation="silu", else mixed
    q_THK = l2norm(a[:, :H*K])              k_THK = l2norm(a[:, H*K:2*H*K])
    v_THV = a[:, 2*H*K:]                    (l2norm(x) = x / sqrt(sum(x^2) + eps), last dim)

The torch formulation (``split_l2norm_qkv_reference``: ``split``, two l2 norms, reshapes) costs
three passes forward and, backward, two l2-norm gradients followed by a concatenation of the
three gradients into ``[T, 2HK + HV]`` (``split``'s backward), plus a copy of v wherever the
linear attention wants it contiguous. ``split_l2norm_qkv`` reads ``mixed`` once and writes q, k,
v forward, and backward reads the three gradients and the q / k inputs once and writes
``d mixed`` directly: no concatenation, no copy: about half the reference's time per layer
(``python -m benchmarks.ops.qkv_norm --device cuda``; ``benchmarks/results/ling3-tiny_h200_2026-12-02_qkv-norm-kernel.md``).

Numerics: both forms take each row's sum of squares in float32 and round the result once to the
input dtype; the kernel's q / k equal the reference's up to float32 summation order (a rounding
step of the output dtype at most), v exactly.

**The SiLU** (``activation="silu"``): KDA's short conv then runs without its activation and
writes the pre-activation rows, which makes fla-core's conv much cheaper (its backward neither
recomputes the pre-activation output nor reads it per tap); a separate compiled SiLU + split +
norms would cost that saving again.
Here the SiLU costs the kernel no pass: forward it already reads every column and writes v,
backward it reads the v columns of ``mixed`` as well (its only extra traffic, ``[T, HV V]``). The
kernel keeps SiLU's output in float32 up to the norms, where the reference rounds it to the
input dtype first (at most a rounding step of difference; v then within one too, not exactly).
In float64 (the CPU tests) ``silu`` then the split is the conv-with-SiLU then the split, the same
operations in the same order.

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

import torch
import torch.nn.functional as F

from harts.ops.compiled import cuda_compiled
from harts.ops.kernel_check import kernel_passes
from harts.ops.row_gather import RowGatherPlan, gather_rows

__all__ = ["ACTIVATIONS", "kernel_applies", "l2norm", "split_l2norm_qkv", "split_l2norm_qkv_reference"]

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


ACTIVATIONS = (None, "silu")


def _check_activation(activation: str | None) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"split_l2norm_qkv: activation must be None or 'silu', got {activation!r}")


def split_l2norm_qkv_reference(
    mixed_TC: torch.Tensor,
    hk: int,
    dk: int,
    hv: int,
    dv: int,
    eps: float = 1e-6,
    rows: RowGatherPlan | None = None,
    activation: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The torch formulation: (q [T, HK, K], k [T, HK, K], v [T, HV, V]); v is a view of
    ``mixed_TC`` (of its SiLU with ``activation="silu"``). With ``rows``: each then gathered
    (``gather_rows``), [N, ...]."""
    _check_activation(activation)
    t = mixed_TC.shape[0]
    a = mixed_TC if activation is None else F.silu(mixed_TC)
    q, k, v = torch.split(a, [hk * dk, hk * dk, hv * dv], dim=-1)
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
    mixed_TC: torch.Tensor,
    hk: int,
    dk: int,
    hv: int,
    dv: int,
    eps: float = 1e-6,
    rows: RowGatherPlan | None = None,
    activation: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [T, HK, K], k [T, HK, K], v [T, HV, V]), q and k l2-normed over K, from
    ``mixed_TC [T, 2 HK K + HV V]`` (its SiLU first with ``activation="silu"``); differentiable.
    The kernel where ``kernel_applies`` (all three outputs contiguous), else
    ``split_l2norm_qkv_reference``. ``rows``: gathered to the plan's N slots (module docstring),
    [N, ...] each."""
    _check_activation(activation)
    if mixed_TC.dim() != 2 or mixed_TC.shape[1] != 2 * hk * dk + hv * dv:
        raise ValueError(
            f"split_l2norm_qkv: mixed must be [T, 2*{hk}*{dk} + {hv}*{dv}] = [T, {2 * hk * dk + hv * dv}], "
            f"got {list(mixed_TC.shape)}"
        )
    if rows is not None and rows.num_rows != mixed_TC.shape[0]:
        raise ValueError(f"split_l2norm_qkv: rows gather from {rows.num_rows} rows; mixed has {mixed_TC.shape[0]}")
    if not kernel_applies(mixed_TC, hk, dk, hv, dv):
        return split_l2norm_qkv_reference(mixed_TC, hk, dk, hv, dv, eps, rows, activation)
    key = (mixed_TC.device.type, mixed_TC.dtype, hk, dk, hv, dv, rows is not None, activation)
    # without autograd: under activation checkpointing the first call's forward and its
    # recomputation must save the same tensors
    with torch.no_grad():
        passes = kernel_passes(
            _checked,
            key,
            lambda: split_l2norm_qkv_reference(mixed_TC, hk, dk, hv, dv, eps, rows, activation),
            lambda: _forward(mixed_TC, hk, dk, hv, dv, eps, None if rows is None else rows.index, activation),
            lambda got, want: _close(got, want, exact_v=activation is None),
            name="split-l2norm",
            differs="its output differed from the torch reference",
            fallback="the torch split and l2 norms run",
        )
    if not passes:
        return split_l2norm_qkv_reference(mixed_TC, hk, dk, hv, dv, eps, rows, activation)
    q, k, v = _SplitL2Norm.apply(mixed_TC, hk, dk, hv, dv, eps, rows, activation)
    return q, k, v


def _close(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...], exact_v: bool = True) -> bool:
    """q and k equal up to a rounding step of the dtype; v exactly, or up to a rounding step too
    when not ``exact_v`` (after a SiLU, which the two sides compute in their own order)."""
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}[want[0].dtype]
    n_tol = 2 if exact_v else 3
    return (
        all(g.shape == w.shape and g.dtype == w.dtype for g, w in zip(got, want, strict=True))
        and all(
            torch.allclose(g.float(), w.float(), rtol=tol, atol=tol)
            for g, w in zip(got[:n_tol], want[:n_tol], strict=True)
        )
        and (not exact_v or torch.equal(got[2], want[2]))
    )


class _SplitL2Norm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, mixed_TC, hk, dk, hv, dv, eps, rows, activation):  # type: ignore[no-untyped-def, override]
        mixed = mixed_TC.contiguous()
        ctx.save_for_backward(mixed)
        ctx.dims, ctx.rows, ctx.activation = (hk, dk, hv, dv, eps), rows, activation
        return _forward(mixed, hk, dk, hv, dv, eps, None if rows is None else rows.index, activation)

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
                SILU=ctx.activation == "silu",
            )  # fmt: skip
        if rows is not None and rows.extra_rows is not None and rows.extra_slots is not None:
            # a row's later slots (replay): their gradients added in float32, in torch
            x = mixed[rows.extra_rows].float()
            d = _l2norm_split_grad(
                x, dq[rows.extra_slots], dk_[rows.extra_slots], dv_[rows.extra_slots], hk, dk, eps, ctx.activation
            )
            dmixed.index_put_((rows.extra_rows,), d.to(dmixed.dtype), accumulate=True)
        return dmixed, None, None, None, None, None, None, None


def _l2norm_split_grad(
    x_EC: torch.Tensor,
    dq: torch.Tensor,
    dk_: torch.Tensor,
    dv_: torch.Tensor,
    hk: int,
    dk: int,
    eps: float,
    activation: str | None = None,
) -> torch.Tensor:
    """The split's gradient of rows ``x_EC`` (float32 [E, C]) from their q / k / v gradients
    [E, H, *], in float32: ``d a = r dy - a r^3 (dy . a)`` per q / k head, ``d v`` for v, with
    ``a = x`` (``a = silu(x)`` and ``d x = d a * silu'(x)`` with ``activation="silu"``)."""
    e = x_EC.shape[0]
    a_EC = x_EC if activation is None else F.silu(x_EC)
    parts = []
    for i, dy in enumerate((dq, dk_)):
        a = a_EC[:, i * hk * dk : (i + 1) * hk * dk].reshape(e, hk, dk)
        dyf = dy.float()
        r = torch.rsqrt((a * a).sum(-1, keepdim=True) + eps)
        parts.append((dyf * r - a * (r**3 * (dyf * a).sum(-1, keepdim=True))).reshape(e, -1))
    parts.append(dv_.float().reshape(e, -1))
    da = torch.cat(parts, dim=-1)
    if activation is None:
        return da
    s = torch.sigmoid(x_EC)
    return da * s * (1 + x_EC * (1 - s))


def _forward(
    mixed: torch.Tensor,
    hk: int,
    dk: int,
    hv: int,
    dv: int,
    eps: float,
    index: torch.Tensor | None = None,
    activation: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward kernel: q, k, v of every row, or of the rows ``index`` [N] reads (of the
    rows' SiLU with ``activation="silu"``)."""
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
            SILU=activation == "silu",
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
        SILU: tl.constexpr,
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
            if SILU:
                xf = xf / (1.0 + tl.exp(-xf))
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
            if SILU:
                xvf = xv.to(tl.float32)
                xv = (xvf / (1.0 + tl.exp(-xvf))).to(V.dtype.element_ty)
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
        SILU: tl.constexpr,
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
            if SILU:  # the norms' input a = silu(x); d x = d a * s (1 + x (1 - s)), s = sigmoid(x)
                s = 1.0 / (1.0 + tl.exp(-x))
                a = x * s
            else:
                a = x
            if head < HK:
                dy = tl.load(DQ + dyr[:, None] * (HK * DK) + head * DK + ck[None, :], mask=has[:, None], other=0.0)
            else:
                dy = tl.load(
                    DKK + dyr[:, None] * (HK * DK) + (head - HK) * DK + ck[None, :], mask=has[:, None], other=0.0
                )
            dyf = dy.to(tl.float32)
            r = tl.rsqrt(tl.sum(a * a, axis=1) + EPS)
            dot = tl.sum(dyf * a, axis=1)
            dx = dyf * r[:, None] - a * (r * r * r * dot)[:, None]
            if SILU:
                dx = dx * s * (1.0 + x * (1.0 - s))
            tl.store(DX + at, dx.to(DX.dtype.element_ty), mask=live[:, None])
        else:
            cv = tl.arange(0, DV)
            vh = head - 2 * HK
            dv = tl.load(DVV + dyr[:, None] * (HV * DV) + vh * DV + cv[None, :], mask=has[:, None], other=0.0)
            vat = rows[:, None] * width + 2 * HK * DK + vh * DV + cv[None, :]
            if SILU:
                xv = tl.load(X + vat, mask=live[:, None], other=0.0).to(tl.float32)
                sv = 1.0 / (1.0 + tl.exp(-xv))
                dv = (dv.to(tl.float32) * sv * (1.0 + xv * (1.0 - sv))).to(DX.dtype.element_ty)
            tl.store(DX + vat, dv, mask=live[:, None])
