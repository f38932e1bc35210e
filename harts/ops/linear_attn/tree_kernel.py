"""One-pass tree linear attention on CUDA: boundary states out, their gradients in (KDA, GDN and
the plain rule of Mamba-2's SSD).

Same contract as ``chunk_linear_attn`` (packed varlen rounds, one initial state per sequence,
requested states after chunk-aligned position counts, everything differentiable), built from
fla-core's intra-chunk kernels and harts' own state scans (``tree_scan``):

    forward   chunk_local_cumsum(g) -> chunk_kda_fwd_intra (w, u, kg, Aqk, Akk)       [fla]
              tree_scan_fwd: states h per chunk, v_new, final states, EXPORTED states  [harts]
              chunk_gla_fwd_o_gk -> o                                                  [fla]
    backward  recompute_w_u_fwd, tree_scan_fwd (h, v_new), chunk_kda_bwd_dAv           [fla/harts]
              tree_scan_bwd: dh with the requested states' gradients INJECTED at their
              chunk boundaries, dh0, dv                                                [harts]
              chunk_kda_bwd_wy_dqkg_fused, chunk_kda_bwd_intra, reverse cumsum of dg   [fla]

So a round runs as one packed call whatever it exports, with no split and no second scan
(fla's own chunk_kda returns only final states and takes a gradient only for them).

* GDN (scalar decay g [T, H]) runs, by default, through the KDA kernels with the decay
  broadcast over the key channels (a per-channel decay equal on every channel is the
  scalar-decay rule; ``_KDA``); its gradient is summed back over the channels. This is the path
  every GDN figure in ``benchmarks/results`` was measured on.
* ``HARTS_GDN_NATIVE=1`` runs GDN on fla-core's own GDN kernels around the same scans
  (``_GDN``): chunk_gated_delta_rule_fwd_intra (w, u, A) and chunk_fwd_o forward;
  recompute_w_u_fwd, chunk_bwd_dv_local, chunk_bwd_dqkwg and prepare_wy_repr_bwd backward; the
  scans decay the raw keys and queries per row themselves (``tree_scan``'s scalar decay). Its
  intra-chunk work has no per-channel decay, so it is lighter than KDA's. fla refuses
  chunk_bwd_dqkwg with a decay on Hopper with Triton in [3.4, 3.7.1) (fla #640: a miscompile at
  a 64-wide key block); harts launches that kernel itself and checks the whole GDN op once per
  (device, dtype, heads, dims) against the KDA kernels on a packed problem of 8.6 k rows, forward and
  every gradient; where it differs, GDN runs through the KDA kernels. It is a switch, not the
  default, until a GPU run has timed it against the KDA kernels on the Qwen presets
  (``benchmarks/step/gpu_runs.py``: ``q35_L8_gdn_kda``, ``q35_L8_gdn_native``).
* The plain rule (``rule="plain"``: no beta, S = exp(g) S + k v^T, scalar decay g [T, H]) runs
  fla-core's simple_gla kernels around the same scans (``_PLAIN``): chunk_local_cumsum and
  chunk_fwd_o forward; chunk_bwd_dv_local and fla's dqkwg kernel without its delta-rule part
  backward (harts launches it, as for GDN); the scans run without w (``tree_scan``: u = v). It
  has no intra-chunk solve, so it is the lightest of the three. ``plain_on_tree`` checks it once
  per shape against the reference operator on CUDA (fla #640 again: the same dqkwg kernel), and
  where that differs plain calls run the reference operator. A per-channel plain decay (GLA) is
  not a tree-kernel path: it runs fla's ``chunk_gla`` behind the split path
  (``fla_chunk_linear_attn``), and the compact executor does not link its rounds.
* Requests must be chunk-aligned (count % B == 0), or a sequence's full length, or 0: what
  replay plans produce. A non-aligned request (the ``no_replay`` ablation) is served by the
  split path (``fla_chunk_linear_attn``) instead.
* Host metadata (chunk indices and offsets, export / injection maps) is built with numpy and
  uploaded once per distinct round (cached), so the layers of a microbatch reuse it.

Shapes: T packed rows, H heads, K key dim, V value dim, N sequences, R requests, B chunk
size, NT chunks of all sequences, E distinct exported states.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from harts.ops.compiled import env_opt_in
from harts.ops.fla_index import fla_chunk_indices
from harts.ops.kernel_check import kernel_passes, own_autograd
from harts.ops.linear_attn.utils import check_linear_attn_inputs
from harts.ops.upload import upload

__all__ = [
    "StateIO",
    "gdn_kernels",
    "gdn_native",
    "gdn_native_asked",
    "plain_on_tree",
    "plan_state_io",
    "tree_chunk_linear_attn",
]


@dataclass(frozen=True)
class StateIO:
    """Where every requested state comes from, and the per-chunk export / injection maps.

    ``source[r]`` indexes ``cat([exported [E], final [N], initial [N]])``: request r is an
    exported chunk-start state, a sequence's final state, or its initial state.
    """

    chunk_offsets: np.ndarray  # int64 [N + 1]
    chunk_indices: np.ndarray  # int64 [NT, 2] (sequence, chunk within it), fla's layout
    export_index: np.ndarray  # int32 [NT]: slot of the state at the start of each chunk, or -1
    inject_index: np.ndarray  # int32 [NT]: slot whose gradient joins at the end of each chunk, or -1
    num_exported: int
    source: np.ndarray  # int64 [R]

    @property
    def num_chunks(self) -> int:
        return int(self.chunk_offsets[-1])


def plan_state_io(lengths: list[int], requests: list[tuple[int, int]], chunk_size: int) -> StateIO:
    """Map requests (sequence, position count) onto chunks (see ``StateIO``).

    Raises ValueError for a request that is neither 0, nor chunk-aligned, nor the full length.
    """
    B = chunk_size
    n = len(lengths)
    offsets, chunk_indices = fla_chunk_indices(np.asarray(lengths, dtype=np.int64), B)
    nt = int(offsets[-1])
    export_index = np.full(nt, -1, dtype=np.int32)
    inject_index = np.full(nt, -1, dtype=np.int32)
    slots: dict[int, int] = {}
    source = np.empty(len(requests), dtype=np.int64)
    for r, (seq, count) in enumerate(requests):
        if count == lengths[seq]:
            source[r] = -1 - seq  # final (resolved below, once E is known)
        elif count == 0:
            source[r] = -1 - n - seq  # initial
        elif count % B == 0:
            chunk = int(offsets[seq]) + count // B  # the state at the start of this chunk
            if chunk not in slots:
                slots[chunk] = len(slots)
                export_index[chunk] = slots[chunk]
                inject_index[chunk - 1] = slots[chunk]  # = the end of the chunk before it
            source[r] = slots[chunk]
        else:
            raise ValueError(
                f"request {r} asks for the state after {count} positions of sequence {seq}: not a multiple of "
                f"the chunk size {B}, the sequence's length ({lengths[seq]}) or 0"
            )
    e = len(slots)
    final = source < 0
    source[final] = e + (-1 - source[final])  # -1 - seq -> E + seq, -1 - N - seq -> E + N + seq
    return StateIO(
        chunk_offsets=offsets,
        chunk_indices=chunk_indices,
        export_index=export_index,
        inject_index=inject_index,
        num_exported=e,
        source=source,
    )


@dataclass(frozen=True)
class _DeviceMeta:
    io: StateIO
    cu_seqlens: torch.Tensor
    chunk_offsets: torch.Tensor
    chunk_indices: torch.Tensor
    export_index: torch.Tensor
    inject_index: torch.Tensor
    source: torch.Tensor


_META_CACHE: OrderedDict = OrderedDict()
_META_CACHE_SIZE = 256


def _device_meta(
    starts: list[int], lengths: list[int], requests: list[tuple[int, int]], chunk_size: int, device: torch.device
) -> _DeviceMeta:
    key = (tuple(lengths), tuple(requests), chunk_size, str(device))
    hit = _META_CACHE.get(key)
    if hit is not None:
        _META_CACHE.move_to_end(key)
        return hit
    io = plan_state_io(lengths, requests, chunk_size)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    meta = _DeviceMeta(
        io=io,
        cu_seqlens=upload(cu, device),
        chunk_offsets=upload(io.chunk_offsets, device),
        chunk_indices=upload(io.chunk_indices, device),
        export_index=upload(io.export_index, device),
        inject_index=upload(io.inject_index, device),
        source=upload(io.source, device),
    )
    _META_CACHE[key] = meta
    if len(_META_CACHE) > _META_CACHE_SIZE:
        _META_CACHE.popitem(last=False)
    return meta


def _fwd_intra(q, k, v, g, beta, scale: float, cu, ci, B: int):  # noqa: ANN001, ANN202
    """fla's chunk-local forward over the chunks ``ci``: the cumulated log2 decay gc and (w, u,
    kg, Aqk, Akk) (module docstring)."""
    from fla.ops.kda.chunk_intra import chunk_kda_fwd_intra
    from fla.ops.utils import chunk_local_cumsum
    from fla.ops.utils.constant import RCP_LN2

    gc = chunk_local_cumsum(g, chunk_size=B, scale=RCP_LN2, cu_seqlens=cu, chunk_indices=ci)
    w, u, _, kg, Aqk, Akk = chunk_kda_fwd_intra(
        q=q, k=k, v=v, gk=gc, beta=beta, scale=scale, cu_seqlens=cu, chunk_size=B, chunk_indices=ci
    )
    return gc, w, u, kg, Aqk, Akk


def _fwd_output(q, k, v_new, gc, Aqk, h, scale: float, cu, ci, B: int):  # noqa: ANN001, ANN202
    """fla's output kernel from the scan's per-chunk states h and v_new."""
    from fla.ops.gla.chunk import chunk_gla_fwd_o_gk

    return chunk_gla_fwd_o_gk(
        q=q, v=v_new, g=gc, A=Aqk, h=h, scale=scale, cu_seqlens=cu, chunk_size=B, chunk_indices=ci
    )


def _bwd_head(q, k, v, gc, beta, Aqk, Akk, h0, do, scale: float, cu, ci, co, nt: int, B: int):  # noqa: ANN001, ANN202
    """The backward up to the state-gradient scan: w, u, qg, kg recomputed, the states h and
    v_new rescanned from ``h0`` (one call over every sequence), and fla's dAqk and dv of v_new."""
    from fla.ops.kda.chunk_bwd import chunk_kda_bwd_dAv
    from fla.ops.kda.wy_fast import recompute_w_u_fwd

    w, u, qg, kg = recompute_w_u_fwd(k=k, v=v, beta=beta, A=Akk, gk=gc, q=q, cu_seqlens=cu, chunk_indices=ci)
    h, v_new = _rescan(kg, w, u, gc, h0, cu, co, nt, B)
    dAqk, dv = chunk_kda_bwd_dAv(
        q=q, k=k, v=v_new, do=do, A=Aqk, scale=scale, cu_seqlens=cu, chunk_size=B, chunk_indices=ci
    )
    return w, qg, kg, h, v_new, dAqk, dv


