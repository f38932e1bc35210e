"""Mixture-of-experts FFN with deterministic no-drop top-k routing and q-weighted statistics.

Routing, dispatch and expert computation run on the rows given (compact rows in compact
mode, never expanded by multiplicity). Each row carries a weight ``w_T`` (its semantic
multiplicity q; 1 per row in trajectory mode, 0 for padding). With W = sum(w):

    z_loss     = sum_t w_t * logsumexp(logits_t)^2 / W
    P_e        = sum_t w_t * p_te / W                       routing-probability mass
    f_e        = sum_t w_t * [e in topk(t)] / W              assignment fraction
    aux_loss   = E * sum_e f_e * P_e                        (transformers' load_balancing_loss_func)
    counts_e   = sum_t w_t * [e in topk(t)]                 detached, for expert-bias updates

Because a compact row stands for q identical semantic rows with identical routing, every
quantity equals its trajectory-wise value.

Step-level statistics (an option; per-call statistics as above are the paper's default): when
``MoE.step_statistics = (counts_E, W)`` holds the whole step's q-weighted counts and weight, W
and f_e = counts_e / W are the step's, so z_loss and aux_loss of one call are its share of the
step's losses and their sum over the step's microbatches (and ranks) is the step-level loss
(``harts.trainer.step``, ``moe_statistics="step"``). ``p`` is softmax(logits) for softmax routing and
sigmoid(logits) normalized over experts for sigmoid routing.

Router (DeepSeek-V3 / Qwen3-Next): scores = softmax or sigmoid of ``gate.weight @ x``;
experts are chosen on ``scores + e_score_correction_bias`` inside the ``topk_group`` best of
``n_group`` groups (group score: sum of its top-2); weights are the unbiased scores of the
chosen experts, optionally normalized, times ``routed_scaling_factor``.

Shapes: x_TD, w_T, logits/scores_TE, topk_idx/topk_w_TK, counts_E.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from harts.models.config import HybridConfig
from harts.models.layers.mlp import MLP, swiglu
from harts.ops.compiled import cuda_compiled
from harts.ops.moe_swiglu import weighted_swiglu, weighted_swiglu_backward
from harts.ops.registry import MOE_FAST_PATHS
from harts.ops.router_topk import grouped_topk, grouped_topk_reference

__all__ = [
    "FAST_PATHS",
    "Dispatch",
    "Experts",
    "MoE",
    "TopKRouter",
    "grouped_mm_supported",
    "moe_statistics",
    "router_grad_split",
    "router_logits",
]


class TopKRouter(nn.Module):
    #: aux-loss-free balancing bias [E] (a registered buffer; ``HybridLM.update_expert_bias``)
    e_score_correction_bias: torch.Tensor

    def __init__(self, config: HybridConfig) -> None:
        super().__init__()
        self.num_experts = e = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.score = config.router_score
        self.norm_topk_prob = config.norm_topk_prob
        self.routed_scaling_factor = config.routed_scaling_factor
        self.n_group, self.topk_group = config.n_group, config.topk_group
        self.weight = nn.Parameter(torch.empty(e, config.hidden_size))
        nn.init.normal_(self.weight, std=config.initializer_range)
        self.register_buffer("e_score_correction_bias", torch.zeros(e), persistent=config.router_bias)

    def forward(
        self,
        x_TD: torch.Tensor,
        topk_idx: torch.Tensor | None = None,
        *,
        split_backward: bool = True,
        fused_topk: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns (logits_TE, scores_TE, topk_idx_TK, topk_w_TK); logits in >= float32.

        ``topk_idx``: the experts already chosen for these rows (by this router on the same
        rows and bias: checkpoint's recomputation reuses the forward's choice), else chosen here.
        ``split_backward``: ``router_logits``'s backward on tensor cores (bfloat16 on CUDA).
        ``fused_topk``: the choice in one kernel (``choose``'s ``fused``).
        """
        work = torch.promote_types(x_TD.dtype, torch.float32)
        logits = router_logits(x_TD, self.weight, work, split_backward=split_backward)
        scores = logits.softmax(-1) if self.score == "softmax" else logits.sigmoid()
        if topk_idx is None:
            topk_idx = self.choose(scores, fused=fused_topk)
        topk_w = scores.gather(1, topk_idx)
        if self.norm_topk_prob:
            topk_w = topk_w / (topk_w.sum(-1, keepdim=True) + 1e-20)
        return logits, scores, topk_idx, topk_w * self.routed_scaling_factor

    @torch.no_grad()
    def choose(self, scores_TE: torch.Tensor, *, fused: bool = False) -> torch.Tensor:
        """int64 [T, K]: the top-k experts of each row on ``scores + e_score_correction_bias``
        within its ``topk_group`` best groups (group score: the sum of its top 2), best first.
        ``fused``: one kernel (``harts.ops.router_topk.grouped_topk``) where it applies, else
        the torch reference (``grouped_topk_reference``)."""
        pick = grouped_topk if fused else grouped_topk_reference
        return pick(scores_TE, self.e_score_correction_bias, self.n_group, self.topk_group, self.top_k)


