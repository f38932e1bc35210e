"""The MoE experts' weighted SwiGLU, ``act = silu(gate) * up * w``, and its backward in one pass.

    gate_up_PJ = [gate | up]   [P, 2I]  (the gate/up grouped GEMM's output, P expert-sorted pairs)
    w_P                        [P]      (each pair's combine weight)
    act_PI = silu(gate) * up * w                                        [P, I]
    backward, from d_act_PI:
        d_up   = d_act * w * silu(gate)
        d_gate = d_act * w * up * s (1 + gate (1 - s)),   s = sigmoid(gate)
        d_w    = sum over I of d_act * silu(gate) * up                  [P]

The lean MoE block (``harts.models.layers.moe._LeanRoutedExperts``) keeps only the gate/up
output (or recomputes it) and needs, in its backward, ``act`` again (for the down projection's
weight gradient) and both input gradients. Through autograd that is three passes over the
``[P, 2I]`` tensor: the compiled forward again, then Inductor's backward as a pointwise kernel
(``d_gate_up``) and a separate reduction over I (``d_w``), each reading ``gate_up`` and ``d_act``:
about twice the bytes the backward needs. ``weighted_swiglu_backward`` reads ``gate_up``, ``w`` and ``d_act`` once and writes ``act``,
``d_gate_up`` and ``d_w`` in one kernel: half the traffic of the three passes.

Numerics: float32 inside (as the compiled forms), each output rounded once to its input's dtype;
equal to the autograd reference up to float32 operation order (a rounding step of the output
dtype at most). Triton only, because no maintained kernel fuses this routed-weight SwiGLU
backward with its weight reduction. The kernel runs on CUDA and, on a CPU machine with Triton,
through Triton's interpreter (the tests); float64, other dtypes and non-Triton machines run the
reference (autograd through ``weighted_swiglu``'s eager form, what the lean block ran before).
The first call per (device, dtype, I) also runs the reference (eager) on its first
``CHECK_ROWS`` pairs and compares; where the kernel fails or differs it warns once and the
reference runs from then on.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from harts.ops.compiled import cuda_compiled
from harts.ops.kernel_check import kernel_passes

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU installs without Triton run the reference
    triton = None

__all__ = ["kernel_applies", "weighted_swiglu", "weighted_swiglu_backward", "weighted_swiglu_backward_reference"]


@cuda_compiled(rows=(0, 1))
def weighted_swiglu(gate_up_PJ: torch.Tensor, w_P: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up * w`` of pairs P, [P, 2I] -> [P, I] (gate and up: the two halves of
    ``gate_up``), computed in float32 (or float64) and rounded once to the input dtype; one fused
    pass each way on CUDA (the backward forms d(gate_up) and d(w), a reduction over I, together)."""
    work = torch.promote_types(gate_up_PJ.dtype, torch.float32)
    gate, up = gate_up_PJ.to(work).chunk(2, dim=-1)
    return (F.silu(gate) * up * w_P[:, None].to(work)).to(gate_up_PJ.dtype)