def _rescan(kg, w, u, gc, h0, cu, co, nt: int, B: int):  # noqa: ANN001, ANN202
    """The backward's forward scan again (states h and v_new), over every sequence at once."""
    from harts.ops.linear_attn.tree_scan import tree_scan_fwd

    h, v_new, _, _ = tree_scan_fwd(
        kg,
        w,
        u,
        gc,
        cu_seqlens=cu,
        chunk_offsets=co,
        num_chunks=nt,
        chunk_size=B,
        initial_state=h0,
        export_index=None,
        num_exported=0,
        output_final_state=False,
    )
    return h, v_new


def _bwd_tail(q, k, v, v_new, w, gc, beta, Akk, h, do, dh, dv2, dAqk, scale: float, cu, chunks, co, B: int):  # noqa: ANN001, ANN202
    """The backward after the state-gradient scan, on the chunks ``chunks`` (fla's chunk index
    rows): [dq, dk, dv, dg, db] (float32 but dv), valid on those chunks' rows. ``h`` / ``dh``
    [1, len(chunks), H, K, V] are those chunks' states and state gradients, in ``chunks``' order:
    fla's wy/dqkg kernel addresses them by the chunk's position in ``chunks`` (its program id),
    not by ``chunk_offsets``."""
    from fla.ops.kda.chunk_bwd import chunk_kda_bwd_wy_dqkg_fused
    from fla.ops.kda.chunk_intra import chunk_kda_bwd_intra
    from fla.ops.utils import chunk_local_cumsum

    dq, dk, dv, db, dg, dAkk = chunk_kda_bwd_wy_dqkg_fused(
        q=q,
        k=k,
        v=v,
        v_new=v_new,
        g=gc,
        beta=beta,
        A=Akk,
        h=h,
        do=do,
        dh=dh,
        dv=dv2,
        scale=scale,
        cu_seqlens=cu,
        chunk_size=B,
        chunk_indices=chunks,
        chunk_offsets=co,
    )
    dq, dk, db, dg = chunk_kda_bwd_intra(
        q=q,
        k=k,
        g=gc,
        beta=beta,
        dAqk=dAqk,
        dAkk=dAkk,
        dq=dq,
        dk=dk,
        db=db,
        dg=dg,
        cu_seqlens=cu,
        chunk_indices=chunks,
        chunk_size=B,
    )
    dg = chunk_local_cumsum(dg, chunk_size=B, reverse=True, cu_seqlens=cu, chunk_indices=chunks)
    return [dq, dk, dv, dg, db]


# ------------------------------------------------------------- GDN: fla-core's own GDN kernels


