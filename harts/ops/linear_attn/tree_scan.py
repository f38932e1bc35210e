"""Triton state scans of chunkwise linear attention with boundary-state export and injection.

The chunkwise delta rule (fla's KDA form, keys and decays already prepared per chunk) carries
one state S [K, V] per sequence and head across its chunks of B rows:

    forward, chunk c (S = state at the start of chunk c):
        h[c]      = S                                    (stored for the output kernel)
        v_new_c   = u_c - w_c S                           [B, V]
        S        <- diag(exp2(gk_last_c)) S + kg_c^T v_new_c
    backward, chunk c from the last (dS = gradient of the state at the END of chunk c):
        dh[c]     = dS
        dv2_c     = dv_c + kg_c dS                        [B, V]
        dS       <- diag(exp2(gk_last_c)) dS + scale qg_c^T do_c - w_c^T dv2_c
    dS after chunk 0 is the gradient of the initial state.

The plain rule (Mamba-2's SSD, no delta-rule correction) is the same scans with w = 0 and u = v:
pass ``w=None`` and the scans neither read w nor write v_new (it is v itself).

fla-core runs the same two scans but returns only the final state and accepts a gradient
only for it. These kernels add what a tree round needs (paper §3.3-§3.4):

* **export**: ``export_index[chunk]`` >= 0 writes the float32 state at the start of that chunk
  (the state after c*B rows of its sequence) into ``exported[export_index[chunk]]``, from the
  same pass: no second scan and no split;
* **injection**: ``inject_index[chunk]`` >= 0 adds ``inject[inject_index[chunk]]`` to dS at the
  top of that chunk's backward step, i.e. to the gradient of the state at the END of the chunk
  (= the exported state at the start of the next chunk), as the recurrence passes it.

Scalar decay (GDN): with ``gk`` [1, T, H] (one log2 decay per row and head, cumulated within
each chunk) the scans take the raw keys and queries and form the decayed ones per chunk
themselves, ``kg = k * exp2(g_last - g)`` and ``qg = q * exp2(g)`` row by row (fla's GDN
kernels' form: no [T, H, K] decay tensor and no decayed copies of q and k in memory), and
``exp2(gk_last)`` decays the whole state.

Layouts follow fla's (batch 1, packed rows): k/w/qg [1, T, H, K]; u/v_new/do/dv [1, T, H, V];
gk [1, T, H, K] or [1, T, H] (log2 units, cumulated within each chunk); h/dh [1, NT, H, K, V] with NT the
chunks of all sequences (``chunk_offsets`` [N + 1]); states [N, H, K, V] float32. One program
per (value block, sequence x head); K must be a power of two <= 256.

Written for harts (not taken from fla); the reference semantics are tested against a torch
recurrence in float64 (``tests/ops/test_tree_scan.py``, Triton's interpreter on CPU).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

__all__ = ["ScanConfig", "tree_scan_fwd", "tree_scan_bwd"]

#: value block and warps (fixed: no autotuning, so no cold-start search). A call lasts as long
#: as its longest sequence, and the GPU holds only sequences x heads x V / BV programs, so the
#: small block is the fastest; 3 stages help the forward and slow the backward
#: (``benchmarks.ops.kernel_sweep`` times them: ``benchmarks/results/ling3-tiny_h200_2026-12-02_conv-no-state.md``).
BLOCK_V = 16
NUM_WARPS = 4


class ScanConfig(NamedTuple):
    """A launch configuration of the scans (``benchmarks.ops.kernel_sweep`` times several): the
    value block (a power of two >= 16), warps per program, and software-pipelining stages (None:
    ``_num_stages``'s rule for the kernel)."""

    block_v: int = BLOCK_V
    num_warps: int = NUM_WARPS
    num_stages: int | None = None


def _launch(config: ScanConfig | None, t: torch.Tensor, K: int, backward: bool) -> tuple[int, int, int]:
    """(BV, num_warps, num_stages) of ``config`` (None: the fixed defaults)."""
    c = config or ScanConfig()
    if c.block_v < 16 or c.block_v & (c.block_v - 1) or c.num_warps < 1 or (c.num_stages or 1) < 1:
        raise ValueError(f"scan config needs a power-of-two block_v >= 16 and positive warps / stages; got {c}")
    return c.block_v, c.num_warps, c.num_stages or _num_stages(t, K, backward)


def _num_stages(t: torch.Tensor, K: int, backward: bool) -> int:
    """Software-pipelining depth: 1 where a [chunk, K] tile row is 512 bytes or more, else 2
    (backward) or 3 (forward; module constants above for the measurements).

    The backward scan holds three [BT, K] tiles per stage; at float32 with K = 128 (or bf16 with
    K = 256) two stages need 245,760 bytes of shared memory, over the H200's 232,448."""
    if t.element_size() * K >= 512:
        return 1
    return 2 if backward else 3


@triton.jit
def _program(
    cu_seqlens, chunk_offsets, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr
):
    """This program's (sequence x head, value block): head, first row, rows, chunks, first global
    chunk, key / value offsets, and the offsets + mask of its [K, BV] block of one [K, V] state."""
    i_v = tl.program_id(0)
    i_nh = tl.program_id(1).to(tl.int64)
    i_n = i_nh // H
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    T = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
    n_chunks = (T + BT - 1) // BT
    first_chunk = tl.load(chunk_offsets + i_n).to(tl.int64)
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    state_off = o_k[:, None] * V + o_v[None, :]
    m_state = m_v[None, :] & (o_k[:, None] < K)
    return i_nh, i_nh % H, bos, T, n_chunks, first_chunk, o_k, o_v, m_v, state_off, m_state


@triton.jit
def _tree_scan_fwd_kernel(
    k,
    u,
    w,
    gk,
    v_new,
    h,
    h0,
    ht,
    exported,
    export_index,
    cu_seqlens,
    chunk_offsets,
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BV: tl.constexpr,
    USE_INITIAL_STATE: tl.constexpr,
    STORE_FINAL_STATE: tl.constexpr,
    EXPORT: tl.constexpr,
    SCALAR_G: tl.constexpr,
    DELTA: tl.constexpr,
):
    i_nh, i_h, bos, T, n_chunks, first_chunk, o_k, o_v, m_v, state_off, m_state = _program(
        cu_seqlens, chunk_offsets, H, K, V, BT, BV
    )

    b_s = tl.zeros([K, BV], dtype=tl.float32)
    if USE_INITIAL_STATE:
        b_s += tl.load(h0 + i_nh * K * V + state_off, mask=m_state, other=0.0).to(tl.float32)
    for i_t in range(0, n_chunks):
        chunk = first_chunk + i_t
        o_t = i_t * BT + tl.arange(0, BT)
        m_t = o_t < T
        rows = bos + o_t
        # the state at the start of this chunk: for the output kernel, and exported on request
        tl.store(h + (chunk * H + i_h) * K * V + state_off, b_s.to(h.dtype.element_ty), mask=m_state)
        if EXPORT:
            slot = tl.load(export_index + chunk).to(tl.int64)
            if slot >= 0:
                tl.store(exported + (slot * H + i_h) * K * V + state_off, b_s, mask=m_state)
        m_tk = m_t[:, None] & (o_k[None, :] < K)
        m_tv = m_t[:, None] & m_v[None, :]
        b_u = tl.load(u + (rows[:, None] * H + i_h) * V + o_v[None, :], mask=m_tv, other=0.0)
        if DELTA:
            b_w = tl.load(w + (rows[:, None] * H + i_h) * K + o_k[None, :], mask=m_tk, other=0.0)
            b_vn = b_u.to(tl.float32) - tl.dot(b_w, b_s.to(b_w.dtype))
            tl.store(v_new + (rows[:, None] * H + i_h) * V + o_v[None, :], b_vn.to(v_new.dtype.element_ty), mask=m_tv)
        else:  # plain rule: the state takes v as it is
            b_vn = b_u.to(tl.float32)
        last = bos + tl.minimum((i_t + 1) * BT, T) - 1
        b_kg = tl.load(k + (rows[:, None] * H + i_h) * K + o_k[None, :], mask=m_tk, other=0.0)
        if SCALAR_G:  # k is the raw keys: decay each row to the chunk's end here
            b_gl = tl.load(gk + last * H + i_h).to(tl.float32)
            b_g = tl.load(gk + rows * H + i_h, mask=m_t, other=0.0).to(tl.float32)
            b_kg = (b_kg.to(tl.float32) * tl.exp2(b_gl - b_g)[:, None]).to(b_kg.dtype)
            b_s = b_s * tl.exp2(b_gl) + tl.dot(tl.trans(b_kg), b_vn.to(b_kg.dtype))
        else:
            b_gl = tl.load(gk + (last * H + i_h) * K + o_k).to(tl.float32)
            b_s = b_s * tl.exp2(b_gl)[:, None] + tl.dot(tl.trans(b_kg), b_vn.to(b_kg.dtype))
    if STORE_FINAL_STATE:
        tl.store(ht + i_nh * K * V + state_off, b_s, mask=m_state)


@triton.jit
def _tree_scan_bwd_kernel(
    qg,
    kg,
    w,
    gk,
    do,
    dv,
    dv2,
    dh,
    dht,
    dh0,
    inject,
    inject_index,
    cu_seqlens,
    chunk_offsets,
    scale,
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BV: tl.constexpr,
    USE_FINAL_STATE_GRADIENT: tl.constexpr,
    STORE_INITIAL_STATE_GRADIENT: tl.constexpr,
    INJECT: tl.constexpr,
    SCALAR_G: tl.constexpr,
    DELTA: tl.constexpr,
):
    i_nh, i_h, bos, T, n_chunks, first_chunk, o_k, o_v, m_v, state_off, m_state = _program(
        cu_seqlens, chunk_offsets, H, K, V, BT, BV
    )

    b_ds = tl.zeros([K, BV], dtype=tl.float32)
    if USE_FINAL_STATE_GRADIENT:
        b_ds += tl.load(dht + i_nh * K * V + state_off, mask=m_state, other=0.0).to(tl.float32)
    for j in range(0, n_chunks):
        i_t = n_chunks - 1 - j
        chunk = first_chunk + i_t
        if INJECT:
            slot = tl.load(inject_index + chunk).to(tl.int64)
            if slot >= 0:  # a consumer's gradient of the state at the end of this chunk
                b_ds += tl.load(inject + (slot * H + i_h) * K * V + state_off, mask=m_state, other=0.0)
        tl.store(dh + (chunk * H + i_h) * K * V + state_off, b_ds.to(dh.dtype.element_ty), mask=m_state)
        o_t = i_t * BT + tl.arange(0, BT)
        m_t = o_t < T
        rows = bos + o_t
        m_tk = m_t[:, None] & (o_k[None, :] < K)
        m_tv = m_t[:, None] & m_v[None, :]
        last = bos + tl.minimum((i_t + 1) * BT, T) - 1
        b_kg = tl.load(kg + (rows[:, None] * H + i_h) * K + o_k[None, :], mask=m_tk, other=0.0)
        if SCALAR_G:  # kg is the raw keys: each row decays to the chunk's end here
            b_gl = tl.load(gk + last * H + i_h).to(tl.float32)
            b_g = tl.load(gk + rows * H + i_h, mask=m_t, other=0.0).to(tl.float32)
            b_kg = (b_kg.to(tl.float32) * tl.exp2(b_gl - b_g)[:, None]).to(b_kg.dtype)
        b_dv = tl.load(dv + (rows[:, None] * H + i_h) * V + o_v[None, :], mask=m_tv, other=0.0)
        b_dv2 = b_dv.to(tl.float32) + tl.dot(b_kg, b_ds.to(b_kg.dtype))
        tl.store(dv2 + (rows[:, None] * H + i_h) * V + o_v[None, :], b_dv2.to(dv2.dtype.element_ty), mask=m_tv)
        b_do = tl.load(do + (rows[:, None] * H + i_h) * V + o_v[None, :], mask=m_tv, other=0.0)
        b_qg = tl.load(qg + (rows[:, None] * H + i_h) * K + o_k[None, :], mask=m_tk, other=0.0)
        # each branch reads its own decay (no name crosses from one compile-time branch to the
        # other); the per-channel one keeps its sum in the order it always had, so the KDA
        # scans' results are bit for bit what they were before the scalar mode existed
        if not DELTA:  # plain rule (scalar decay): no delta-rule correction term
            b_gs = tl.load(gk + rows * H + i_h, mask=m_t, other=0.0).to(tl.float32)
            b_qg = (b_qg.to(tl.float32) * tl.exp2(b_gs)[:, None]).to(b_qg.dtype)
            b_ds = (
                b_ds * tl.exp2(tl.load(gk + last * H + i_h).to(tl.float32))
                + tl.dot(tl.trans(b_qg), b_do.to(b_qg.dtype)) * scale
            )
        elif SCALAR_G:  # qg is the raw queries: each row decays from the chunk's start here
            b_w = tl.load(w + (rows[:, None] * H + i_h) * K + o_k[None, :], mask=m_tk, other=0.0)
            b_gs = tl.load(gk + rows * H + i_h, mask=m_t, other=0.0).to(tl.float32)
            b_qg = (b_qg.to(tl.float32) * tl.exp2(b_gs)[:, None]).to(b_qg.dtype)
            b_ds = (
                b_ds * tl.exp2(tl.load(gk + last * H + i_h).to(tl.float32))
                + tl.dot(tl.trans(b_qg), b_do.to(b_qg.dtype)) * scale
                - tl.dot(tl.trans(b_w), b_dv2.to(b_w.dtype))
            )
        else:
            b_w = tl.load(w + (rows[:, None] * H + i_h) * K + o_k[None, :], mask=m_tk, other=0.0)
            b_gk = tl.load(gk + (last * H + i_h) * K + o_k).to(tl.float32)
            b_ds = (
                b_ds * tl.exp2(b_gk)[:, None]
                + tl.dot(tl.trans(b_qg), b_do.to(b_qg.dtype)) * scale
                - tl.dot(tl.trans(b_w), b_dv2.to(b_w.dtype))
            )
    if STORE_INITIAL_STATE_GRADIENT:
        tl.store(dh0 + i_nh * K * V + state_off, b_ds, mask=m_state)


def _scalar_decay(gk: torch.Tensor, kg: torch.Tensor) -> bool:
    """Whether ``gk`` is a scalar decay per row and head ([1, T, H]) or per key channel
    ([1, T, H, K], the shape of ``kg``); anything else is an error."""
    if gk.shape == kg.shape:
        return False
    if gk.shape == kg.shape[:3]:
        return True
    raise ValueError(f"tree scans need gk [1, T, H, K] or [1, T, H] beside keys {list(kg.shape)}; got {list(gk.shape)}")


def _check(K: int) -> None:
    if K < 16 or K > 256 or K & (K - 1):
        raise ValueError(f"tree scans need a power-of-two key dim in [16, 256]; got K={K}")


def _delta(w: torch.Tensor | None, scalar: bool) -> bool:
    """Whether the scans run the delta rule (``w`` given) or the plain one (``w`` None), which
    they run with a scalar decay only (the plain rule's tree path is Mamba-2's SSD)."""
    if w is None and not scalar:
        raise ValueError("tree scans run the plain rule (w=None) with a scalar decay gk [1, T, H] only")
    return w is not None


def tree_scan_fwd(
    kg: torch.Tensor,
    w: torch.Tensor | None,
    u: torch.Tensor,
    gk: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor,
    chunk_offsets: torch.Tensor,
    num_chunks: int,
    chunk_size: int,
    initial_state: torch.Tensor | None,
    export_index: torch.Tensor | None,
    num_exported: int,
    output_final_state: bool = True,
    config: ScanConfig | None = None,
    out: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Forward state scan (module docstring).

    Args:
        kg, w: [1, T, H, K]; u: [1, T, H, V]; gk: [1, T, H, K] chunk-cumulated log2 decay, or
            [1, T, H] (scalar decay: ``kg`` the raw keys, module docstring). ``w`` None: the
            plain rule (u = v; scalar decay only), whose v_new is ``u`` itself.
        cu_seqlens: int [N + 1] (device); chunk_offsets: int [N + 1] first chunk of each sequence.
        num_chunks: NT, chunks of all sequences; chunk_size: B.
        initial_state: [N, H, K, V] float32 or None (zeros).
        export_index: int32 [NT] export slot per chunk (-1: none) or None; num_exported: E.
        config: launch configuration (None: ``ScanConfig()``).
        out: (h, v_new, final, exported) to write into instead of new tensors (v_new: None
            under the plain rule; final: None unless ``output_final_state``; exported: None
            without exports). The scan writes
            only its own sequences' rows, chunks and states: a call over a slice of a larger
            packing (``cu_seqlens`` and ``chunk_offsets`` sliced; global chunk indices and export
            slots) fills its part of the whole's buffers (``linked_tree_linear_attn``).

    Returns:
        h [1, NT, H, K, V] (dtype of kg), v_new [1, T, H, V] (dtype of u), final state
        [N, H, K, V] float32 (None unless ``output_final_state``), exported [E, H, K, V] float32.
    """
    _, T, H, K = kg.shape
    V = u.shape[-1]
    _check(K)
    delta = _delta(w, _scalar_decay(gk, kg))
    N = cu_seqlens.numel() - 1
    v_new: torch.Tensor | None
    if out is not None:
        h, v_new, final, exported_out = out
        exported = exported_out if exported_out is not None else kg.new_empty(0, H, K, V, dtype=torch.float32)
    else:
        h = kg.new_empty(1, num_chunks, H, K, V)
        v_new = torch.empty_like(u) if delta else None
        final = kg.new_empty(N, H, K, V, dtype=torch.float32) if output_final_state else None
        exported = kg.new_empty(max(num_exported, 0), H, K, V, dtype=torch.float32)
    if not delta:
        v_new = None
    bv, warps, stages = _launch(config, kg, K, backward=False)
    grid = (triton.cdiv(V, bv), N * H)
    _tree_scan_fwd_kernel[grid](
        kg,
        u,
        w,
        gk,
        v_new,
        h,
        initial_state,
        final,
        exported,
        export_index if export_index is not None and num_exported > 0 else cu_seqlens,
        cu_seqlens,
        chunk_offsets,
        H=H,
        K=K,
        V=V,
        BT=chunk_size,
        BV=bv,
        USE_INITIAL_STATE=initial_state is not None,
        STORE_FINAL_STATE=final is not None,
        EXPORT=export_index is not None and num_exported > 0,
        SCALAR_G=_scalar_decay(gk, kg),
        DELTA=delta,
        num_warps=warps,
        num_stages=stages,
    )
    return h, u if v_new is None else v_new, final, exported


def tree_scan_bwd(
    qg: torch.Tensor,
    kg: torch.Tensor,
    w: torch.Tensor | None,
    gk: torch.Tensor,
    do: torch.Tensor,
    dv: torch.Tensor,
    *,
    scale: float,
    cu_seqlens: torch.Tensor,
    chunk_offsets: torch.Tensor,
    num_chunks: int,
    chunk_size: int,
    dht: torch.Tensor | None,
    inject: torch.Tensor | None,
    inject_index: torch.Tensor | None,
    want_initial_state_grad: bool = True,
    config: ScanConfig | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Backward state scan with injected state gradients (module docstring).

    Args:
        qg, kg, w: [1, T, H, K]; gk: [1, T, H, K], or [1, T, H] (scalar decay: ``qg`` and
            ``kg`` the raw queries and keys, module docstring); do, dv: [1, T, H, V] (dv: the
            gradient of v_new from the output side). ``w`` None: the plain rule (scalar decay
            only), whose dv2 is the whole gradient of v.
        dht: [N, H, K, V] final-state gradients or None; inject: [E, H, K, V] float32 and
            inject_index: int32 [NT] (slot whose gradient joins at the end of each chunk; -1
            none), or None.
        config: launch configuration (None: ``ScanConfig()``).
        out: (dh, dv2) to write into instead of new tensors (a slice's call, as in
            ``tree_scan_fwd``).

    Returns:
        dh [1, NT, H, K, V] (dtype of qg), dh0 [N, H, K, V] float32 (None unless
        ``want_initial_state_grad``), dv2 [1, T, H, V] (dtype of dv).
    """
    _, T, H, K = qg.shape
    V = do.shape[-1]
    _check(K)
    delta = _delta(w, _scalar_decay(gk, kg))
    N = cu_seqlens.numel() - 1
    dh, dv2 = out if out is not None else (qg.new_empty(1, num_chunks, H, K, V), torch.empty_like(dv))
    dh0 = qg.new_empty(N, H, K, V, dtype=torch.float32) if want_initial_state_grad else None
    use_inject = inject is not None and inject_index is not None and inject.shape[0] > 0
    bv, warps, stages = _launch(config, kg, K, backward=True)
    grid = (triton.cdiv(V, bv), N * H)
    _tree_scan_bwd_kernel[grid](
        qg,
        kg,
        w,
        gk,
        do,
        dv,
        dv2,
        dh,
        dht,
        dh0,
        inject.contiguous() if inject is not None and use_inject else dh,
        inject_index if use_inject else cu_seqlens,
        cu_seqlens,
        chunk_offsets,
        scale,
        H=H,
        K=K,
        V=V,
        BT=chunk_size,
        BV=bv,
        USE_FINAL_STATE_GRADIENT=dht is not None,
        STORE_INITIAL_STATE_GRADIENT=want_initial_state_grad,
        INJECT=use_inject,
        SCALAR_G=_scalar_decay(gk, kg),
        DELTA=delta,
        num_warps=warps,
        num_stages=stages,
    )
    return dh, dh0, dv2
