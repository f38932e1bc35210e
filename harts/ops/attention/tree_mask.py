"""Full attention on compact rows under a tree mask, with no K/V expansion (paper §3.4, view (b)).

Row j is visible to row i iff j is an ancestor of i or i itself in the compact trie:
    tree_pre[j] <= tree_pre[i] < tree_end[j]
(tree_pre = preorder index, tree_end = end of the row's subtree in preorder). Padding rows
(tree_pre = -1) see only themselves and are seen by no one. Two implementations of the same mask:

- "dense" (the CPU reference): query rows in preorder, in chunks; each chunk attends over the
  candidate rows that can be visible to any of its queries (pre[j] <= max pre and end[j] >
  min pre), with the exact mask inside. Under autograd each chunk is checkpointed, so memory
  stays at one chunk's scores in forward and backward.
- "flex" (CUDA): torch FlexAttention with a BlockMask over the same mask_mod; blocks that hold
  no ancestor pair are skipped, and blocks whose every pair is visible ("full") skip the
  mask_mod. Given host copies of tree_pre / tree_end (``tree_pre_host``, ``tree_end_host``:
  both execution contexts pass them), the BlockMask is built on the host
  (``harts.ops.attention.host_block_mask``): the compiled ``create_block_mask`` evaluates the
  mask_mod on the whole [P, P] grid, one kernel of ~13-16 ms per 64k-row microbatch on an H200
  (about 1 s of a 36.6 s ``medium`` step trajectory-wise), while the host needs only the block
  bounds: ~15 ms (document-causal) and ~9 ms (compact) per microbatch of ``medium`` step 0 at
  T = 65,536 (``python -m benchmarks.ops.block_mask``), uploaded non-blocking. Its rule,
  exact (the same blocks as ``create_block_mask``): a (q, kv) block is full iff both blocks are
  complete and padding-free, max kv pre <= min q pre and max q pre < min kv end; empty iff off
  the diagonal and no valid q pre lies in any valid kv row's [pre, end); else partial. The
  device builder (``tree_block_mask``) stays the reference and the path when only device
  tensors are given.

Backend of the "flex" path (``flex_backend``, ``HARTS_FLEX_BACKEND``): ``auto`` (the default)
runs FlexAttention's flash-attention backend on the CuTe DSL (``BACKEND="FLASH"``) wherever it
can: Hopper or newer, half precision, no GQA, deterministic algorithms off, and flash-attn-4
importable (``pip install harts[flash]``; ``scripts/fa4_wheels.sh`` for a machine without a
registry); elsewhere the Triton kernel. ``triton`` always runs Triton (bitwise reproducible),
``flash`` raises where FLASH cannot run, naming why. Its Hopper backward reads the BlockMask
only at a KV block of its tile (96 at MLA's 192 / 128 heads, ``flash_kv_block``), so its mask is
(128, 96), built on the host like the square one (``host_block_mask`` takes rectangular
blocks). On harts' largest ``swe`` step-5 microbatch (65,486 rows, 1.76 G visible pairs, 16 x
192 / 128 heads, bf16, one H200) forward + backward took 223.4 ms with harts' Triton tiles and
131.2 ms with FLASH (forward 44.5 -> 29.4 ms; outputs and gradients within 3.4e-3 of the Triton
kernel's, relative to their largest entry). (It was opt-in while its mask was built on the
device: one mask kernel per microbatch made the baseline's 61 ``medium`` microbatches' attention
slower, 3.24 -> 3.59 s, while harts' 11 got faster, 0.73 -> 0.57 s.) Its backward accumulates dq
with atomics (not bitwise reproducible); with ``torch.use_deterministic_algorithms(True)``
``auto`` runs Triton and ``flash`` is refused. The first use in a process runs a small probe
forward + backward; if it fails, ``auto`` warns once with the error and runs Triton.

Shapes: P physical rows, H query heads, G kv heads (G divides H), D qk dim, E v dim.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from torch.utils.checkpoint import checkpoint

from harts.ops.attention.core import attend, check_qkv
from harts.ops.attention.flex_tiles import HOPPER_SHARED_MEMORY, flex_tiles
from harts.ops.attention.host_block_mask import host_block_mask
from harts.ops.compiled import failure_summary
from harts.ops.registry import FLEX_BACKENDS

__all__ = [
    "FLASH_OPTIONS",
    "flash_kv_block",
    "flex_backend",
    "flex_kernel_options",
    "flex_backend_setting",
    "tree_block_mask",
    "tree_mask_attention",
    "tree_mask_mod",
    "tree_visibility",
]


def tree_visibility(tree_pre_q: torch.Tensor, tree_pre_kv: torch.Tensor, tree_end_kv: torch.Tensor) -> torch.Tensor:
    """bool [Lq, Lkv]: kv row j is an ancestor-or-self of query row i (padding rows: nothing;
    the caller adds each padding row's view of itself)."""
    pq, pk = tree_pre_q[:, None], tree_pre_kv[None, :]
    return (pk <= pq) & (pq < tree_end_kv[None, :]) & (pk >= 0) & (pq >= 0)


def tree_mask_attention(
    q_PHD: torch.Tensor,
    k_PGD: torch.Tensor,
    v_PGE: torch.Tensor,
    *,
    tree_pre: torch.Tensor,
    tree_end: torch.Tensor,
    scale: float,
    impl: str = "auto",
    row_chunk: int = 256,
    mask_cache: dict | None = None,
    tree_pre_host: np.ndarray | None = None,
    tree_end_host: np.ndarray | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Tree-masked attention over all physical rows.

    The mask of a trunk p0 p1 with two branches a0 and b0 b1 (preorder p0 p1 a0 b0 b1)::

                 kv: p0 p1 a0 b0 b1
        q  p0        x  .  .  .  .
        q  p1        x  x  .  .  .
        q  a0        x  x  x  .  .
        q  b0        x  x  .  x  .
        q  b1        x  x  .  x  x

    Args:
        q_PHD: [P, H, D] queries.
        k_PGD: [P, G, D] keys (G divides H).
        v_PGE: [P, G, E] values (E may differ from D).
        tree_pre: int [P] preorder index of each row in the compact trie, -1 for padding.
        tree_end: int [P] end (exclusive) of each row's subtree in preorder.
        scale: softmax scale.
        impl: "auto" (flex on CUDA, dense elsewhere), "dense" or "flex".
        row_chunk: query rows per chunk of the dense implementation.
        mask_cache: a dict owned by the caller for one (tree_pre, tree_end): the flex
            implementation stores its BlockMask there and reuses it (every attention layer of
            a microbatch, and its recomputation, shares one mask).
        tree_pre_host, tree_end_host: int [P] numpy copies of tree_pre / tree_end (both or
            neither): the flex BlockMask is then built on the host, with no mask kernel and no
            device synchronization (module docstring).
        backend: the flex implementation's FlexAttention backend, "flash" or "triton", as the
            kernel record chose it (``harts.models.execution.backends``); None: ``flex_backend``
            chooses here.

    Returns:
        o_PHE: [P, H, E].
    """
    check_qkv(q_PHD, k_PGD, v_PGE)
    P = q_PHD.shape[0]
    if k_PGD.shape[0] != P or tree_pre.shape != (P,) or tree_end.shape != (P,):
        raise ValueError(f"k, v, tree_pre and tree_end must all have P={P} rows")
    if tree_pre_host is None or tree_end_host is None:
        if tree_pre_host is not None or tree_end_host is not None:
            raise ValueError("tree_pre_host and tree_end_host go together: give both or neither")
    elif np.shape(tree_pre_host) != (P,) or np.shape(tree_end_host) != (P,):
        raise ValueError(f"tree_pre_host and tree_end_host must have P={P} rows")
    if impl == "auto":
        impl = "flex" if q_PHD.is_cuda else "dense"
    if impl == "dense":
        return _dense(q_PHD, k_PGD, v_PGE, tree_pre.to(q_PHD.device), tree_end.to(q_PHD.device), scale, row_chunk)
    if impl == "flex":
        D, G, E = q_PHD.shape[2], k_PGD.shape[1], v_PGE.shape[2]
        if backend is None:
            backend = flex_backend(q_PHD.device, q_PHD.dtype, D, E, gqa=G != q_PHD.shape[1])
        elif backend not in ("flash", "triton"):
            raise ValueError(f"backend must be 'flash', 'triton' or None; got {backend!r}")
        flash = backend == "flash"
        kv_block = flash_kv_block(D, E) if flash else 128
        # one mask per backend and KV block: attention layers of other head dims (MLA beside
        # GQA) need FLASH's KV block of their own
        key = f"flex_block_mask_flash_{kv_block}" if flash else "flex_block_mask"
        block_mask = mask_cache.get(key) if mask_cache is not None else None
        if block_mask is None:
            pre, end = tree_pre.to(q_PHD.device), tree_end.to(q_PHD.device)
            block_mask = None
            if tree_pre_host is not None and tree_end_host is not None:
                block_mask = _host_block_mask_or_none(tree_pre_host, tree_end_host, pre, end, (128, kv_block))
            if block_mask is None:
                block_mask = tree_block_mask(pre, end, kv_block=kv_block)
            if mask_cache is not None:
                mask_cache[key] = block_mask
        return _flex(q_PHD, k_PGD, v_PGE, block_mask, scale, flash=flash)
    raise ValueError(f"impl must be 'auto', 'dense' or 'flex'; got {impl!r}")


def _dense(q, k, v, pre, end, scale: float, row_chunk: int) -> torch.Tensor:
    P, H = q.shape[:2]
    order = torch.argsort(pre)  # padding (-1) first; then each chunk is a preorder range
    valid = pre >= 0
    outs = []
    for lo in range(0, P, row_chunk):
        rows = order[lo : lo + row_chunk]
        pre_rows = pre[rows]
        # rows visible to some query of the chunk: ancestors of its first..last preorder rows
        hit = valid & (pre <= pre_rows.max()) & (end > pre_rows.clamp(min=0).min())
        hit[rows] = True  # padding queries see themselves
        cand = torch.nonzero(hit).flatten()
        if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):
            outs.append(checkpoint(_dense_chunk, q, k, v, pre, end, rows, cand, scale, use_reentrant=False))
        else:
            outs.append(_dense_chunk(q, k, v, pre, end, rows, cand, scale))
    out = q.new_zeros(P, H, v.shape[2], dtype=v.dtype)
    return out.index_copy(0, order, torch.cat(outs)) if outs else out


def _dense_chunk(q, k, v, pre, end, rows, cand, scale: float) -> torch.Tensor:
    mask = tree_visibility(pre[rows], pre[cand], end[cand]) | (rows[:, None] == cand[None, :])
    return attend(q[rows], k[cand], v[cand], mask, scale)


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    # dynamic shapes: every microbatch has its own P, and a static compile per P hits dynamo's
    # recompile limit (8) after a few microbatches; past it flex_attention runs eagerly, which
    # materializes the [H, P, P] score matrix (hundreds of GB at P = 64k)
    return torch.compile(flex_attention, dynamic=True)


def _host_block_mask_or_none(  # noqa: ANN202
    pre_host: np.ndarray, end_host: np.ndarray, pre: torch.Tensor, end: torch.Tensor, block_size: tuple[int, int]
):
    """The host-built BlockMask in (q rows, kv rows) blocks, or None with a warning where this
    torch's ``BlockMask`` does not take the host lists (its constructor's keywords exist since
    torch 2.6; the caller then uses the device builder). Input errors (``ValueError`` from the
    classification) still raise."""
    try:
        return host_block_mask(pre_host, end_host, tree_mask_mod(pre, end), pre.device, block_size)
    except (TypeError, ImportError) as exc:
        import warnings

        warnings.warn(
            f"building the FlexAttention BlockMask on the host failed ({failure_summary(exc)}); building it on the "
            "device",
            stacklevel=3,
        )
        return None


def tree_mask_mod(pre: torch.Tensor, end: torch.Tensor):  # noqa: ANN201
    """FlexAttention mask_mod of the ancestor-or-self mask over int [P] device tensors pre / end
    (module docstring): what the kernel evaluates on partial blocks, however they were found."""

    def mask_mod(b, h, q_idx, kv_idx):
        pq, pk = pre[q_idx], pre[kv_idx]
        return ((pk <= pq) & (pq < end[kv_idx]) & (pk >= 0) & (pq >= 0)) | (q_idx == kv_idx)

    return mask_mod


def _build_block_mask(pre: torch.Tensor, end: torch.Tensor, kv_block: int = 128):  # noqa: ANN202
    from torch.nn.attention.flex_attention import create_block_mask

    P = pre.shape[0]
    return create_block_mask(tree_mask_mod(pre, end), None, None, P, P, device=pre.device, BLOCK_SIZE=(128, kv_block))


@functools.cache
def _compiled_block_mask(kv_block: int = 128):
    # eager create_block_mask evaluates mask_mod on the whole [P, P] grid: int64 [P, P]
    # intermediates, ~2.5 GB at P = 16 k and P^2 beyond; compiled, the grid is reduced to
    # blocks without being materialized. Dynamic shapes: one graph for every P (kv_block is
    # bound here, so that it stays a constant of the graph)
    return torch.compile(functools.partial(_build_block_mask, kv_block=kv_block), dynamic=True)


def tree_block_mask(tree_pre: torch.Tensor, tree_end: torch.Tensor, kv_block: int = 128):  # noqa: ANN201
    """FlexAttention ``BlockMask`` of the ancestor-or-self mask (module docstring) over P rows,
    in blocks of 128 query rows x ``kv_block`` key rows.

    Built by the compiled builder; if compiling fails on this torch / device, the eager
    builder (same blocks, [P, P] intermediates) is used with a warning.
    """
    try:
        return _compiled_block_mask(kv_block)(tree_pre, tree_end)
    except Exception as exc:  # noqa: BLE001 - any compiler failure: keep training, say why
        import warnings

        warnings.warn(
            f"compiled FlexAttention block-mask builder failed ({failure_summary(exc)}); building it eagerly",
            stacklevel=2,
        )
        return _build_block_mask(tree_pre, tree_end, kv_block)


def _flex(q, k, v, block_mask, scale: float, flash: bool = False) -> torch.Tensor:
    options = FLASH_OPTIONS if flash else flex_kernel_options(q.device, q.dtype, q.shape[2], v.shape[2])
    o = _compiled_flex()(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        block_mask=block_mask,
        scale=scale,
        enable_gqa=k.shape[1] != q.shape[1],
        kernel_options=None if options is None else dict(options),
    )
    return o[0].transpose(0, 1)


#: FlexAttention's kernel options for its flash-attention (CuTe DSL) backend
FLASH_OPTIONS = {"BACKEND": "FLASH"}


def flash_kv_block(qk_dim: int, v_dim: int) -> int:
    """The KV block of a BlockMask that flash-attn-4's Hopper backward reads: its backward tile's
    key rows (128 up to head dim 128, 96 up to 192, 64 above; ``_tile_size_bwd_sm90``), each
    query block of 128 rows holding whole tiles of 64 or 128."""
    return 128 if qk_dim <= 128 else 96 if qk_dim <= 192 else 64


def flex_backend(device: torch.device, dtype: torch.dtype, qk_dim: int, v_dim: int, *, gqa: bool = False) -> str:
    """ "flash" or "triton": which FlexAttention backend the "flex" path runs (module docstring),
    by ``HARTS_FLEX_BACKEND``: ``auto`` (the default; FLASH where it can run these shapes),
    ``triton`` or ``flash`` (raises ``RuntimeError`` naming the reason where FLASH cannot run)."""
    want = flex_backend_setting()
    if want == "triton":
        return "triton"
    if device.type == "cuda" and device.index is None:  # one probe for "cuda" and "cuda:0" (its cache key)
        device = torch.device("cuda", torch.cuda.current_device())
    why = _flash_unusable(device, dtype, qk_dim, v_dim, gqa)
    if why is None:
        return "flash"
    if want == "flash":
        raise RuntimeError(f"HARTS_FLEX_BACKEND=flash, but FlexAttention's flash backend cannot run here: {why}")
    if why.startswith(_PROBE_FAILED):
        _warn_once(f"FlexAttention's flash backend is installed but {why}; running the Triton kernel")
    return "triton"


@functools.cache
def _warn_once(message: str) -> None:
    import warnings

    warnings.warn(message, stacklevel=4)


_PROBE_FAILED = "its probe failed"


def flex_backend_setting() -> str:
    """``HARTS_FLEX_BACKEND``, checked: "auto" (also when unset or empty), "triton" or "flash";
    raises ``ValueError`` naming any other value (``harts.cli`` checks it before a command runs)."""
    import os

    want = os.environ.get("HARTS_FLEX_BACKEND", "auto").strip().lower() or "auto"
    if want not in FLEX_BACKENDS:
        raise ValueError(f"HARTS_FLEX_BACKEND must be one of {', '.join(FLEX_BACKENDS)}; got {want!r}")
    return want


def _flash_unusable(device: torch.device, dtype: torch.dtype, qk_dim: int, v_dim: int, gqa: bool) -> str | None:
    """Why FLASH cannot run these shapes here (None: it can; the probe ran once and passed)."""
    if device.type != "cuda":
        return "not a CUDA device"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"{dtype} (it takes bfloat16 / float16)"
    if torch.cuda.get_device_capability(device)[0] < 9:
        return "a GPU older than Hopper (sm 9.0)"
    if gqa:
        return "grouped-query heads (not probed)"
    if qk_dim > 256 or v_dim > 256 or qk_dim % 8 or v_dim % 8:
        return f"head dims {qk_dim} / {v_dim}"
    if torch.are_deterministic_algorithms_enabled():
        return "deterministic algorithms are on (its backward accumulates with atomics)"
    return _flash_probe(device, dtype, qk_dim, v_dim)


@functools.cache
def _flash_probe(device: torch.device, dtype: torch.dtype, qk_dim: int, v_dim: int) -> str | None:
    """One small forward + backward through FLASH with a (128, ``flash_kv_block``) tree mask
    (two rows of 384 tokens); the reason it fails, or None. Run once per shape and process."""
    import importlib.util

    try:
        if importlib.util.find_spec("flash_attn.cute") is None:
            return "flash-attn-4 is not installed (pip install harts[flash])"
    except ImportError:
        return "flash-attn-4 is not installed (pip install harts[flash])"
    try:
        with torch.enable_grad():
            _probe_flash(device, dtype, qk_dim, v_dim)
    except Exception as exc:  # noqa: BLE001 - any failure: the caller raises with its reason
        return f"{_PROBE_FAILED} ({type(exc).__name__}: {str(exc)[:300]})"
    return None


def _probe_flash(device: torch.device, dtype: torch.dtype, qk_dim: int, v_dim: int) -> None:
    """Forward + backward of two 384-token documents through FLASH (raises what it raises)."""
    P, H = 768, 2
    gen = torch.Generator(device=device).manual_seed(0)
    q, k = (torch.randn(P, H, qk_dim, device=device, dtype=dtype, generator=gen) for _ in range(2))
    v = torch.randn(P, H, v_dim, device=device, dtype=dtype, generator=gen)
    for t in (q, k, v):
        t.requires_grad_()
    pre_host = np.arange(P)
    end_host = np.where(pre_host < P // 2, P // 2, P)
    pre, end = torch.from_numpy(pre_host).to(device), torch.from_numpy(end_host).to(device)
    mask = host_block_mask(pre_host, end_host, tree_mask_mod(pre, end), device, (128, flash_kv_block(qk_dim, v_dim)))
    _flex(q, k, v, mask, qk_dim**-0.5, flash=True).float().square().sum().backward()
    torch.cuda.synchronize(device)


def flex_kernel_options(device: torch.device, dtype: torch.dtype, qk_dim: int, v_dim: int) -> dict | None:
    """FlexAttention tile options of the Triton kernel for these heads on ``device``, or None:
    torch's own tiles (CPU kernels take none).

    ``harts.ops.attention.flex_tiles.flex_tiles`` chooses them by head dim, dtype and the GPU's
    shared memory per block, so that the forward and backward both fit (its module docstring
    gives the estimate, the preference lists and the tiles' measurements); they divide the
    (128, 128) blocks of the Triton path's BlockMask. Raises ValueError for head dims above
    ``FLEX_MAX_HEAD_DIM`` (256), which ``ExecutionConfig.resolved_attention`` keeps off this path.
    """
    if device.type != "cuda":
        return None
    capability = torch.cuda.get_device_capability(device)
    return flex_tiles(qk_dim, v_dim, dtype.itemsize, capability, _shared_memory_per_block(device, capability))


def _shared_memory_per_block(device: torch.device, capability: tuple[int, int]) -> int:
    """Bytes of shared memory one block may opt in to: the SM's less the 1 KiB CUDA reserves per
    block (227 KiB on Hopper); Hopper's without a CUDA runtime (the rule's CPU tests)."""
    if not torch.cuda.is_available():
        return HOPPER_SHARED_MEMORY
    per_sm = getattr(torch.cuda.get_device_properties(device), "shared_memory_per_multiprocessor", None)
    return HOPPER_SHARED_MEMORY if per_sm is None else int(per_sm) - 1024