def _gdn_fwd_intra(q, k, v, g, beta, scale: float, cu, ci, B: int):  # noqa: ANN001, ANN202
    """GDN's chunk-local forward: the cumulated log2 decay gc [1, T, H], fla's fused
    kk^T + triangular solve + w / u (A = the solved matrix, in the Akk slot), the raw keys for
    the scans (they decay them per row), no Aqk (fla's GDN output kernel forms q k^T itself)."""
    from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra
    from fla.ops.utils import chunk_local_cumsum
    from fla.ops.utils.constant import RCP_LN2

    gc = chunk_local_cumsum(g, chunk_size=B, scale=RCP_LN2, cu_seqlens=cu, chunk_indices=ci)
    w, u, A = chunk_gated_delta_rule_fwd_intra(k=k, v=v, g=gc, beta=beta, cu_seqlens=cu, chunk_size=B, chunk_indices=ci)
    return gc, w, u, k, None, A


def _gdn_fwd_output(q, k, v_new, gc, Aqk, h, scale: float, cu, ci, B: int):  # noqa: ANN001, ANN202
    """fla's GDN output kernel (the intra-chunk q k^T with its decay, plus the states' part)."""
    from fla.ops.common.chunk_o import chunk_fwd_o

    return chunk_fwd_o(q=q, k=k, v=v_new, h=h, g=gc, scale=scale, cu_seqlens=cu, chunk_size=B, chunk_indices=ci)


def _gdn_bwd_head(q, k, v, gc, beta, Aqk, A, h0, do, scale: float, cu, ci, co, nt: int, B: int):  # noqa: ANN001, ANN202
    """GDN's backward up to the state-gradient scan: w, u recomputed from A, the states rescanned
    from ``h0``, fla's intra-chunk dv of v_new; the raw q and k for the scan."""
    from fla.ops.common.chunk_o import chunk_bwd_dv_local
    from fla.ops.gated_delta_rule.wy_fast import recompute_w_u_fwd

    w, u = recompute_w_u_fwd(k=k, v=v, beta=beta, A=A, g=gc, cu_seqlens=cu, chunk_indices=ci)
    h, v_new = _rescan(k, w, u, gc, h0, cu, co, nt, B)
    dv = chunk_bwd_dv_local(q=q, k=k, do=do, g=gc, scale=scale, cu_seqlens=cu, chunk_size=B, chunk_indices=ci)
    return w, q, k, h, v_new, None, dv


def _gdn_bwd_tail(q, k, v, v_new, w, gc, beta, A, h, do, dh, dv2, dAqk, scale: float, cu, chunks, co, B: int):  # noqa: ANN001, ANN202
    """GDN's backward after the scan, on the chunks ``chunks`` (``_bwd_tail``'s contract, but dq
    and dk in q's dtype, as fla's own GDN backward leaves them: its dqkwg kernel writes them so
    and the WY part of dk is added in that dtype; h / dh in ``chunks``' order, as fla's dqkwg
    kernel addresses them by program id): dq, dk, dw,
    dg of the output and state terms (``_gdn_dqkwg``), then the WY representation's backward,
    the two parts of dk and dg added, dg summed back over each chunk (reverse cumsum)."""
    from fla.ops.gated_delta_rule.wy_fast import prepare_wy_repr_bwd
    from fla.ops.utils import chunk_local_cumsum

    dq, dk, dw, dg = _gdn_dqkwg(q, k, v_new, w, gc, h, dv2, do, dh, scale, cu, chunks, B)
    dk2, dv, db, dg2 = prepare_wy_repr_bwd(
        k=k, v=v, beta=beta, A=A, dw=dw, du=dv2, g=gc, cu_seqlens=cu, chunk_indices=chunks
    )
    dk = dk.add_(dk2)
    dg = dg.add_(dg2)
    dg = chunk_local_cumsum(dg, chunk_size=B, reverse=True, cu_seqlens=cu, chunk_indices=chunks)
    return [dq, dk, dv, dg, db]


# ------------------------------------------------ the plain rule (SSD): fla's simple_gla kernels


def _plain_fwd_intra(q, k, v, g, beta, scale: float, cu, ci, B: int):  # noqa: ANN001, ANN202
    """The plain rule's chunk-local forward: only the cumulated log2 decay gc [1, T, H] (no w, no
    triangular solve: u is v itself, and the scans take the raw keys)."""
    from fla.ops.utils import chunk_local_cumsum
    from fla.ops.utils.constant import RCP_LN2

    gc = chunk_local_cumsum(g, chunk_size=B, scale=RCP_LN2, cu_seqlens=cu, chunk_indices=ci)
    return gc, None, v, k, None, None


def _plain_bwd_head(q, k, v, gc, beta, Aqk, A, h0, do, scale: float, cu, ci, co, nt: int, B: int):  # noqa: ANN001, ANN202
    """The plain rule's backward up to the state-gradient scan: the states rescanned from ``h0``,
    fla's intra-chunk dv (``chunk_bwd_dv_local``, simple_gla's); the raw q and k for the scan."""
    from fla.ops.common.chunk_o import chunk_bwd_dv_local

    h, _ = _rescan(k, None, v, gc, h0, cu, co, nt, B)
    dv = chunk_bwd_dv_local(q=q, k=k, do=do, g=gc, scale=scale, cu_seqlens=cu, chunk_size=B, chunk_indices=ci)
    return None, q, k, h, v, None, dv


def _plain_bwd_tail(q, k, v, v_new, w, gc, beta, A, h, do, dh, dv2, dAqk, scale: float, cu, chunks, co, B: int):  # noqa: ANN001, ANN202
    """The plain rule's backward after the scan, on the chunks ``chunks`` (``_gdn_bwd_tail``'s
    contract): dq, dk, dg from fla's dqkwg kernel without its delta-rule part (no w), dv the
    scan's dv2 (the intra-chunk part plus the state's), no dbeta."""
    from fla.ops.utils import chunk_local_cumsum

    dq, dk, _, dg = _gdn_dqkwg(q, k, v, None, gc, h, None, do, dh, scale, cu, chunks, B)
    dg = chunk_local_cumsum(dg, chunk_size=B, reverse=True, cu_seqlens=cu, chunk_indices=chunks)
    return [dq, dk, dv2, dg, None]