def router_logits(
    x_TD: torch.Tensor, weight_ED: torch.Tensor, work: torch.dtype, *, split_backward: bool = True
) -> torch.Tensor:
    """[T, E] router logits ``x @ weight^T`` in ``work`` (float32 or float64).

    Half-precision rows and weight on CUDA: one tensor-core GEMM of the half operands with
    float32 accumulation and output (``_HalfRouterLogits``). Its products are those of the
    upcast GEMM (a bf16 x bf16 product is exact in float32), without the float32 copy of x or a
    float32 GEMM on CUDA cores (torch keeps TF32 off). Its backward is the upcast GEMM's: with
    ``split_backward`` and bfloat16 (``router_grad_split``) on tensor cores, the float32 gradient
    split into two bfloat16 terms; else float32 GEMMs. Elsewhere: the upcast ``F.linear``, the
    reference.
    """
    half = (torch.float16, torch.bfloat16)
    if x_TD.is_cuda and x_TD.dtype in half and weight_ED.dtype == x_TD.dtype and work == torch.float32:
        return _HalfRouterLogits.apply(x_TD, weight_ED, split_backward and x_TD.dtype == torch.bfloat16)
    return F.linear(x_TD.to(work), weight_ED.to(work))


def _mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of half operands, accumulated and returned in float32 (a tensor-core GEMM on
    CUDA; the same exact products upcast elsewhere)."""
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


def router_grad_split(
    g_TE: torch.Tensor, x_TD: torch.Tensor, w_ED: torch.Tensor, need_x: bool = True, need_w: bool = True
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The router GEMM's input gradients ``(g @ w, g^T @ x)`` for a float32 ``g`` and bfloat16
    ``x``, ``w``, on tensor cores, rounded to x's and w's dtype.

    ``g`` is split as ``hi + lo``, both bfloat16 (``hi = bf16(g)``, ``lo = bf16(g - hi)``: g to
    within 2^-16 relative, bfloat16 keeping float32's range), and each gradient is one GEMM of the
    half operands with float32 accumulation over the two terms side by side: ``[hi | lo] @ [w;
    w]`` and ``[hi | lo]^T @ x`` (its two [E, D] halves added in float32). Every product is exact
    in float32, so the result is the float32 GEMMs' to within the split's error, far below the
    final bfloat16 rounding (2^-8 relative). On CUDA this replaces two float32 CUDA-core GEMMs of
    [T, E] x [E, D] and a float32 copy of x per MoE layer (``python -m benchmarks.modules.moe``).
    """
    hi = g_TE.to(torch.bfloat16)
    lo = (g_TE - hi.float()).to(torch.bfloat16)
    g2 = torch.cat([hi, lo], dim=1)  # [T, 2E]
    e = g_TE.shape[1]
    d_x = _mm_f32(g2, torch.cat([w_ED, w_ED])).to(x_TD.dtype) if need_x else None
    d_w = None
    if need_w:
        both = _mm_f32(g2.t(), x_TD)  # [2E, D]
        d_w = (both[:e] + both[e:]).to(w_ED.dtype)
    return d_x, d_w