def weighted_swiglu_backward_reference(
    gate_up_PJ: torch.Tensor, w_P: torch.Tensor, d_act_PI: torch.Tensor, *, eager: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(act [P, I], d_gate_up [P, 2I], d_w [P]) by autograd through ``weighted_swiglu`` (compiled
    on CUDA, eager elsewhere or with ``eager``): ``weighted_swiglu_backward``'s reference."""
    fn = weighted_swiglu.eager if eager else weighted_swiglu
    with torch.enable_grad():
        gu = gate_up_PJ.detach().requires_grad_()
        w = w_P.detach().requires_grad_()
        act = fn(gu, w)
    d_gu, d_w = torch.autograd.grad(act, (gu, w), d_act_PI)
    return act.detach(), d_gu, d_w


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def kernel_applies(gate_up_PJ: torch.Tensor, w_P: torch.Tensor, d_act_PI: torch.Tensor) -> bool:
    """Whether ``weighted_swiglu_backward`` runs the kernel for these inputs (module docstring)."""
    return (
        triton is not None
        and gate_up_PJ.dim() == 2
        and gate_up_PJ.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and d_act_PI.dtype == gate_up_PJ.dtype
        and w_P.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and (gate_up_PJ.is_cuda or _interpreted())
        and gate_up_PJ.device == w_P.device == d_act_PI.device
    )


#: per (device type, dtype, w dtype, I): whether the kernel's first call matched the reference
_checked: dict[tuple, bool] = {}


def weighted_swiglu_backward(
    gate_up_PJ: torch.Tensor, w_P: torch.Tensor, d_act_PI: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(act [P, I], d_gate_up [P, 2I], d_w [P]) of ``act = weighted_swiglu(gate_up, w)`` and the
    gradient ``d_act`` of act: the forward again and both input gradients, one kernel where
    ``kernel_applies`` (module docstring), else ``weighted_swiglu_backward_reference``. Not
    differentiable (a backward's building block); outputs in their inputs' dtypes."""
    p, j = gate_up_PJ.shape if gate_up_PJ.dim() == 2 else (-1, -1)
    if gate_up_PJ.dim() != 2 or j % 2 or w_P.shape != (p,) or d_act_PI.shape != (p, j // 2):
        raise ValueError(
            "weighted_swiglu_backward: needs gate_up [P, 2I], w [P] and d_act [P, I]; got "
            f"{list(gate_up_PJ.shape)}, {list(w_P.shape)}, {list(d_act_PI.shape)}"
        )
    if not kernel_applies(gate_up_PJ, w_P, d_act_PI):
        return weighted_swiglu_backward_reference(gate_up_PJ, w_P, d_act_PI)
    key = (gate_up_PJ.device.type, gate_up_PJ.dtype, w_P.dtype, j // 2)
    # checked on the first CHECK_ROWS pairs (rows are independent), against eager autograd: no
    # compilation of the training graph and no float32 temporaries of the whole [P, 2I]; a call
    # without pairs leaves the check to the next one (the kernel writes nothing)
    part = (gate_up_PJ[:CHECK_ROWS], w_P[:CHECK_ROWS], d_act_PI[:CHECK_ROWS])
    if p and not kernel_passes(
        _checked,
        key,
        lambda: weighted_swiglu_backward_reference(*part, eager=True),
        lambda: _kernel(*part),
        _close,
        name="weighted-SwiGLU backward",
        differs="its output differed from the autograd reference",
        fallback="autograd's backward runs",
    ):
        return weighted_swiglu_backward_reference(gate_up_PJ, w_P, d_act_PI)
    return _kernel(gate_up_PJ, w_P, d_act_PI)


#: pairs the first call per key checks against the reference
CHECK_ROWS = 4096


def _close(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> bool:
    """Each output within a few rounding steps of its dtype (relative to its largest entry: d_w
    sums I products, in float32 on both sides but in another order)."""
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}
    for g, w in zip(got, want, strict=True):
        if g.shape != w.shape or g.dtype != w.dtype:
            return False
        if not w.numel():
            continue
        scale = max(float(w.abs().max()), 1e-30)
        if float((g.float() - w.float()).abs().max()) > tol[w.dtype] * scale:
            return False
    return True


#: rows per program x columns per step: a [BLOCK_P, BLOCK_I] tile of about 4,096 elements
TILE = 4096
MAX_BLOCK_I = 1024


def _kernel(
    gate_up_PJ: torch.Tensor, w_P: torch.Tensor, d_act_PI: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gu, w, da = gate_up_PJ.contiguous(), w_P.contiguous(), d_act_PI.contiguous()
    p, i = da.shape
    act = torch.empty_like(da)
    d_gu = torch.empty_like(gu)
    d_w = torch.empty_like(w)
    if p == 0:
        return act, d_gu, d_w.zero_()
    block_i = min(triton.next_power_of_2(max(i, 1)), MAX_BLOCK_I)
    block_p = max(1, TILE // block_i)
    _weighted_swiglu_bwd_kernel[(triton.cdiv(p, block_p),)](
        gu, w, da, act, d_gu, d_w, p, i, BLOCK_P=block_p, BLOCK_I=block_i, num_warps=4
    )
    return act, d_gu, d_w


if triton is not None:
    # P not specialized: Triton would compile a second variant for pair counts divisible by 16,
    # and the first microbatch of that class would pay the compilation inside its step
    @triton.jit(do_not_specialize=["P"])
    def _weighted_swiglu_bwd_kernel(
        gu, w, da, act, d_gu, d_w, P, I: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_I: tl.constexpr
    ):
        """One program per BLOCK_P pairs: every column block of their gate/up rows once (I, the
        experts' width, is fixed per model: a compile-time loop)."""
        rows = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
        m_rows = rows < P
        rows = rows.to(tl.int64)
        w_r = tl.load(w + rows, mask=m_rows, other=0.0).to(tl.float32)[:, None]
        acc = tl.zeros([BLOCK_P], dtype=tl.float32)
        for i0 in range(0, I, BLOCK_I):
            cols = i0 + tl.arange(0, BLOCK_I)
            m = m_rows[:, None] & (cols < I)[None, :]
            o_gate = rows[:, None] * (2 * I) + cols[None, :]
            o_act = rows[:, None] * I + cols[None, :]
            g = tl.load(gu + o_gate, mask=m, other=0.0).to(tl.float32)
            u = tl.load(gu + o_gate + I, mask=m, other=0.0).to(tl.float32)
            d = tl.load(da + o_act, mask=m, other=0.0).to(tl.float32)
            s = tl.sigmoid(g)
            silu = g * s
            su = silu * u
            tl.store(act + o_act, (su * w_r).to(act.dtype.element_ty), mask=m)
            d_su = d * w_r
            tl.store(d_gu + o_gate, (d_su * u * (s * (1.0 + g * (1.0 - s)))).to(d_gu.dtype.element_ty), mask=m)
            tl.store(d_gu + o_gate + I, (d_su * silu).to(d_gu.dtype.element_ty), mask=m)
            acc += tl.sum(d * su, axis=1)
        tl.store(d_w + rows, acc.to(d_w.dtype.element_ty), mask=m_rows)
