"""Mapped log-probabilities: compact logit rows -> per-semantic-position log p(target) (paper §3.5).

    logprobs[s] = z[rows[s], targets[s]] - logsumexp_v z[rows[s], v],   z = hidden @ weight^T

Several positions may read the same compact row with different targets (a fork). The forward
computes logits only for the unique rows, chunk by chunk, takes logsumexp once per unique row and
gathers each position's target logit from its row's chunk. The backward recomputes each chunk's
logits and forms d(logits) = onehot-scatter(grad) - (sum of the row's position grads) * softmax,
then accumulates d(hidden) and d(weight). A chunk's rows are chosen to fit a memory budget
(below); no n x V (or S x V) tensor is ever allocated (Eq. 19-20: backward sums every position's
gradient into its compact row).

Precision: log-softmax, logsumexp and the gradient accumulators are float32 (or float64 for
float64 inputs). With bf16/fp16 inputs on CUDA the two big GEMMs per chunk stay in the input dtype
with float32 accumulation and float32 output (``torch.mm(..., out_dtype=float32)``): the logits are
the exact float32 products of the half-precision operands, as in an upcast GEMM, but at tensor-core
speed (an upcast float32 GEMM over a 157 k vocabulary dominated a whole training step). The
backward feeds d(logits) to its GEMMs in the input dtype, as every half-precision trainer does.
Elsewhere (CPU, float32/float64 inputs) the operands are upcast as before.

Fused element-wise passes (CUDA, half inputs): around the cuBLAS GEMMs, each [row_chunk, V]
float32 logits chunk is read once per direction by a ``torch.compile``-generated kernel: the
forward's row logsumexp (its max and sum in one online pass, ``_row_max_and_sum``; twice with
``keep_probs``, which then writes the softmax), and the backward's -g_row * exp(logits - lse)
written straight in the half dtype. Eager torch makes 4-6 passes over the chunk there
(logsumexp's temporaries; sub_, exp_, mul_, the cast), which cost about a third of the LM head's
time at V = 157 k. The entries a
position's target adds to are then set to their float32 totals, rounded once, as the eager path
does. ``fused=False`` keeps the eager passes (the reference the GPU test compares against).

Kept probabilities (``keep_probs``): the backward above recomputes every chunk's logits, one of
the LM head's four [rows x V x D] GEMMs (a quarter of its GEMM time at V = 157 k). A kept chunk's
forward writes its softmax in the GEMM dtype (bf16 for half inputs on CUDA) beside its logsumexp
and keeps it for the backward, which then needs no logits at all: d(logits) = -grad_row * p, the
target entries set to their float32 totals from the kept target logits as above. This is how
Megatron's cross entropy keeps its softmax, for every row: U x V kept entries from forward to
backward (32.5 GB at 65,536 rows x 248,320 in bf16). Here it is chunk by chunk: the first chunks
are kept while their softmax fits the budget (below), the others recompute their logits.
Precision: the kept bf16 p is rounded once more before the product (relative error <= 2^-8 per
d(logits) entry instead of 2^-9; the GEMMs read d(logits) in bf16 either way); in float32 /
float64 nothing changes beyond rounding.

Memory budget (``budget``, bytes; ``head_budget``): one chunk's logits in the compute dtype take
at most the budget (``chunk_rows``: R = min(``row_chunk``, budget // (V x itemsize)) unique rows,
at least one), and by default (``keep_probs=None``, CUDA with half inputs) the kept softmax takes
at most the budget too (``kept_chunks``). So the head's [rows, V] tensors never take more than
about 2.5 budgets on CUDA in half precision (the kept softmax, one chunk's float32 logits and its
bf16 gradient) or 3 elsewhere (the eager passes' exp of a chunk), however many rows it serves;
beside them it holds O(P x D + V x D): the float32 d(hidden) and d(weight) accumulators. Peak
memory is O(R x V + P x D), not O(U x V). Where U x V is small the whole softmax fits and every
chunk is kept (the fastest head); where it is large only the first chunks are, and the head
never holds a whole-vocabulary softmax for all rows. ``keep_probs=True`` keeps every chunk
whatever it takes (all U x V: an explicit choice), False none. The default budget is
``CPU_CHUNK_BYTES`` on the CPU (426 rows at V = 157,184 in float32: a 4,096-row chunk, 2.6 GB,
and its logsumexp temporary dominated a small model's whole step) and ``HEAD_MEMORY_FRACTION``
of the device's total memory on CUDA: 4.9 GiB on an 80 GB H100, which holds 4,096-row chunks of
float32 logits up to V = 324 k and at V = 248,320 keeps the softmax of two of them, a fixed
share beside the model's own state whatever the rows. Of the total memory, not of what is free
now, so that the choice, and so the rounding, does not depend on what else happens to be
allocated. The index's chunk bounds are recut for R (``LogprobIndex.with_row_chunk``, O(U + n)
on the host); the result is the same up to the order of the weight-gradient sums.

Weight gradient: each chunk's d(weight) GEMM adds into the float32 accumulator in place (cuBLAS
with beta = 1, ``torch.addmm(..., out_dtype=float32, out=acc)``) instead of writing a [V, D]
float32 product and adding it in a second pass (about 1 ms per chunk at V = 157 k, D = 1,536).

Shapes: P hidden rows, D model dim, V vocabulary, n positions, U unique rows among rows_n.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import numpy as np
import torch

from harts.ops.compiled import cuda_compiled
from harts.ops.upload import upload

__all__ = [
    "CPU_CHUNK_BYTES",
    "HEAD_MEMORY_FRACTION",
    "ROW_CHUNK",
    "LogprobIndex",
    "chunk_rows",
    "head_budget",
    "kept_chunks",
    "logprob_index",
    "mapped_logprobs",
]

#: unique rows per logits chunk at most (``mapped_logprobs``' ``row_chunk``): the budget may cut it
ROW_CHUNK = 4096
#: the LM head's memory budget on the CPU (``head_budget``)
CPU_CHUNK_BYTES = 256 * 2**20
#: the LM head's memory budget on CUDA, as a fraction of the device's total memory (``head_budget``)
HEAD_MEMORY_FRACTION = 1 / 16


def head_budget(device_type: str, total_bytes: int | None = None) -> int | None:
    """The LM head's default memory budget in bytes (module docstring): ``CPU_CHUNK_BYTES`` on
    the CPU, ``HEAD_MEMORY_FRACTION`` of ``total_bytes`` (the device's total memory) elsewhere;
    None where that total is unknown."""
    if device_type == "cpu":
        return CPU_CHUNK_BYTES
    return None if total_bytes is None else int(HEAD_MEMORY_FRACTION * total_bytes)


def chunk_rows(vocab_size: int, itemsize: int, budget: int, row_chunk: int = ROW_CHUNK) -> int:
    """Unique rows per logits chunk: ``row_chunk``, cut so that one [rows, V] chunk of
    ``itemsize``-byte logits (the compute dtype: 4 for float32 and half inputs, 8 for float64)
    takes at most ``budget`` bytes (at least one row)."""
    return max(1, min(row_chunk, budget // (vocab_size * itemsize)))


def kept_chunks(bounds: list[int], vocab_size: int, itemsize: int, budget: int) -> int:
    """How many chunks, the first ones of ``bounds`` (unique-row bounds, [C + 1]), keep their
    softmax of ``itemsize``-byte entries within ``budget`` bytes altogether."""
    rows = budget // (vocab_size * itemsize)
    return int(np.searchsorted(np.asarray(bounds[1:]), rows, side="right"))


def mapped_logprobs(
    hidden_PD: torch.Tensor,
    lm_head_weight_VD: torch.Tensor,
    rows_n: torch.Tensor,
    targets_n: torch.Tensor,
    *,
    row_chunk: int = ROW_CHUNK,
    budget: int | None = None,
    fused: bool | None = None,
    keep_probs: bool | None = None,
    index: LogprobIndex | None = None,
) -> torch.Tensor:
    """log_softmax(hidden[rows] @ weight^T)[targets] without materializing n x V logits.

    Args:
        hidden_PD: [P, D] final hidden states on compact/physical rows.
        lm_head_weight_VD: [V, D] LM head weight.
        rows_n: int [n] hidden row of each position (rows may repeat); on the host (CPU), the
            index plan costs no device synchronization (a device tensor is copied back once).
        targets_n: int [n] target token of each position (host or device, as rows_n).
        row_chunk: unique rows per logits chunk at most (larger chunks make fewer [V, D]
            weight-gradient updates; ``python -m benchmarks.ops.lm_head --row-chunk N`` times
            the choice); the budget may cut it (``chunk_rows``).
        budget: the head's memory budget in bytes (module docstring): one chunk's logits, and by
            default the kept softmax, each fit in it; None: ``head_budget`` of the device (on a
            device of unknown memory: chunks of ``row_chunk`` rows, nothing kept by default).
        fused: the fused element-wise passes around the GEMMs; None: on CUDA with half inputs
            (where the GEMMs run in the half dtype), False: eager passes. They are compiled on
            CUDA only; elsewhere ``fused=True`` runs the same arithmetic eagerly (how the CPU
            tests check the target-entry bookkeeping).
        keep_probs: keep chunks' softmax [rows, V] from the forward for the backward instead of
            recomputing their logits (module docstring: one GEMM fewer per kept chunk, its rows x
            V entries of memory): True every chunk, False none; None: on CUDA with half inputs
            the first chunks whose softmax fits in the budget (``kept_chunks``), else none.
        index: ``logprob_index(rows_n, targets_n, P, V, row_chunk)`` made ahead (the host
            bookkeeping); None: made here. Checked against P, V, row_chunk and n, not entry by
            entry: it must come from these rows and targets.

    Returns:
        logprobs_n: [n] in the compute dtype (float32 for half inputs, else the input dtype).
    """
    P, D = hidden_PD.shape
    if lm_head_weight_VD.dim() != 2 or lm_head_weight_VD.shape[1] != D:
        raise ValueError(f"lm_head_weight must be [V, D={D}]; got {tuple(lm_head_weight_VD.shape)}")
    V = lm_head_weight_VD.shape[0]
    if rows_n.dim() != 1 or targets_n.shape != rows_n.shape:
        raise ValueError(
            f"rows and targets must be [n] of equal length; got {tuple(rows_n.shape)} and {tuple(targets_n.shape)}"
        )
    if row_chunk < 1:
        raise ValueError(f"row_chunk must be positive; got {row_chunk}")
    if budget is not None and budget < 1:
        raise ValueError(f"budget must be a positive number of bytes; got {budget}")
    # the index plan (unique rows, their positions, chunk bounds) is made where rows_n lives:
    # host tensors (what HybridLM passes) cost the device no synchronization at all
    targets_h = targets_n.detach().cpu()
    if index is None:
        index = logprob_index(rows_n.detach().cpu().numpy(), targets_h.numpy(), P, V, row_chunk)
    elif (index.P, index.V, index.row_chunk, index.num_positions) != (P, V, row_chunk, rows_n.numel()):
        raise ValueError(
            f"index was made for P={index.P}, V={index.V}, row_chunk={index.row_chunk}, n={index.num_positions}; "
            f"these are P={P}, V={V}, row_chunk={row_chunk}, n={rows_n.numel()}"
        )
    device = hidden_PD.device
    if budget is None:
        budget = head_budget(device.type, _device_total(device))
    half = _half_gemms(hidden_PD)
    if budget is not None:
        itemsize = 8 if hidden_PD.dtype == torch.float64 else 4
        index = index.with_row_chunk(chunk_rows(V, itemsize, budget, row_chunk))
    chunks = len(index.bounds) - 1
    if keep_probs is None:
        keep = kept_chunks(index.bounds, V, hidden_PD.element_size(), budget) if half and budget is not None else 0
    else:
        keep = chunks if keep_probs else 0
    # nothing to keep them for without a backward
    if not (torch.is_grad_enabled() and (hidden_PD.requires_grad or lm_head_weight_VD.requires_grad)):
        keep = 0
    plan = _IndexPlan(index, device)
    targets = targets_h.to(device, non_blocking=True)
    return _MappedLogprobs.apply(hidden_PD, lm_head_weight_VD, targets, plan, half if fused is None else fused, keep)


def _device_total(device: torch.device) -> int | None:
    """The total memory of a CUDA ``device`` (a property of the device, read once by torch and
    kept: no synchronization); None elsewhere."""
    return int(torch.cuda.get_device_properties(device).total_memory) if device.type == "cuda" else None


@dataclass(frozen=True)
class LogprobIndex:
    """The host half of ``mapped_logprobs``' bookkeeping, for one (rows, targets) pair: unique
    rows, positions grouped by row, (row, target) pairs and chunk bounds (numpy only).

    ``logprob_index`` builds it; ``HybridLM.prepare_compact`` / ``prepare_trajectory`` build it
    ahead of the forward, so that no host work sits between the layers' kernels and the LM
    head's. Several positions may add to one pair (repeated targets on a fork). Pairs are sorted
    by row, so a chunk's pairs are contiguous.

    Shapes (n positions, U unique rows, Q pairs, C chunks): ``uniq`` [U], ``inv`` [n] (each
    position's unique row), ``order`` [n] (positions stably by unique row), ``pair_inv`` [n],
    ``pair_row`` / ``pair_target`` [Q]; ``bounds`` (unique rows) / ``pos_bounds`` (positions in
    ``order``) / ``pair_bounds`` [C + 1]. ``P``, ``V``, ``row_chunk``: what it was built for.
    """

    P: int
    V: int
    row_chunk: int
    uniq: np.ndarray
    inv: np.ndarray
    order: np.ndarray
    pair_inv: np.ndarray
    pair_row: np.ndarray
    pair_target: np.ndarray
    bounds: list[int]
    pos_bounds: list[int]
    pair_bounds: list[int]

    @property
    def num_positions(self) -> int:
        return int(self.inv.size)

    @property
    def num_unique(self) -> int:
        return int(self.uniq.size)

    @property
    def num_pairs(self) -> int:
        return int(self.pair_row.size)

    def with_row_chunk(self, row_chunk: int) -> LogprobIndex:
        """This index with its chunk bounds recut for ``row_chunk`` unique rows per chunk (the
        same unique rows, positions and pairs; itself when ``row_chunk`` is its own)."""
        if row_chunk == self.row_chunk:
            return self
        if row_chunk < 1:
            raise ValueError(f"row_chunk must be positive; got {row_chunk}")
        U = self.num_unique
        bounds = np.minimum(np.arange(0, U + row_chunk, row_chunk), U)
        return dataclasses.replace(
            self,
            row_chunk=int(row_chunk),
            bounds=bounds.tolist(),
            pos_bounds=np.searchsorted(self.inv[self.order], bounds).tolist(),
            pair_bounds=np.searchsorted(self.pair_row, bounds).tolist(),
        )


def logprob_index(
    rows_n: np.ndarray, targets_n: np.ndarray, P: int, V: int, row_chunk: int = ROW_CHUNK
) -> LogprobIndex:
    """``LogprobIndex`` of positions reading hidden rows ``rows_n`` [n] (in [0, P)) at targets
    ``targets_n`` [n] (in [0, V)), ``row_chunk`` unique rows per logits chunk.

    Built in O(n + P) with numpy, not torch (torch's CPU unique/sort took ~0.2 s per call on 33 k
    rows on a 32-core GPU host, thread contention): the unique rows from a bincount over the P
    hidden rows, the order by row from a stable 16-bit radix sort (``_stable_argsort``), and the
    (row, target) pairs from that order, re-sorting only the rows read with several targets (the
    forks). The same arrays as ``np.unique(rows, return_inverse=True)``, ``argsort(inv, stable)``
    and ``np.unique(inv * V + targets, return_inverse=True)`` (``tests/ops/test_logprob.py``).

    Raises:
        ValueError: rows and targets of different shapes, or out of range; ``row_chunk`` < 1.
    """
    rows_np, targets_np = np.asarray(rows_n).astype(np.int64), np.asarray(targets_n).astype(np.int64)
    if rows_np.ndim != 1 or rows_np.shape != targets_np.shape:
        raise ValueError(f"rows and targets must be [n] of equal length; got {rows_np.shape} and {targets_np.shape}")
    if row_chunk < 1:
        raise ValueError(f"row_chunk must be positive; got {row_chunk}")
    if rows_np.size and (int(rows_np.min()) < 0 or int(rows_np.max()) >= P):
        raise ValueError(f"rows must lie in [0, {P}); got [{int(rows_np.min())}, {int(rows_np.max())}]")
    if targets_np.size and (int(targets_np.min()) < 0 or int(targets_np.max()) >= V):
        raise ValueError(f"targets must lie in [0, {V}); got [{int(targets_np.min())}, {int(targets_np.max())}]")
    counts = np.bincount(rows_np, minlength=P)
    uniq = np.flatnonzero(counts)
    inv = (np.cumsum(counts > 0) - 1)[rows_np]
    order = _stable_argsort(inv, uniq.size)
    bounds = np.minimum(np.arange(0, uniq.size + row_chunk, row_chunk), uniq.size)
    # positions by (row, target): ``order`` has them by row; only the rows read with more than one
    # target (forks) need their positions sorted by target too (the order among equal pairs is
    # free: every position of a pair gets the same pair index)
    inv_o, targets_o = inv[order], targets_np[order]
    mixed = (inv_o[1:] == inv_o[:-1]) & (targets_o[1:] != targets_o[:-1])
    by_pair, inv_p, targets_p = order, inv_o, targets_o
    if mixed.any():
        fork_row = np.zeros(uniq.size, dtype=bool)
        fork_row[inv_o[1:][mixed]] = True
        at = np.flatnonzero(fork_row[inv_o])  # contiguous runs of ``order``, one per fork row
        by_pair = order.copy()
        by_pair[at] = order[at][np.lexsort((targets_o[at], inv_o[at]))]
        targets_p = targets_np[by_pair]  # rows are unchanged: the runs keep their row
    # a new (row, target) pair where the row or the target changes along ``by_pair``
    first = np.ones(by_pair.size, dtype=bool)
    first[1:] = (inv_p[1:] != inv_p[:-1]) | (targets_p[1:] != targets_p[:-1])
    pair_inv = np.empty(by_pair.size, dtype=np.int64)
    pair_inv[by_pair] = np.cumsum(first) - 1
    pair_row, pair_target = inv_p[first], targets_p[first]
    return LogprobIndex(
        P=int(P),
        V=int(V),
        row_chunk=int(row_chunk),
        uniq=uniq,
        inv=inv,
        order=order,
        pair_inv=pair_inv,
        pair_row=pair_row,
        pair_target=pair_target,
        bounds=bounds.tolist(),
        pos_bounds=np.searchsorted(inv_o, bounds).tolist(),
        pair_bounds=np.searchsorted(pair_row, bounds).tolist(),
    )


class _IndexPlan:
    """A ``LogprobIndex`` on the device: its index arrays uploaded once (pinned, non-blocking),
    its bounds kept as host lists."""

    def __init__(self, index: LogprobIndex, device: torch.device) -> None:
        self.bounds, self.pos_bounds, self.pair_bounds = index.bounds, index.pos_bounds, index.pair_bounds
        self.num_unique, self.num_pairs = index.num_unique, index.num_pairs
        self.uniq, self.inv, self.order, self.pair_inv, self.pair_row, self.pair_target = (
            upload(t, device, torch.int64)
            for t in (index.uniq, index.inv, index.order, index.pair_inv, index.pair_row, index.pair_target)
        )


def _stable_argsort(keys: np.ndarray, top: int) -> np.ndarray:
    """int64 [n]: a stable argsort of non-negative int ``keys`` < ``top``, by 16-bit digits
    (numpy sorts 16-bit keys stably by radix, in O(n); wider keys take one pass per digit,
    least significant first)."""
    if top <= 1 << 16:
        return np.argsort(keys.astype(np.uint16), kind="stable")
    idx = np.argsort((keys & 0xFFFF).astype(np.uint16), kind="stable")
    shift = 16
    while top > 1 << shift:
        idx = idx[np.argsort(((keys[idx] >> shift) & 0xFFFF).astype(np.uint16), kind="stable")]
        shift += 16
    return idx


def _half_gemms(t: torch.Tensor) -> bool:
    """Whether the chunk GEMMs run in ``t``'s half dtype with float32 output (CUDA only)."""
    return t.is_cuda and t.dtype in (torch.float16, torch.bfloat16)


def _mm(a: torch.Tensor, b: torch.Tensor, cdt: torch.dtype) -> torch.Tensor:
    """a @ b as ``cdt``: half operands on CUDA accumulate and write float32 on tensor cores."""
    if _half_gemms(a):
        return torch.mm(a, b, out_dtype=cdt)
    return a.to(cdt) @ b.to(cdt)


class _MappedLogprobs(torch.autograd.Function):
    """The head over ``plan``'s chunks; the first ``keep`` chunks keep their softmax."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, plan: _IndexPlan, fused: bool, keep: int):  # type: ignore[override]
        cdt = hidden.dtype if hidden.dtype in (torch.float32, torch.float64) else torch.float32
        uniq, inv, order, bounds, pos_bounds = plan.uniq, plan.inv, plan.order, plan.bounds, plan.pos_bounds
        half = _half_gemms(hidden)
        w = weight if half else weight.to(cdt)
        lse = hidden.new_empty(plan.num_unique, dtype=cdt)
        target_logit = hidden.new_empty(targets.numel(), dtype=cdt)
        # kept: each kept chunk's softmax in the GEMM dtype and its (row, target) pairs' logits
        probs: list[torch.Tensor] = []
        pair_logit = hidden.new_empty(plan.pair_bounds[keep], dtype=cdt)
        for c in range(len(bounds) - 1):
            lo, hi = bounds[c], bounds[c + 1]
            if hi == lo:
                if c < keep:
                    probs.append(hidden.new_empty(0))
                continue
            logits = _mm(hidden[uniq[lo:hi]], w.T, cdt)  # [c, V]
            if c < keep:
                lse[lo:hi], p = (_fused_lse_softmax if fused else _fused_lse_softmax.eager)(
                    logits, hidden.dtype if half else cdt
                )
                probs.append(p)
                p_lo, p_hi = plan.pair_bounds[c], plan.pair_bounds[c + 1]
                pair_logit[p_lo:p_hi] = logits[plan.pair_row[p_lo:p_hi] - lo, plan.pair_target[p_lo:p_hi]]
            else:
                lse[lo:hi] = _fused_row_logsumexp(logits) if fused else torch.logsumexp(logits, dim=-1)
            pos = order[pos_bounds[c] : pos_bounds[c + 1]]
            target_logit[pos] = logits[inv[pos] - lo, targets[pos]]
        # saved, not held: autograd frees them after the backward (and a second backward without
        # retain_graph is the usual error)
        ctx.save_for_backward(hidden, weight, targets, lse, pair_logit, *probs)
        ctx.plan, ctx.cdt, ctx.fused, ctx.keep = plan, cdt, fused, keep
        return target_logit - lse[inv]

    @staticmethod
    def backward(ctx, grad_n):  # type: ignore[override]
        hidden, weight, targets, lse, kept_pair_logit, *probs = ctx.saved_tensors
        plan, cdt = ctx.plan, ctx.cdt
        uniq, inv, order = plan.uniq, plan.inv, plan.order
        grad_n = grad_n.to(cdt)
        half = _half_gemms(hidden)
        w = weight if half else weight.to(cdt)
        # each unique row's softmax term is weighted by the sum of its positions' gradients
        grad_row = grad_n.new_zeros(plan.num_unique).index_add_(0, inv, grad_n)
        grad_pair = (
            grad_n.new_zeros(plan.num_pairs).index_add_(0, plan.pair_inv, grad_n) if ctx.fused or ctx.keep else None
        )
        d_hidden = torch.zeros_like(hidden, dtype=cdt) if ctx.needs_input_grad[0] else None
        d_weight = torch.zeros_like(weight, dtype=cdt) if ctx.needs_input_grad[1] else None
        for c in range(len(plan.bounds) - 1):
            lo, hi = plan.bounds[c], plan.bounds[c + 1]
            if hi == lo:
                continue
            h = hidden[uniq[lo:hi]]
            kept = c < ctx.keep
            by_pair = ctx.fused or kept
            if by_pair:
                p_lo, p_hi = plan.pair_bounds[c], plan.pair_bounds[c + 1]
                pr, pt = plan.pair_row[p_lo:p_hi], plan.pair_target[p_lo:p_hi]
            if kept:
                # no logits: -grad_row * the kept softmax, then the target entries as below
                probs_grad = _fused_probs_grad if ctx.fused else _fused_probs_grad.eager
                d_logits = probs_grad(probs[c], grad_row[lo:hi], probs[c].dtype)
                pair_logit = kept_pair_logit[p_lo:p_hi]
            elif ctx.fused:
                logits = _mm(h, w.T, cdt)  # recomputed [c, V]
                # one pass: -grad_row * softmax in the half dtype
                d_logits = _fused_softmax_grad(logits, lse[lo:hi], grad_row[lo:hi], hidden.dtype if half else cdt)
                pair_logit = logits[pr - lo, pt]
            else:
                # d(logits) in place: -grad_row * softmax + onehot
                logits = _mm(h, w.T, cdt)  # recomputed [c, V]
                d_logits = logits.sub_(lse[lo:hi, None]).exp_().mul_(-grad_row[lo:hi, None])
                pos = order[plan.pos_bounds[c] : plan.pos_bounds[c + 1]]
                d_logits.index_put_((inv[pos] - lo, targets[pos]), grad_n[pos], accumulate=True)
                if half:
                    d_logits = d_logits.to(hidden.dtype)
            if by_pair:
                # each target entry gets its float32 total (softmax term + its positions'
                # gradients), rounded once
                assert grad_pair is not None
                total = grad_pair[p_lo:p_hi] - grad_row[pr] * (pair_logit - lse[pr]).exp()
                d_logits[pr - lo, pt] = total.to(d_logits.dtype)
            if d_hidden is not None:
                d_hidden.index_add_(0, uniq[lo:hi], _mm(d_logits, w, cdt))
            if d_weight is not None:
                _add_mm_(d_weight, d_logits.T, h)
        return (
            None if d_hidden is None else d_hidden.to(hidden.dtype),
            None if d_weight is None else d_weight.to(weight.dtype),
            None,
            None,
            None,
            None,
        )


def _add_mm_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b in place, the GEMM adding into ``acc`` (beta = 1): half operands on CUDA into
    a float32 ``acc`` through ``addmm``'s ``out_dtype`` where this torch has it, else a float32
    product added in a second pass; other operands are upcast to ``acc``'s dtype."""
    if _half_gemms(a) and acc.dtype != a.dtype:
        if _addmm_out_dtype_works(acc.device):
            torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
        else:
            acc.add_(torch.mm(a, b, out_dtype=acc.dtype))
    else:
        acc.addmm_(a.to(acc.dtype), b.to(acc.dtype))


@functools.cache
def _addmm_out_dtype_works(device: torch.device) -> bool:
    """Whether this torch takes ``torch.addmm(acc_f32, a_half, b_half, out_dtype=float32,
    out=acc_f32)`` on ``device`` (versions differ in which ``self`` dtypes the out_dtype overload
    accepts; they check it on the host, before any kernel). Probed once per device on 16 x 16
    operands without reading the result back: reading it would synchronize the device inside a
    microbatch (``tests/models/test_no_host_sync.py``)."""
    a = torch.ones(16, 16, device=device, dtype=torch.bfloat16)
    acc = torch.ones(16, 16, device=device, dtype=torch.float32)
    try:
        torch.addmm(acc, a, a, out_dtype=torch.float32, out=acc)
    except (RuntimeError, TypeError):
        return False
    return True


# The fused passes: torch.compile (Inductor) turns each into one Triton kernel over the chunk
# (``harts.ops.compiled``; eager off CUDA). dynamic=None compiles the first shape statically and
# recompiles once with a symbolic row count when the last, shorter chunk arrives; V stays static.


def _row_max_and_sum(logits_cV: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(m [c, 1] row max, s [c, 1] = sum_v exp(logits - m), exp(logits - m) [c, V]), written as
    the pattern Inductor turns into one online-softmax pass over the chunk on CUDA
    (``prepare_softmax_online``: the max and the sum in one read; ``torch.logsumexp``'s
    decomposition reads the chunk once for the max and again for the sum). Logits from the LM
    head's GEMM are finite, so the row max needs none of ``logsumexp``'s infinity guard."""
    m = logits_cV.amax(dim=-1, keepdim=True)
    e = (logits_cV - m).exp()
    return m, e.sum(dim=-1, keepdim=True), e


@cuda_compiled(opt_in=False, dynamic=None, rows=None)
def _fused_row_logsumexp(logits_cV: torch.Tensor) -> torch.Tensor:
    """[c, V] float32 -> [c] logsumexp in one read of the chunk."""
    m, s, _ = _row_max_and_sum(logits_cV)
    return (m + s.log()).squeeze(-1)


@cuda_compiled(opt_in=False, dynamic=None, rows=None)
def _fused_lse_softmax(logits_cV: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """[c, V] float32 -> ([c] logsumexp, [c, V] softmax as ``dtype``): two reads of the chunk
    (the online max and sum, then the softmax) and one write (``.eager``: unfused)."""
    m, s, e = _row_max_and_sum(logits_cV)
    return (m + s.log()).squeeze(-1), (e / s).to(dtype)


@cuda_compiled(opt_in=False, dynamic=None, rows=None)
def _fused_probs_grad(p_cV: torch.Tensor, grad_c: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """-grad_c * p as ``dtype`` [c, V], in one read of the kept softmax chunk (``.eager``: unfused)."""
    return (p_cV.to(grad_c.dtype) * -grad_c[:, None]).to(dtype)


@cuda_compiled(opt_in=False, dynamic=None, rows=None)
def _fused_softmax_grad(
    logits_cV: torch.Tensor, lse_c: torch.Tensor, grad_c: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """-grad_c * softmax(logits_cV) as ``dtype`` [c, V], in one read of the float32 chunk."""
    return (torch.exp(logits_cV - lse_c[:, None]) * -grad_c[:, None]).to(dtype)