class _HalfRouterLogits(torch.autograd.Function):
    """logits = x @ w^T with half x, w and float32 logits; gradients as ``F.linear`` on the
    float32 copies gives them (float32 GEMMs, or ``router_grad_split``; rounded once to the
    half dtype)."""

    @staticmethod
    def forward(ctx, x_TD, w_ED, split):  # type: ignore[override]  # noqa: ANN001, ANN205
        ctx.save_for_backward(x_TD, w_ED)
        ctx.split = split
        if x_TD.is_cuda:
            return torch.mm(x_TD, w_ED.t(), out_dtype=torch.float32)
        return x_TD.float() @ w_ED.float().t()  # the same products (CPU torch has no out_dtype GEMM)

    @staticmethod
    def backward(ctx, g_TE):  # type: ignore[override]  # noqa: ANN001, ANN205
        x_TD, w_ED = ctx.saved_tensors
        g_TE = g_TE.float()
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if ctx.split:
            d_x, d_w = router_grad_split(g_TE, x_TD, w_ED, need_x, need_w)
            return d_x, d_w, None
        d_x = (g_TE @ w_ED.float()).to(x_TD.dtype) if need_x else None
        d_w = (g_TE.t() @ x_TD.float()).to(w_ED.dtype) if need_w else None
        return d_x, d_w, None