def _gdn_dqkwg(q, k, v_new, w, gc, h, dv2, do, dh, scale: float, cu, chunks, B: int):  # noqa: ANN001, ANN202
    """fla's ``chunk_bwd_kernel_dqkwg`` with a decay, launched here: fla's own wrapper refuses
    it on Hopper with Triton in [3.4, 3.7.1) (fla #640), where harts checks the result instead
    (``gdn_native``). Block sizes as fla's wrapper picks them: up to 128 on GPUs with Hopper's
    shared memory, else 64 or 32. At the Qwen models' K = 128 that is one 128-wide key block,
    not the 64-wide one the miscompile was reported at; a K of 64 or less does get a 64-wide (or
    narrower) block, and the check decides there."""
    import triton
    from fla.ops.common.chunk_o import chunk_bwd_kernel_dqkwg
    from fla.utils import check_shared_mem

    _, T, H, K = k.shape
    V, HV = v_new.shape[-1], v_new.shape[2]
    if check_shared_mem("hopper", k.device.index):
        tiling = 128
    elif check_shared_mem("ampere", k.device.index):
        tiling = 128 if all(x.element_size() == 2 for x in (q, k, v_new, do, h, dh, w, dv2) if x is not None) else 64
    elif check_shared_mem("ada", k.device.index):
        tiling = 64
    else:
        tiling = 32
    BK = min(max(triton.next_power_of_2(K), 16), tiling)
    BV = min(max(triton.next_power_of_2(V), 16), tiling)
    NK, NT = triton.cdiv(K, BK), len(chunks)
    dq = q.new_empty(1, T, HV, K)
    dk = k.new_empty(1, T, HV, K)
    dg = torch.empty(NK, *gc.shape, dtype=torch.float32, device=gc.device)
    dw = torch.empty_like(w) if w is not None else None  # None: the plain rule (no delta-rule part)
    chunk_bwd_kernel_dqkwg[(NK * NT, HV)](
        q=q,
        k=k,
        v=v_new,
        g=gc,
        g_gamma=None,
        h=h,
        do=do,
        dh=dh,
        dq=dq,
        dk=dk,
        dw=dw,
        dv=dv2,
        dg=dg,
        cu_seqlens=cu,
        chunk_indices=chunks,
        scale=scale,
        B=1,
        T=T,
        H=H,
        HV=HV,
        K=K,
        V=V,
        BT=B,
        BK=BK,
        BV=BV,
        STATE_V_FIRST=False,
    )
    return dq, dk, dw, dg.sum(0)


@dataclass(frozen=True)
class _Kernels:
    """One rule's fla kernels around harts' scans (``_TreeKDA`` / ``_LinkedKDA`` run either)."""

    fwd_intra: Callable
    fwd_output: Callable
    bwd_head: Callable
    bwd_tail: Callable


_KDA = _Kernels(_fwd_intra, _fwd_output, _bwd_head, _bwd_tail)
_GDN = _Kernels(_gdn_fwd_intra, _gdn_fwd_output, _gdn_bwd_head, _gdn_bwd_tail)
_PLAIN = _Kernels(_plain_fwd_intra, _gdn_fwd_output, _plain_bwd_head, _plain_bwd_tail)

#: per (device, dtype, H, K, V): whether fla's GDN kernels matched the KDA kernels' result
_gdn_checked: dict[tuple, bool] = {}

#: the check's packed problem: sequence lengths (a partial chunk, an aligned one, a single row,
#: several chunks, and one long sequence: fla-core autotunes its GDN kernels on their first
#: call, which is this check's, and its autotuner keys on heads and dims, not rows, so the
#: configurations are chosen on a problem of some size) and its requested states (sequence,
#: position count)
_CHECK_LENGTHS = (130, 64, 1, 200, 8192)
_CHECK_REQUESTS = ((0, 64), (0, 128), (0, 130), (1, 64), (2, 0), (3, 64), (3, 192), (4, 4096))


def gdn_native_asked() -> bool:
    """``HARTS_GDN_NATIVE=1`` (read at each call, for A/B timing of one process against another);
    raises ``ValueError`` for a value other than 0, 1 or unset (``env_opt_in``)."""
    return env_opt_in("HARTS_GDN_NATIVE")