class Experts(nn.Module):
    """E SwiGLU (or relu2, Nemotron-H's) experts stored as 3-D tensors (transformers' layout).

    Two implementations of the same function (``impl``):

    * ``"grouped"``: every (row, chosen expert) pair is sorted by expert (stable, so ties keep
      row order), the rows are gathered once, and each projection is one ``torch._grouped_mm``
      over the per-expert groups (offsets from a scatter-add histogram, never read on the host).
      The combine weight scales the I-wide SwiGLU activation before the down projection (one
      fused pass, ``weighted_swiglu``), and each row's K outputs are gathered back and summed in
      top-k slot order (``sum_slots``): no atomics, so it is deterministic. No ``.item()``,
      ``.tolist()`` or ``unique``: the forward and backward never synchronize with the host, and
      no token is dropped.
    * ``"loop"``: the reference (one pair of GEMMs per hit expert; a host sync on ``unique``).
      It is what the tests compare ``"grouped"`` against, and the path for float64 (which
      ``torch._grouped_mm`` does not take).
    * ``"auto"`` (default): ``"grouped"`` where ``grouped_mm_supported`` (bfloat16 on CUDA;
      bfloat16, float16, float32 on CPU), else ``"loop"``.
    """

    IMPLS = ("auto", "grouped", "loop")

    def __init__(self, config: HybridConfig, impl: str = "auto") -> None:
        super().__init__()
        e, d, i = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.num_experts = e
        #: "silu" (SwiGLU: ``gate_up_proj`` [E, 2I, D]) or "relu2" (Nemotron-H: ``up_proj`` [E, I, D],
        #: ``down(relu(up x)^2)``, no gate)
        self.activation = config.hidden_act
        if self.activation == "silu":
            self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, d).normal_(std=config.initializer_range))
        else:
            self.up_proj = nn.Parameter(torch.empty(e, i, d).normal_(std=config.initializer_range))
        self.down_proj = nn.Parameter(torch.empty(e, d, i).normal_(std=config.initializer_range))
        self.impl = impl

    @property
    def weight_names(self) -> tuple[str, str]:
        """The names of the two stacked weights: (``gate_up_proj`` or ``up_proj``, ``down_proj``)."""
        return ("gate_up_proj" if self.activation == "silu" else "up_proj", "down_proj")

    @property
    def impl(self) -> str:
        return self._impl

    @impl.setter
    def impl(self, value: str) -> None:
        if value not in self.IMPLS:
            raise ValueError(f"MoE experts impl must be one of {self.IMPLS}; got {value!r}")
        self._impl = value

    def uses_grouped(self, x_TD: torch.Tensor) -> bool:
        """Whether ``forward`` takes the grouped path for rows like ``x_TD``."""
        return self._impl == "grouped" or (self._impl == "auto" and grouped_mm_supported(x_TD))

    def forward(
        self,
        x_TD: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_w: torch.Tensor,
        dispatch: Dispatch | None = None,
        *,
        permute_gather: bool = True,
        lean: bool = False,
        keep_gate_up: bool = False,
    ) -> torch.Tensor:
        """y_TD = sum_k topk_w[t, k] * expert_{topk_idx[t, k]}(x_t).

        Args:
            x_TD: [T, D] rows.
            topk_idx: int [T, K] chosen experts per row.
            topk_w: [T, K] their combine weights.
            dispatch: ``self.dispatch(topk_idx)`` when already made (checkpoint's recomputation
                reuses the forward's); the grouped path makes it otherwise, the loop ignores it.
            permute_gather: the combine weights follow the pairs' expert order through a
                gather whose backward is a gather too (``_Permute``); False: ``w[order]``, whose
                backward is autograd's sorting ``index_put`` (the reference).
            lean: the grouped path keeps only its inputs for the backward and recomputes the
                row gather, the gate/up GEMM and the SwiGLU there (``_LeanRoutedExperts``): for
                a MoE block whose forward survives checkpoint's recomputation
                (``recompute_skip=("moe",)``). The same function and gradients; the loop path
                ignores it.
            keep_gate_up: with ``lean``, keep the gate/up GEMM's output [T x K, 2I] for the
                backward instead of recomputing it (``ExecutionConfig.moe_keep_gate_up``).
        """
        if self.uses_grouped(x_TD):
            return self._forward_grouped(x_TD, topk_idx, topk_w, dispatch, permute_gather, lean, keep_gate_up)
        return self._forward_loop(x_TD, topk_idx, topk_w)

    def dispatch(self, topk_idx: torch.Tensor) -> Dispatch:
        """The (row, slot) pairs of ``topk_idx`` [T, K] sorted by expert (``Dispatch``), on the
        device, never read on the host."""
        k = topk_idx.shape[1]
        flat = topk_idx.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (row, slot) pairs grouped by expert
        counts = torch.zeros(self.num_experts, dtype=torch.int32, device=flat.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        offs = counts.cumsum(0, dtype=torch.int32)  # end row of each expert's group
        # back[j]: where (row, slot) pair j sits in expert order (the inverse permutation)
        back = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
        return Dispatch(order=order, offs=offs, src=order // k, back=back)

    def _forward_grouped(
        self,
        x_TD: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_w: torch.Tensor,
        dispatch: Dispatch | None,
        permute_gather: bool,
        lean: bool = False,
        keep_gate_up: bool = False,
    ) -> torch.Tensor:
        t, k = topk_idx.shape
        if t == 0 or k == 0:
            return torch.zeros_like(x_TD)
        d = self.dispatch(topk_idx) if dispatch is None else dispatch
        order, offs, src, back = d.order, d.offs, d.src, d.back
        if self.activation == "relu2":  # no lean variant: its inputs and activations are kept
            xs = _RowsToPairs.apply(x_TD, src, back, k)
            w_pairs = _Permute.apply(topk_w.reshape(-1), order, back) if permute_gather else topk_w.reshape(-1)[order]
            up = self._project("up_proj", xs, offs)
            act = F.relu(up).square() * w_pairs[:, None].to(up.dtype)
            return _PairsToRows.apply(self._project("down_proj", act, offs), src, back, k)
        if lean:  # adapted experts too, merged: the lean backward keeps only the block's inputs
            w1, w2 = self.gate_up_proj.to(x_TD.dtype), self.down_proj.to(x_TD.dtype)
            return _LeanRoutedExperts.apply(x_TD, topk_w, w1, w2, d, k, keep_gate_up)
        xs = _RowsToPairs.apply(x_TD, src, back, k)  # [T*K, D]
        gate_up = self._project("gate_up_proj", xs, offs)
        # the combine weight scales the I-wide activation before the (linear) down projection,
        # not its D-wide output: one fused pass instead of a separate [T*K, D] product
        w_pairs = _Permute.apply(topk_w.reshape(-1), order, back) if permute_gather else topk_w.reshape(-1)[order]
        act = weighted_swiglu(gate_up, w_pairs)
        h = self._project("down_proj", act, offs)
        # back to (row, slot) order, then sum the K slots of each row
        return _PairsToRows.apply(h, src, back, k)

    def _project(self, name: str, x_PK: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """``x @ w[e]^T`` [P, N] per expert group (``offs``) for the stacked weight ``name``
        [E, N, K]. A weight carrying a low-rank parametrization (``_low_rank``: LoRA's) runs in
        activation form, ``x W[e]^T + scale (x A[e]^T) B[e]^T`` on the frozen base ``W``: its
        backward makes no [E, N, K] weight gradient of the base, which the merged weight
        ``W + scale B A`` would (``harts.trainer.lora``)."""
        low = _low_rank(self, name)
        if low is None:
            return _GroupedLinear.apply(x_PK, getattr(self, name).to(x_PK.dtype), offs)
        base, a_ERK, b_ENR, scale = low
        xa = _GroupedLinear.apply(x_PK, a_ERK.to(x_PK.dtype), offs) * scale
        return _GroupedLinear.apply(x_PK, base.to(x_PK.dtype), offs) + _GroupedLinear.apply(
            xa, b_ENR.to(x_PK.dtype), offs
        )

    def _forward_loop(self, x_TD: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor) -> torch.Tensor:
        rows, outs = [], []
        hit = torch.unique(topk_idx).tolist()
        for e in hit:
            tok, slot = torch.nonzero(topk_idx == e, as_tuple=True)
            if self.activation == "relu2":
                h = F.linear(F.relu(F.linear(x_TD[tok], self.up_proj[e])).square(), self.down_proj[e])
            else:
                gate, up = F.linear(x_TD[tok], self.gate_up_proj[e]).chunk(2, dim=-1)
                h = F.linear(swiglu(gate, up), self.down_proj[e])
            outs.append(h * topk_w[tok, slot, None].to(h.dtype))
            rows.append(tok)
        if not outs:
            return torch.zeros_like(x_TD)
        return torch.zeros_like(x_TD).index_add(0, torch.cat(rows), torch.cat(outs))


def _low_rank(module: nn.Module, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float] | None:
    """(base [E, N, K], A [E, r, K], B [E, N, r], scale) of ``module.<name>`` when it is a
    parametrization whose one step is low-rank (an object with ``lora_A``, ``lora_B`` and
    ``scale``: ``harts.trainer.lora.LoraDelta``) of a rank the grouped GEMM takes (a multiple of
    8: its rows of r half-precision values must be 16-byte aligned); None otherwise (a plain
    weight, or the merged form). Duck-typed: the model layers do not import the trainer."""
    plists = getattr(module, "parametrizations", None)
    if plists is None or name not in plists:
        return None
    plist = plists[name]
    step = plist[0] if len(plist) == 1 else None
    a, b = getattr(step, "lora_A", None), getattr(step, "lora_B", None)
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor) or a.dim() != 3 or a.shape[1] % 8:
        return None
    return plist.original, a, b, float(step.scale)  # type: ignore[union-attr]


@cuda_compiled(rows=(0, 1))
def sum_slots(index_TK: torch.Tensor, x_TKD: torch.Tensor) -> torch.Tensor:
    """``y[t] = sum_k x[index[t, k]]`` over the rows of ``x`` ([T*K, D], passed as its [T, K, D]
    view so that both arguments are row-first in T), added in slot order k = 0..K-1 in float32
    (float64 for float64) and rounded once: [T, D].

    Written as K gathers added element-wise, not ``x[index].sum(1)``: on CUDA that is one
    pointwise kernel reading K rows per output row along D, where Inductor makes the ``sum(1)``
    form a reduction over K, slower than eager gather-then-sum. The row gathers ``x[src]`` stay
    eager: a compiled gather was slower than ``aten::index``
    (``benchmarks/results/ling3-tiny-kkkm_h200_2026-12-01_flex-tiles-conv.md``)."""
    flat = x_TKD.reshape(-1, x_TKD.shape[-1])
    work = torch.promote_types(flat.dtype, torch.float32)
    acc = flat[index_TK[:, 0]].to(work)
    for k in range(1, index_TK.shape[1]):
        acc = acc + flat[index_TK[:, k]].to(work)
    return acc.to(flat.dtype)


@dataclass(frozen=True)
class Dispatch:
    """Where every (row, slot) pair of a top-k choice goes in expert order (all on the device;
    P = T x K pairs, pair j = row j // K, slot j % K):

    * order: int64 [P], the pairs sorted by expert (stable: ties keep row order);
    * offs: int32 [E], the end of each expert's group in that order (``torch._grouped_mm``'s);
    * src: int64 [P], the row of each sorted pair (``order // K``);
    * back: int64 [P], the inverse permutation: where pair j sits in expert order.
    """

    order: torch.Tensor
    offs: torch.Tensor
    src: torch.Tensor
    back: torch.Tensor


class _Permute(torch.autograd.Function):
    """v[order] for a permutation ``order`` with inverse ``back``: the backward is the gather
    ``g[back]`` (autograd's for ``v[order]`` is an accumulating ``index_put``, which sorts)."""

    @staticmethod
    def forward(ctx, v, order, back):  # type: ignore[override]  # noqa: ANN001, ANN205
        ctx.save_for_backward(back)
        return v[order]

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]  # noqa: ANN001, ANN205
        (back,) = ctx.saved_tensors
        return g[back], None, None


class _LeanRoutedExperts(torch.autograd.Function):
    """The grouped routed experts, ``y = sum_k w_k * down_k(weighted SwiGLU(gate_up_k(x)))``,
    keeping only x, the combine weights, the weights and the ``Dispatch`` for the backward
    (``Experts.forward``'s ``lean``).

    The autograd path keeps the gathered rows [P, D], the gate/up output [P, 2I] and the
    activation [P, I] (P = T x K: 1.6, 1.1 and 0.5 GB at 65,536 rows of ``ling3_tiny``, per MoE
    layer). This backward recomputes the first two (one gather, one grouped GEMM) and then runs
    the autograd path's backward: the grouped GEMMs' input and weight gradients (``_grouped_mm``
    of the gradient with the weights, and of the transposed input with the gradient, per expert
    group), the gathers and slot sums of ``_RowsToPairs`` / ``_PairsToRows`` / ``_Permute``, and
    the SwiGLU's backward. That last one, with the activation recomputed, is one pass
    (``harts.ops.moe_swiglu.weighted_swiglu_backward``: a Triton kernel on CUDA, equal to autograd
    up to float32 operation order; autograd itself elsewhere), so on CPU its gradients are the
    autograd path's bit for bit (``tests/models/test_moe.py``).

    With ``keep_gate_up`` the gate/up output [P, 2I] is kept as well and the backward skips
    its GEMM (the same values: the GEMM is deterministic), for memory that holds it.

    Shapes: x [T, D], topk_w [T, K], w1 [E, 2I, D] (gate and up), w2 [E, D, I] (down).
    """

    @staticmethod
    def forward(ctx, x_TD, topk_w, w1, w2, d, k, keep_gate_up=False):  # type: ignore[override]  # noqa: ANN001, ANN205
        gate_up = torch._grouped_mm(x_TD[d.src], w1.transpose(1, 2), offs=d.offs)
        kept = (gate_up,) if keep_gate_up else ()
        ctx.save_for_backward(x_TD, topk_w, w1, w2, d.order, d.offs, d.src, d.back, *kept)
        ctx.k = k
        act = weighted_swiglu(gate_up, topk_w.reshape(-1)[d.order])
        h = torch._grouped_mm(act, w2.transpose(1, 2), offs=d.offs)
        return sum_slots(d.back.view(-1, k), h.view(-1, k, h.shape[-1]))

    @staticmethod
    def backward(ctx, g_TD):  # type: ignore[override]  # noqa: ANN001, ANN205
        x_TD, topk_w, w1, w2, order, offs, src, back, *kept = ctx.saved_tensors
        k = ctx.k
        xs = x_TD[src]
        gate_up = kept[0] if kept else torch._grouped_mm(xs, w1.transpose(1, 2), offs=offs)
        g_h = g_TD[src]  # each pair gets its row's gradient
        d_act = torch._grouped_mm(g_h, w2, offs=offs)
        # the SwiGLU again and both its input gradients in one pass (autograd's reference off CUDA)
        act, d_gu, d_w_pairs = weighted_swiglu_backward(gate_up, topk_w.reshape(-1)[order], d_act)
        d_w2 = torch._grouped_mm(g_h.t(), act, offs=offs)
        d_xs, d_w1 = _grouped_linear_grads(xs, w1, d_gu, offs)
        d_x = sum_slots(back.view(-1, k), d_xs.view(-1, k, d_xs.shape[-1]))
        return d_x, d_w_pairs[back].view_as(topk_w), d_w1, d_w2, None, None, None


def _grouped_linear_grads(
    x_PK: torch.Tensor, w_ENK: torch.Tensor, g_PN: torch.Tensor, offs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(d_x [P, K], d_w [E, N, K]) of ``y = x @ w[e]^T`` per expert group (``offs``): d_x = g @
    w[e] and d_w[e] = g_e^T @ x_e, the weight gradient made in the weight's own layout (its
    transpose, which autograd's ``_grouped_mm`` backward returns for ``w.transpose(1, 2)``, costs
    AccumulateGrad a strided copy of every expert weight per microbatch)."""
    return torch._grouped_mm(g_PN, w_ENK, offs=offs), torch._grouped_mm(g_PN.t(), x_PK, offs=offs)


class _GroupedLinear(torch.autograd.Function):
    """y [P, N] = x [P, K] @ w[e]^T for the rows of each expert group e (``offs``: int32 [E] group
    ends), w [E, N, K]; the backward is ``_grouped_linear_grads``' (the gradients asked for)."""

    @staticmethod
    def forward(ctx, x_PK, w_ENK, offs):  # type: ignore[override]  # noqa: ANN001, ANN205
        ctx.save_for_backward(x_PK, w_ENK, offs)
        return torch._grouped_mm(x_PK, w_ENK.transpose(1, 2), offs=offs)

    @staticmethod
    def backward(ctx, g_PN):  # type: ignore[override]  # noqa: ANN001, ANN205
        x_PK, w_ENK, offs = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        d_x = torch._grouped_mm(g_PN, w_ENK, offs=offs) if need_x else None
        d_w = torch._grouped_mm(g_PN.t(), x_PK, offs=offs) if need_w else None
        return d_x, d_w, None


class _RowsToPairs(torch.autograd.Function):
    """xs = x[src]: every row once per chosen expert, in expert order. The backward sums each
    row's K copies through the inverse permutation, ``g[back].view(T, K, D).sum(1)``: gathers
    and a sum in slot order, no scatter (autograd's index backward is a sorting index_put)."""

    @staticmethod
    def forward(ctx, x_TD, src, back, k):  # type: ignore[override]  # noqa: ANN001, ANN205
        ctx.save_for_backward(back)
        ctx.k = k
        return x_TD[src]

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]  # noqa: ANN001, ANN205
        (back,) = ctx.saved_tensors
        return sum_slots(back.view(-1, ctx.k), g.view(-1, ctx.k, g.shape[-1])), None, None, None