def gdn_native(q: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether GDN (scalar decay) runs on fla-core's own GDN kernels (``_GDN``) for inputs like
    ``q`` [T, H, K] and ``v`` [T, H, V] (module docstring); else the KDA kernels with the decay
    broadcast (``_KDA``). Checked once per (device, dtype, H, K, V): both on one packed
    problem (``_CHECK_LENGTHS``, states requested and handed in), output, states and every
    gradient; a difference beyond either side's rounding warns once and keeps the KDA kernels.
    Only with ``HARTS_GDN_NATIVE=1`` (module docstring); otherwise the KDA kernels, unchecked."""
    if not gdn_native_asked() or not q.is_cuda:
        return False
    H, K, V = q.shape[-2], q.shape[-1], v.shape[-1]
    key = (str(q.device), q.dtype, H, K, V)

    def run(kernels: _Kernels) -> list[torch.Tensor]:
        return _check_problem(kernels, q.device, q.dtype, H, K, V)

    return kernel_passes(
        _gdn_checked,
        key,
        lambda: run(_KDA),
        lambda: run(_GDN),
        lambda got, want: _check_close(got, want, q.dtype),
        name="GDN (fla-core's GDN kernels)",
        differs="its output or a gradient differed from the KDA kernels' with the decay broadcast (fla #640)",
        fallback="GDN runs through the KDA kernels",
    )


#: per (device, dtype, H, K, V): whether the plain rule's tree kernels matched the reference op
_plain_checked: dict[tuple, bool] = {}


def plain_on_tree(q: torch.Tensor, v: torch.Tensor, g: torch.Tensor) -> bool:
    """Whether the plain rule runs on the tree kernel (``_PLAIN``: fla-core's simple_gla kernels
    around harts' scans) for inputs like ``q`` [T, H, K], ``v`` [T, H, V], ``g``: a scalar decay
    [T, H] only (a per-channel one, GLA, takes fla's ``chunk_gla`` through the split path), and
    on CUDA once checked per (device, dtype, H, K, V) against the reference operator on one
    packed problem (``_CHECK_LENGTHS``): output, states and every gradient. harts launches fla's
    dqkwg kernel itself, which fla's wrapper refuses on Hopper with Triton in [3.4, 3.7.1) (fla
    #640); where the check differs, plain calls run the reference operator (with one warning)."""
    if g.dim() != 2:
        return False
    if not q.is_cuda:  # Triton's interpreter (tests): nothing to check against here
        return True
    from harts.ops.linear_attn.fla import _import_fla

    _import_fla()  # fla's Triton configs pinned before the check's first kernel
    H, K, V = q.shape[-2], q.shape[-1], v.shape[-1]

    def run(kernels: _Kernels | None) -> list[torch.Tensor]:
        return _check_problem(kernels, q.device, q.dtype, H, K, V, rule="plain")

    return kernel_passes(
        _plain_checked,
        (str(q.device), q.dtype, H, K, V),
        lambda: run(None),
        lambda: run(_PLAIN),
        lambda got, want: _check_close(got, want, q.dtype),
        name="plain-rule tree (fla-core's simple_gla kernels)",
        differs="its output or a gradient differed from the reference operator's (fla #640)",
        fallback="the plain rule runs the reference operator",
    )


def gdn_kernels() -> str:
    """Which kernels GDN's tree calls ran on in this process, for a report: "gdn" (fla-core's
    GDN kernels, every checked shape), "kda" (the KDA kernels with the decay broadcast: the
    default, or every check differed) or "mixed" (some shapes each way)."""
    ran = set(_gdn_checked.values()) if gdn_native_asked() else set()
    return "mixed" if len(ran) == 2 else "gdn" if ran == {True} else "kda"


def _check_problem(
    kernels: _Kernels | None,
    device: torch.device,
    dtype: torch.dtype,
    H: int,
    K: int,
    V: int,
    lengths: tuple[int, ...] = _CHECK_LENGTHS,
    requests: tuple[tuple[int, int], ...] = _CHECK_REQUESTS,
    rule: str = "delta",
) -> list[torch.Tensor]:
    """``gdn_native``'s and ``plain_on_tree``'s problem (``lengths``, ``requests``) under ``rule``
    through ``kernels``, or None: the reference operator (``chunk_linear_attn``): [o, final,
    requested, dq, dk, dv, dg, dbeta, dh0] in float32 (no dbeta under the plain rule; the KDA
    kernels' dg summed over the key channels)."""
    B = 64
    gen = torch.Generator().manual_seed(0)
    T, N = sum(lengths), len(lengths)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    q = torch.nn.functional.normalize(rand(1, T, H, K), dim=-1)
    k = torch.nn.functional.normalize(rand(1, T, H, K), dim=-1)
    v, g = rand(1, T, H, V), -torch.nn.functional.softplus(rand(1, T, H)) * 0.5
    beta, h0 = torch.sigmoid(rand(1, T, H)), rand(N, H, K, V) * 0.1
    grads = [rand(1, T, H, V), rand(N, H, K, V), rand(len(requests), H, K, V)]
    with own_autograd():  # the first call may sit in a checkpoint's forward or recomputation
        leaves = [t.to(device, dtype).requires_grad_() for t in (q, k, v, g, beta)[: 4 if rule == "plain" else 5]]
        h0d = h0.to(device).requires_grad_()
        b = leaves[4] if rule == "delta" else None
        if kernels is None:
            from harts.ops.linear_attn.chunk import chunk_linear_attn

            q0, k0, v0, g0 = (t[0] for t in leaves[:4])
            o, final, requested = chunk_linear_attn(
                q0,
                k0,
                v0,
                g0,
                None if b is None else b[0],
                cu_seqlens=torch.as_tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int64),
                initial_state=h0d,
                chunk_size=B,
                state_requests=torch.as_tensor(requests, dtype=torch.int64),
                rule=rule,
            )
            o = o[None]
        else:
            starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).tolist()
            meta = _device_meta(starts, list(lengths), list(requests), B, device)
            gk = leaves[3][..., None].expand(1, T, H, K).contiguous() if kernels is _KDA else leaves[3]
            o, final, exported = _TreeKDA.apply(*leaves[:3], gk, b, h0d, meta, K**-0.5, B, kernels)
            requested = torch.cat([exported, final, h0d])[meta.source]
        outs = [o, final, requested]
        loss = torch.stack([(x.float() * gr.to(device)).sum() for x, gr in zip(outs, grads)]).sum()
        d = torch.autograd.grad(loss, [*leaves, h0d])
    return [t.detach().float() for t in (*outs, *d)]


def _check_close(got: list[torch.Tensor], want: list[torch.Tensor], dtype: torch.dtype) -> bool:
    """Every tensor within a few of its dtype's rounding steps of the other side's, relative to
    its largest entry (the two sides round their intermediates differently); fla #640's
    miscompile was off by about half of that scale. A non-finite entry on either side fails it (a
    NaN in the reference would otherwise compare as no difference)."""
    tol = 2e-2 if dtype == torch.float32 else 1e-1
    for g, w in zip(got, want, strict=True):
        if g.shape != w.shape or not bool(torch.isfinite(g).all()) or not bool(torch.isfinite(w).all()):
            return False
        scale = max(float(w.abs().max()), 1e-6)
        if float((g - w).abs().max()) > tol * scale:
            return False
    return True


class _TreeKDA(torch.autograd.Function):
    """Chunk op over [1, T, H, *] with export / injection (module docstring), on the kernels of
    ``kernels`` (``_KDA``, or ``_GDN`` with g [1, T, H])."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, h0, meta: _DeviceMeta, scale: float, chunk_size: int, kernels: _Kernels = _KDA):  # type: ignore[override]
        from harts.ops.linear_attn.tree_scan import tree_scan_fwd

        B, cu, ci = chunk_size, meta.cu_seqlens, meta.chunk_indices
        gc, w, u, kg, Aqk, Akk = kernels.fwd_intra(q, k, v, g, beta, scale, cu, ci, B)
        h, v_new, final, exported = tree_scan_fwd(
            kg,
            w,
            u,
            gc,
            cu_seqlens=cu,
            chunk_offsets=meta.chunk_offsets,
            num_chunks=meta.io.num_chunks,
            chunk_size=B,
            initial_state=h0,
            export_index=meta.export_index,
            num_exported=meta.io.num_exported,
        )
        o = kernels.fwd_output(q, k, v_new, gc, Aqk, h, scale, cu, ci, B)
        ctx.save_for_backward(q, k, v, gc, beta, Aqk, Akk, h0)
        ctx.meta, ctx.scale, ctx.chunk_size, ctx.has_h0, ctx.g_dtype = meta, scale, chunk_size, h0 is not None, g.dtype
        ctx.kernels = kernels
        return o.to(q.dtype), final, exported

    @staticmethod
    def backward(ctx, do, dfinal, dexported):  # type: ignore[override]
        from harts.ops.linear_attn.tree_scan import tree_scan_bwd

        q, k, v, gc, beta, Aqk, Akk, h0 = ctx.saved_tensors
        meta, scale, B, kernels = ctx.meta, ctx.scale, ctx.chunk_size, ctx.kernels
        cu, ci, co, nt = meta.cu_seqlens, meta.chunk_indices, meta.chunk_offsets, meta.io.num_chunks
        do = do.contiguous()
        w, qg, kg, h, v_new, dAqk, dv = kernels.bwd_head(q, k, v, gc, beta, Aqk, Akk, h0, do, scale, cu, ci, co, nt, B)
        dh, dh0, dv = tree_scan_bwd(
            qg,
            kg,
            w,
            gc,
            do,
            dv,
            scale=scale,
            cu_seqlens=cu,
            chunk_offsets=co,
            num_chunks=nt,
            chunk_size=B,
            dht=dfinal.contiguous(),
            inject=dexported,
            inject_index=meta.inject_index,
            want_initial_state_grad=ctx.has_h0,
        )
        dq, dk, dv, dg, db = kernels.bwd_tail(
            q, k, v, v_new, w, gc, beta, Akk, h, do, dh, dv, dAqk, scale, cu, ci, co, B
        )
        return (
            dq.to(q.dtype),
            dk.to(k.dtype),
            dv.to(v.dtype),
            dg.to(ctx.g_dtype),
            None if beta is None else db.to(beta.dtype),  # the plain rule has no beta
            dh0 if ctx.has_h0 else None,
            None,
            None,
            None,
            None,
        )


def _decay_and_kernels(
    g: torch.Tensor, q: torch.Tensor, v: torch.Tensor, scalar: bool, rule: str = "delta"
) -> tuple[torch.Tensor, _Kernels]:
    """The decay as the kernels take it and the kernels: the plain rule's g [T, H] as it is on
    fla's simple_gla kernels (``_PLAIN``; callers check ``plain_on_tree`` first); KDA's g [T, H,
    K] as it is; GDN's g [T, H] as it is on fla's GDN kernels (``gdn_native``), else broadcast
    over the key channels for the KDA kernels."""
    if rule == "plain":
        return g, _PLAIN
    if not scalar:
        return g, _KDA
    if gdn_native(q, v):
        return g, _GDN
    return g[..., None].expand(*g.shape, q.shape[-1]), _KDA


def tree_chunk_linear_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor | None,
    *,
    cu_seqlens: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = 64,
    state_requests: torch.Tensor | None = None,
    scale: float | None = None,
    rule: str = "delta",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One-pass linear attention with boundary-state export (module docstring).

    Args:
        q, k: [T, H, K] (CUDA); v: [T, H, V]; g: [T, H, K] (KDA) or [T, H] (GDN, SSD) log-decay;
        beta: [T, H] (rule "delta") or None (rule "plain"); cu_seqlens: int [N + 1];
        initial_state: [N, H, K, V] or None; chunk_size: B (fla's KDA kernels: 64);
        state_requests: int [R, 2] (sequence, count).

    Returns:
        o [T, H, V] (dtype of v), final_state [N, H, K, V] float32, requested [R, H, K, V] float32.
    """
    spec = check_linear_attn_inputs(q, k, v, g, beta, cu_seqlens, initial_state, state_requests, scale, rule)
    if not q.is_cuda:
        raise ValueError("tree_chunk_linear_attn needs CUDA tensors; use chunk_linear_attn on CPU")
    if chunk_size != 64:
        raise ValueError(f"the tree kernel runs fla's KDA intra-chunk kernels at chunk_size 64; got {chunk_size}")
    args = (q, k, v, g, beta)
    kw = dict(
        cu_seqlens=cu_seqlens,
        initial_state=initial_state,
        chunk_size=chunk_size,
        state_requests=state_requests,
        scale=scale,
        rule=rule,
    )
    if rule == "plain" and spec.scalar_decay and not plain_on_tree(q, v, g):
        from harts.ops.linear_attn.chunk import chunk_linear_attn

        return chunk_linear_attn(*args, **kw)  # type: ignore[arg-type]
    if (rule == "plain" and not spec.scalar_decay) or any(
        c % chunk_size and c not in (0, spec.lengths[s]) for s, c in spec.requests
    ):
        from harts.ops.linear_attn.fla import fla_chunk_linear_attn

        return fla_chunk_linear_attn(*args, **kw)  # type: ignore[arg-type]
    from harts.ops.linear_attn.fla import _import_fla

    _import_fla()
    N, H, K, V = spec.num_seqs, spec.H, spec.K, spec.V
    if spec.T == 0:  # nothing to run: every state is its sequence's initial state
        initial = initial_state.float() if initial_state is not None else q.new_zeros(N, H, K, V, dtype=torch.float32)
        req = initial[[s for s, _ in spec.requests]] if spec.requests else initial.new_zeros(0, H, K, V)
        return v.new_zeros(0, H, V), initial, req
    meta = _device_meta(spec.starts, spec.lengths, spec.requests, chunk_size, q.device)
    gk, kernels = _decay_and_kernels(g, q, v, spec.scalar_decay, rule)
    h0 = initial_state.float().contiguous() if initial_state is not None else None
    o, final, exported = _TreeKDA.apply(
        q.unsqueeze(0).contiguous(),
        k.unsqueeze(0).contiguous(),
        v.unsqueeze(0).contiguous(),
        gk.unsqueeze(0).contiguous(),
        None if beta is None else beta.unsqueeze(0).contiguous(),
        h0,
        meta,
        spec.scale,
        chunk_size,
        kernels,
    )
    initial = h0 if h0 is not None else final.new_zeros(N, H, K, V)
    requested = torch.cat([exported, final, initial])[meta.source] if spec.requests else final.new_zeros(0, H, K, V)
    return o[0].to(v.dtype), final, requested


# ------------------------------------------------------------------ linked rounds: one call


@dataclass(frozen=True)
class LinkedPlan:
    """A microbatch's linear-attention rounds as one call: every round's sequences packed round
    after round, each starting from zero or from a state an earlier round's sequence produced.

    States live in one float32 *pool* ``[max(E, 1) exported | N final | 1 zero]``: a state requested
    at a chunk boundary inside its sequence is exported by the forward scan into its slot
    (deduplicated by chunk), one at a sequence's end is that sequence's final state, one after 0
    positions is the state the sequence itself started from. Shapes: N sequences, NT chunks, E
    exported states.
    """

    lengths: np.ndarray  # int64 [N]
    round_starts: np.ndarray  # int64 [num_rounds + 1]: first sequence of each round
    io: StateIO  # chunk offsets / indices, export_index [NT] (pool slot), inject_index [NT]
    init_pool: np.ndarray  # int64 [N]: pool index each sequence starts from (the last: zero)

    @property
    def num_seqs(self) -> int:
        return int(self.lengths.size)

    @property
    def num_rows(self) -> int:
        return int(self.lengths.sum())

    @property
    def export_slots(self) -> int:
        """Export slots of the pool: at least one (unused where no state is exported), so that
        every scan call compiles the same kernel variant (``_LinkedKDA``)."""
        return max(self.io.num_exported, 1)

    @property
    def pool_size(self) -> int:
        return self.export_slots + self.num_seqs + 1


def plan_linked_rounds(
    rounds: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]], chunk_size: int
) -> LinkedPlan | None:
    """Link rounds given as (cu_seqlens [N_r + 1], init_state [N_r] state id or -1, requests
    [R_r, 2] (sequence in the round, position count), request_ids [R_r] state ids), in order.

    Returns None when a request is not chunk-aligned (nor 0, nor its sequence's length): the
    ``no_replay`` layouts, which the per-round path serves. Raises ValueError for a sequence
    that starts from a state no earlier round produces.
    """
    B = chunk_size
    lengths = [np.diff(np.asarray(cu, dtype=np.int64)) for cu, _, _, _ in rounds]
    starts = np.concatenate([[0], np.cumsum([x.size for x in lengths])]).astype(np.int64)
    flat = np.concatenate(lengths) if lengths else np.zeros(0, dtype=np.int64)
    offsets, chunk_indices = fla_chunk_indices(flat, B)
    nt, n = int(offsets[-1]), int(flat.size)
    export_index = np.full(nt, -1, dtype=np.int32)
    inject_index = np.full(nt, -1, dtype=np.int32)
    kind: dict[int, tuple[str, int]] = {}  # state id -> ("export", slot) / ("final", seq) / ("init", seq)
    made_in: dict[int, int] = {}  # state id -> the round that produces it
    slots: dict[int, int] = {}
    for r, (_, _, requests, ids) in enumerate(rounds):
        for (seq, count), sid in zip(np.asarray(requests, dtype=np.int64).reshape(-1, 2), np.asarray(ids)):
            g = int(starts[r] + seq)
            made_in[int(sid)] = r
            if count == flat[g]:
                kind[int(sid)] = ("final", g)
            elif count == 0:
                kind[int(sid)] = ("init", g)
            elif count % B == 0:
                chunk = int(offsets[g]) + int(count) // B
                if chunk not in slots:
                    slots[chunk] = len(slots)
                    export_index[chunk] = slots[chunk]
                    inject_index[chunk - 1] = slots[chunk]
                kind[int(sid)] = ("export", slots[chunk])
            else:
                return None
    e = max(len(slots), 1)  # LinkedPlan.export_slots
    zero = e + n
    init_pool = np.full(n, zero, dtype=np.int64)
    pool_of: dict[int, int] = {}
    for r, (_, init, _, _) in enumerate(rounds):
        for s, sid in enumerate(np.asarray(init, dtype=np.int64).tolist()):
            if sid < 0:
                continue
            if made_in.get(sid, r) >= r:
                raise ValueError(f"sequence {s} of round {r} starts from state {sid}, which no earlier round produces")
            if sid not in pool_of:  # an "init" state is its sequence's own start, resolved with its round
                what, at = kind[sid]
                pool_of[sid] = at if what == "export" else e + at if what == "final" else int(init_pool[at])
            init_pool[int(starts[r] + s)] = pool_of[sid]
    io = StateIO(
        chunk_offsets=offsets,
        chunk_indices=chunk_indices,
        export_index=export_index,
        inject_index=inject_index,
        num_exported=len(slots),
        source=np.zeros(0, dtype=np.int64),
    )
    return LinkedPlan(lengths=flat, round_starts=starts, io=io, init_pool=init_pool)


@dataclass(frozen=True)
class _LinkedDevice:
    plan: LinkedPlan
    cu_seqlens: torch.Tensor
    chunk_offsets: torch.Tensor
    chunk_indices: torch.Tensor
    export_index: torch.Tensor
    inject_index: torch.Tensor
    init_pool: torch.Tensor


_LINKED_CACHE: OrderedDict = OrderedDict()

#: run the first round's backward scan on a high-priority stream beside the later rounds'
#: chunk-parallel backward (``_LinkedKDA.backward``); False runs everything on one stream
OVERLAP_FIRST_ROUND = True
_SCAN_STREAMS: dict[int, torch.cuda.Stream] = {}


def _scan_stream(device: torch.device) -> torch.cuda.Stream:
    """A high-priority stream of ``device`` for the first round's scan (one per device)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SCAN_STREAMS:  # a lower number is a higher priority; the default stream's is 0
        _SCAN_STREAMS[index] = torch.cuda.Stream(device=index, priority=-1)
    return _SCAN_STREAMS[index]


def _linked_device(plan: LinkedPlan, device: torch.device) -> _LinkedDevice:
    key = (id(plan), str(device))
    hit = _LINKED_CACHE.get(key)
    if hit is not None and hit.plan is plan:
        _LINKED_CACHE.move_to_end(key)
        return hit  # type: ignore[no-any-return]
    cu = np.concatenate([[0], np.cumsum(plan.lengths)]).astype(np.int64)
    meta = _LinkedDevice(
        plan=plan,
        cu_seqlens=upload(cu, device),
        chunk_offsets=upload(plan.io.chunk_offsets, device),
        chunk_indices=upload(plan.io.chunk_indices, device),
        export_index=upload(plan.io.export_index, device),
        inject_index=upload(plan.io.inject_index, device),
        init_pool=upload(plan.init_pool, device),
    )
    _LINKED_CACHE[key] = meta
    if len(_LINKED_CACHE) > _META_CACHE_SIZE:
        _LINKED_CACHE.popitem(last=False)
    return meta


def _cast(t: torch.Tensor | None, dtype: torch.dtype | None) -> torch.Tensor | None:
    """``t`` in ``dtype``; None (the plain rule's beta gradient) stays None."""
    return None if t is None or dtype is None else t.to(dtype)


class _LinkedKDA(torch.autograd.Function):
    """KDA chunk op over all rounds of a LinkedPlan, [1, T, H, *]: fla-core's chunk-parallel
    kernels once over every row, the state scans once per round forward (each round's initial
    states gathered from the pool) and backward (in reverse; each round's initial-state
    gradients summed into the pool's gradient, which later-round consumers inject), and the
    backward's recomputed forward scan once over all sequences (their initial states are known).

    Every scan call passes the same flags whatever its round holds (initial states, zero rows
    for roots; every sequence's final state; exports and injections, through a spare slot where
    the plan exports nothing): one compiled variant per scan, so a later microbatch whose rounds
    differ compiles nothing in the timed step (with flags set per round, a microbatch with a new
    mix of states compiled new variants there).

    The first round is often one long shared prefix, whose scan leaves most of the GPU idle
    (sequences x heads x V / 16 programs). In the backward it runs on a high-priority stream
    beside the later rounds' chunk-parallel kernels (``OVERLAP_FIRST_ROUND``), which need only
    their own rounds' state gradients; each input gradient is then put together from the two
    halves in the copy that casts it to its input's dtype."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, meta: _LinkedDevice, scale: float, chunk_size: int, kernels: _Kernels = _KDA):  # type: ignore[override]
        from harts.ops.linear_attn.tree_scan import tree_scan_fwd

        B, cu, ci, co = chunk_size, meta.cu_seqlens, meta.chunk_indices, meta.chunk_offsets
        plan = meta.plan
        H, K, V = q.shape[2], q.shape[3], v.shape[3]
        nt, e = plan.io.num_chunks, plan.export_slots
        gc, w, u, kg, Aqk, Akk = kernels.fwd_intra(q, k, v, g, beta, scale, cu, ci, B)
        pool = q.new_zeros(plan.pool_size, H, K, V, dtype=torch.float32)
        h = kg.new_empty(1, nt, H, K, V)
        v_new = torch.empty_like(u) if w is not None else u  # the plain rule's v_new is v
        for a, b in zip(plan.round_starts[:-1].tolist(), plan.round_starts[1:].tolist()):
            tree_scan_fwd(
                kg,
                w,
                u,
                gc,
                cu_seqlens=cu[a : b + 1],
                chunk_offsets=co[a : b + 1],
                num_chunks=nt,
                chunk_size=B,
                initial_state=pool.index_select(0, meta.init_pool[a:b]),  # zero rows for roots
                export_index=meta.export_index,
                num_exported=e,
                output_final_state=True,
                out=(h, v_new if w is not None else None, pool[e + a : e + b], pool[:e]),
            )
        o = kernels.fwd_output(q, k, v_new, gc, Aqk, h, scale, cu, ci, B)
        ctx.save_for_backward(q, k, v, gc, beta, Aqk, Akk, pool)
        ctx.meta, ctx.scale, ctx.chunk_size, ctx.g_dtype, ctx.kernels = meta, scale, chunk_size, g.dtype, kernels
        return o.to(q.dtype)

    @staticmethod
    def backward(ctx, do):  # type: ignore[override]
        from harts.ops.linear_attn.tree_scan import tree_scan_bwd

        q, k, v, gc, beta, Aqk, Akk, pool = ctx.saved_tensors
        meta, scale, B, kernels = ctx.meta, ctx.scale, ctx.chunk_size, ctx.kernels
        plan = meta.plan
        cu, ci, co, nt, e = (
            meta.cu_seqlens,
            meta.chunk_indices,
            meta.chunk_offsets,
            plan.io.num_chunks,
            plan.export_slots,
        )
        do = do.contiguous()
        # every sequence's initial state is in the pool now: one rescan over all of them
        h0 = pool.index_select(0, meta.init_pool)
        w, qg, kg, h, v_new, dAqk, dv = kernels.bwd_head(q, k, v, gc, beta, Aqk, Akk, h0, do, scale, cu, ci, co, nt, B)
        dpool = torch.zeros_like(pool)
        dh = qg.new_empty(1, nt, *pool.shape[1:])
        dv2 = torch.empty_like(dv)
        bounds = list(zip(plan.round_starts[:-1].tolist(), plan.round_starts[1:].tolist()))

        def scan(a: int, b: int) -> None:  # round [a, b)'s backward scan into dh / dv2 / dpool
            _, dh0, _ = tree_scan_bwd(
                qg,
                kg,
                w,
                gc,
                do,
                dv,
                scale=scale,
                cu_seqlens=cu[a : b + 1],
                chunk_offsets=co[a : b + 1],
                num_chunks=nt,
                chunk_size=B,
                dht=dpool[e + a : e + b],  # zeros where no later round reads a final state
                inject=dpool[:e],
                inject_index=meta.inject_index,
                want_initial_state_grad=True,
                out=(dh, dv2),
            )
            # summed over each state's consumers (deterministic); the roots' land in the zero slot
            dpool.index_put_((meta.init_pool[a:b],), dh0, accumulate=True)

        def tail(lo: int, hi: int) -> list[torch.Tensor]:  # chunks [lo, hi) of the packed sequences
            hs, dhs = h[:, lo:hi], dh[:, lo:hi]
            return kernels.bwd_tail(
                q, k, v, v_new, w, gc, beta, Akk, hs, do, dhs, dv2, dAqk, scale, cu, ci[lo:hi], co, B
            )

        # the plain rule has no beta, and no gradient for it
        dtypes = (q.dtype, k.dtype, v.dtype, ctx.g_dtype, None if beta is None else beta.dtype)
        for a, b in reversed(bounds[1:]):
            scan(a, b)
        nt0 = int(plan.io.chunk_offsets[bounds[0][1]])  # the first round's chunks
        if not (OVERLAP_FIRST_ROUND and q.is_cuda and 0 < nt0 < nt):
            scan(*bounds[0])
            return (*(_cast(t, d) for t, d in zip(tail(0, nt), dtypes)), None, None, None, None)
        # the first round's scan (often one long shared prefix: the GPU mostly idle) on a
        # high-priority stream, beside the later rounds' chunk-parallel tail, which needs only
        # their own dh / dv2 (written above); then the first round's tail
        main, side = torch.cuda.current_stream(q.device), _scan_stream(q.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            scan(*bounds[0])
        rest = tail(nt0, nt)
        main.wait_stream(side)
        first = tail(0, nt0)
        t0 = int(plan.lengths[: bounds[0][1]].sum())  # rows of the first round: [0, t0)
        out = []
        for d in dtypes:  # each gradient's two halves into one tensor of its input's dtype
            a_, b_ = first.pop(0), rest.pop(0)
            if d is None:  # the plain rule's beta
                out.append(None)
                continue
            m = torch.empty(a_.shape, dtype=d, device=a_.device)
            m[:, :t0].copy_(a_[:, :t0])
            m[:, t0:].copy_(b_[:, t0:])
            out.append(m)
            del a_, b_
        return (*out, None, None, None, None)


def linked_tree_linear_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor | None,
    *,
    plan: LinkedPlan,
    chunk_size: int = 64,
    scale: float | None = None,
    rule: str = "delta",
) -> torch.Tensor:
    """Every round of ``plan`` in one op (``_LinkedKDA``): the rounds' outputs, packed as the plan
    packs their sequences.

    Args:
        q, k: [T, H, K] (CUDA); v: [T, H, V]; g: [T, H, K] (KDA) or [T, H] (GDN, SSD) log-decay;
        beta: [T, H] (rule "delta") or None (rule "plain": ``plain_on_tree`` must hold, which
        the compact executor checks before linking); T = ``plan.num_rows``. chunk_size: 64
        (fla's KDA kernels).

    Returns:
        o [T, H, V] (dtype of v). Equal to running the rounds one ``tree_chunk_linear_attn`` call
        each with the states handed over, up to the order of float additions.
    """
    cu_host = torch.as_tensor(np.concatenate([[0], np.cumsum(plan.lengths)]), dtype=torch.int64)
    spec = check_linear_attn_inputs(q, k, v, g, beta, cu_host, None, None, scale, rule)
    if not q.is_cuda:
        raise ValueError("linked_tree_linear_attn needs CUDA tensors; run the rounds through chunk_linear_attn on CPU")
    if rule == "plain" and not spec.scalar_decay:
        raise ValueError("linked rounds run the plain rule with a scalar decay g [T, H] only (plain_on_tree)")
    if chunk_size != 64:
        raise ValueError(f"the tree kernel runs fla's KDA intra-chunk kernels at chunk_size 64; got {chunk_size}")
    from harts.ops.linear_attn.fla import _import_fla

    _import_fla()
    if spec.T == 0:
        return v.new_zeros(0, spec.H, spec.V)
    meta = _linked_device(plan, q.device)
    gk, kernels = _decay_and_kernels(g, q, v, spec.scalar_decay, rule)
    o = _LinkedKDA.apply(
        q.unsqueeze(0).contiguous(),
        k.unsqueeze(0).contiguous(),
        v.unsqueeze(0).contiguous(),
        gk.unsqueeze(0).contiguous(),
        None if beta is None else beta.unsqueeze(0).contiguous(),
        meta,
        spec.scale,
        chunk_size,
        kernels,
    )
    return o[0].to(v.dtype)  # type: ignore[no-any-return]