class _PairsToRows(torch.autograd.Function):
    """y = h[back].view(T, K, D).sum(1): each row's K expert outputs summed in slot order. The
    backward hands every pair its row's gradient, ``g[src]`` (a gather)."""

    @staticmethod
    def forward(ctx, h, src, back, k):  # type: ignore[override]  # noqa: ANN001, ANN205
        ctx.save_for_backward(src)
        return sum_slots(back.view(-1, k), h.view(-1, k, h.shape[-1]))

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]  # noqa: ANN001, ANN205
        (src,) = ctx.saved_tensors
        return g[src], None, None, None


def grouped_mm_supported(x: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` takes tensors like ``x``: bfloat16 on CUDA (the Hopper kernel,
    measured on an H200), bfloat16 / float16 / float32 on CPU (torch's portable fallback, tested
    here). Other CUDA dtypes (float32 correctness runs) keep the per-expert loop."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if x.is_cuda:
        return x.dtype == torch.bfloat16
    return x.dtype in (torch.bfloat16, torch.float16, torch.float32)


def moe_statistics(
    logits_TE: torch.Tensor,
    scores_TE: torch.Tensor,
    topk_idx: torch.Tensor,
    w_T: torch.Tensor,
    score: str,
    step: tuple[torch.Tensor, float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(z_loss, aux_loss, counts_E) weighted by row weights ``w_T`` (see module docstring);
    ``step = (counts_E, W)``: normalized by the whole step's statistics instead."""
    e = logits_TE.shape[-1]
    w = w_T.to(logits_TE.dtype)
    z_loss_sum = (w * torch.logsumexp(logits_TE, dim=-1).pow(2)).sum()
    probs = scores_TE if score == "softmax" else scores_TE / scores_TE.sum(-1, keepdim=True)
    mass_sum = (w[:, None] * probs).sum(0)
    assigned = torch.zeros_like(logits_TE).scatter_(1, topk_idx, 1.0)
    counts = (w[:, None] * assigned).sum(0).detach()
    if step is None:
        total, fraction = w.sum(), counts / w.sum()
    else:
        total, fraction = step[1], step[0].to(counts) / step[1]  # type: ignore[assignment]
    aux_loss = e * (fraction * mass_sum / total).sum()
    return z_loss_sum / total, aux_loss, counts


#: the MoE's fast paths (``harts.ops.registry.MOE_FAST_PATHS``), each with the code it replaces
#: kept as its reference: "router_split" (the router's backward on tensor cores,
#: ``router_grad_split``), "dispatch_reuse" (checkpoint's recomputation reuses the forward's
#: ``Dispatch``, no second sort), "permute_gather" (``Experts.forward``'s ``permute_gather``),
#: "router_topk" (the group-limited expert choice in one kernel, ``harts.ops.router_topk``)
FAST_PATHS = MOE_FAST_PATHS


class MoE(nn.Module):
    #: the whole step's (counts_E, W) for step-level statistics (module docstring); set and
    #: cleared by the training loop, None (per-call statistics) otherwise
    step_statistics: tuple[torch.Tensor, float] | None = None

    def __init__(self, config: HybridConfig) -> None:
        super().__init__()
        self.gate = TopKRouter(config)
        self.experts = Experts(config)
        self.score = config.router_score
        if config.num_shared_experts:
            per = config.shared_expert_intermediate_size or config.moe_intermediate_size
            self.shared_experts: MLP | None = MLP(
                config.hidden_size, per * config.num_shared_experts, config.hidden_act
            )
        else:
            self.shared_experts = None
        self.shared_expert_gate = (
            nn.Linear(config.hidden_size, 1, bias=False) if config.shared_expert_gate and self.shared_experts else None
        )
        #: the ``FAST_PATHS`` of a call that names none: the block run by itself (the MoE
        #: benchmark sets them); inside a model every call passes the kernel record's
        self.fast: frozenset[str] = frozenset(FAST_PATHS)

    def forward(
        self,
        x_TD: torch.Tensor,
        w_T: torch.Tensor,
        routing: Any = None,
        *,
        lean: bool = False,
        keep_gate_up: bool = False,
        fast: frozenset[str] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns (y_TD, z_loss, aux_loss, counts_E).

        ``routing``: a slot (``harts.models.recompute.kept_routing``: ``take()`` / ``put()``)
        that carries the forward's expert choice (and its ``Dispatch``, with "dispatch_reuse")
        to checkpoint's recomputation of this layer. ``lean``: the routed experts keep only
        their inputs for the backward (``Experts.forward``), for a block whose forward is kept
        through checkpoint's recomputation (``recompute_skip=("moe",)``); ``keep_gate_up``:
        they keep their gate/up output too (``ExecutionConfig.moe_keep_gate_up``). ``fast``: the
        fast paths in use (names of ``FAST_PATHS``; a model passes its kernel record's
        ``fast_paths``, of which only these count); None: ``self.fast``.
        """
        fast = self.fast if fast is None else fast
        kept = routing.take() if routing is not None else None
        chosen, dispatch = kept if kept is not None else (None, None)
        logits, scores, topk_idx, topk_w = self.gate(
            x_TD, chosen, split_backward="router_split" in fast, fused_topk="router_topk" in fast
        )
        experts = self.experts
        if isinstance(experts, Experts):
            if dispatch is None and "dispatch_reuse" in fast and routing is not None and experts.uses_grouped(x_TD):
                dispatch = experts.dispatch(topk_idx)
            y = experts(
                x_TD,
                topk_idx,
                topk_w,
                dispatch,
                permute_gather="permute_gather" in fast,
                lean=lean,
                keep_gate_up=keep_gate_up,
            )
        else:  # expert parallelism: its own exchange and dispatch
            y = experts(x_TD, topk_idx, topk_w)
        if routing is not None and kept is None:
            routing.put((topk_idx, dispatch))
        if self.shared_experts is not None:
            s = self.shared_experts(x_TD)
            if self.shared_expert_gate is not None:
                s = torch.sigmoid(self.shared_expert_gate(x_TD)) * s
            y = y + s
        z_loss, aux_loss, counts = moe_statistics(logits, scores, topk_idx, w_T, self.score, self.step_statistics)
        return y, z_loss, aux_loss, counts
