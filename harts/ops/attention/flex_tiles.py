"""FlexAttention's Triton tile options by head dim and dtype, chosen to fit shared memory.

A pure rule (no torch, no device): ``flex_tiles`` maps (qk dim, v dim, bytes per element, GPU
capability, shared memory per block, BlockMask block) to the ``kernel_options`` of the "flex"
path (``harts.ops.attention.tree_mask``), or None where torch 2.11's own tiles are kept.

Why a rule. Inductor's flex kernels hold their tiles in shared memory at the head dims rounded up
to a power of two (``QK_HEAD_DIM_ROUNDED``: 192 is laid out as 256). A tile that fits at one head
dim can fail to compile at the next: the forward tile harts measured for MLA's 192 / 128 heads
(128 x 64 rows, 3 stages) needs 270,336 bytes at 256 / 256 (Triton's figure on an H200, whose
blocks get at most 232,448), so ``attention="mask"`` crashed at the first GQA layer of a head
dim 256 model. Each side's tile is therefore the first of a preference list whose estimated
shared memory fits:

* forward: Q once, K and V once per stage, the probabilities' tile::

      (BLOCK_M * Dq + stages * BLOCK_N * (Dq + Dv) + BLOCK_M * BLOCK_N) * bytes

  (the P tile overestimates Triton's 8 KiB of extras at 128 x 64, so the estimate is on the
  safe side of the one compiler figure above, 278,528 against 270,336);
* backward, one kernel whose programs do either dk / dv or dq, so the larger of::

      (BLOCK_N1 * (Dq + Dv) + stages * BLOCK_M1 * (Dq + Dv) + 2 * BLOCK_N1 * BLOCK_M1) * bytes
      (BLOCK_M2 * (Dq + Dv) + stages * BLOCK_N2 * (Dq + Dv) + 2 * BLOCK_M2 * BLOCK_N2) * bytes

  (the tile kept for the whole loop, the pipelined tiles, the two score-shaped operands).

Where torch's tiles are kept: head dims up to 128 (its Hopper table fits and is what the GPU
figures were measured with), and half precision off Hopper (sm 9.0), where harts has measured
nothing. Above 128 on Hopper the first choices are harts' measured MLA tiles (forward 128 x 64 in
3 stages with bulk tensor copies; backward 32 / 128 / 128 / 32 in 3 stages, 8 warps: forward +
backward 134.9 -> 68.2 ms against torch's tiles on ``medium``'s largest compact microbatch,
``benchmarks.ops.attention``); where they do not fit (qk and v both above 128) the next ones
halve the pipelined K / V rows or stages and keep 8 warps, since the dk / dv accumulators of 64
key rows at dim 256 already take 128 registers a thread at 8 warps. float32 above 128 has one
stage on any CUDA GPU (torch's 64 x 64 in 3 stages needs ~274 KiB).

Every tile divides the BlockMask's blocks (FlexAttention asserts it) and keeps the backward
kernel's own asserts (BLOCK_N1 % BLOCK_M1 == 0, BLOCK_M2 % BLOCK_N2 == 0). Head dims above
``FLEX_MAX_HEAD_DIM`` (rounded to 512) are refused: no tile here was tried there, and the
callers resolve such models to the gather path (``ExecutionConfig.resolved_attention``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

__all__ = [
    "FLEX_MAX_HEAD_DIM",
    "HOPPER_SHARED_MEMORY",
    "BwdTile",
    "FwdTile",
    "bwd_shared_bytes",
    "flex_tiles",
    "fwd_shared_bytes",
    "rounded_head_dim",
]

#: the largest query/key or value head dim the "flex" path takes (rounded up: 256)
FLEX_MAX_HEAD_DIM = 256
#: shared memory one block of an H100 / H200 may opt in to (228 KiB per SM less 1 KiB)
HOPPER_SHARED_MEMORY = 232_448


class FwdTile(NamedTuple):
    """A forward tile: BLOCK_M query rows, BLOCK_N key rows, pipeline stages, warps, bulk copies."""

    block_m: int
    block_n: int
    stages: int
    warps: int
    tma: bool = False


class BwdTile(NamedTuple):
    """A backward tile: dk / dv programs of BLOCK_N1 key rows stepping BLOCK_M1 query rows, dq
    programs of BLOCK_M2 query rows stepping BLOCK_N2 key rows; stages and warps."""

    block_m1: int
    block_n1: int
    block_m2: int
    block_n2: int
    stages: int
    warps: int


#: Hopper, half precision, head dims above 128: preference order (module docstring)
_HOPPER_HALF_FWD = (
    FwdTile(128, 64, 3, 8, tma=True),
    FwdTile(128, 64, 2, 8),
    FwdTile(64, 64, 2, 4),
    FwdTile(64, 32, 2, 4),
)
_HOPPER_HALF_BWD = (
    BwdTile(32, 128, 128, 32, 3, 8),
    BwdTile(32, 64, 64, 32, 3, 8),
    BwdTile(32, 64, 64, 32, 2, 8),
    BwdTile(16, 32, 32, 16, 2, 4),
)
#: float32, head dims above 128, any CUDA GPU; its backward keeps torch's 16-row tiles
_F32_FWD = (FwdTile(32, 64, 1, 8), FwdTile(32, 32, 1, 4), FwdTile(16, 32, 1, 4))


def rounded_head_dim(d: int) -> int:
    """The power of two >= d at which the kernels lay out a head dim of d."""
    return 1 << max(d - 1, 0).bit_length()


def fwd_shared_bytes(tile: FwdTile, qk_dim: int, v_dim: int, itemsize: int) -> int:
    """Estimated shared memory of the forward kernel with ``tile`` (module docstring)."""
    dq, dv = rounded_head_dim(qk_dim), rounded_head_dim(v_dim)
    m, n = tile.block_m, tile.block_n
    return (m * dq + tile.stages * n * (dq + dv) + m * n) * itemsize


def bwd_shared_bytes(tile: BwdTile, qk_dim: int, v_dim: int, itemsize: int) -> int:
    """Estimated shared memory of the backward kernel with ``tile``: its larger half (module
    docstring)."""
    width = rounded_head_dim(qk_dim) + rounded_head_dim(v_dim)
    dkdv = tile.block_n1 * width + tile.stages * tile.block_m1 * width + 2 * tile.block_n1 * tile.block_m1
    dq = tile.block_m2 * width + tile.stages * tile.block_n2 * width + 2 * tile.block_m2 * tile.block_n2
    return max(dkdv, dq) * itemsize


def _fwd_fits_block(t: FwdTile, block: tuple[int, int]) -> bool:
    return block[0] % t.block_m == 0 and block[1] % t.block_n == 0


def _bwd_fits_block(t: BwdTile, block: tuple[int, int]) -> bool:
    q, kv = block
    divides = q % t.block_m1 == 0 and q % t.block_m2 == 0 and kv % t.block_n1 == 0 and kv % t.block_n2 == 0
    return divides and t.block_n1 % t.block_m1 == 0 and t.block_m2 % t.block_n2 == 0


def flex_tiles(
    qk_dim: int,
    v_dim: int,
    itemsize: int,
    capability: tuple[int, int],
    shared_memory: int,
    block: tuple[int, int] = (128, 128),
) -> dict[str, Any] | None:
    """FlexAttention ``kernel_options`` (``fwd_*`` / ``bwd_*``) for these heads, or None: torch's
    own tiles (module docstring).

    Args:
        qk_dim, v_dim: query/key and value head dims.
        itemsize: bytes per element of q, k, v (2: bfloat16 / float16, 4: float32).
        capability: the CUDA GPU's compute capability, e.g. (9, 0).
        shared_memory: bytes of shared memory one block may use on that GPU.
        block: the BlockMask's (query rows, key rows) per block; every tile divides it.

    Raises:
        ValueError: a head dim above ``FLEX_MAX_HEAD_DIM``, or no listed tile fits
            ``shared_memory`` (names the head dims and the bytes).
    """
    if max(qk_dim, v_dim) > FLEX_MAX_HEAD_DIM:
        raise ValueError(
            f"FlexAttention's tiles go up to head dim {FLEX_MAX_HEAD_DIM}; got query/key {qk_dim}, value {v_dim}"
        )
    if max(qk_dim, v_dim) <= 128:
        return None
    fwd: tuple[FwdTile, ...]
    bwd: tuple[BwdTile, ...]
    if itemsize == 4:
        fwd, bwd = _F32_FWD, ()
    elif itemsize == 2 and capability == (9, 0):
        fwd, bwd = _HOPPER_HALF_FWD, _HOPPER_HALF_BWD
    else:
        return None
    ft = next(
        (t for t in fwd if _fwd_fits_block(t, block) and fwd_shared_bytes(t, qk_dim, v_dim, itemsize) <= shared_memory),
        None,
    )
    bt = next(
        (t for t in bwd if _bwd_fits_block(t, block) and bwd_shared_bytes(t, qk_dim, v_dim, itemsize) <= shared_memory),
        None,
    )
    if ft is None or (bwd and bt is None):
        raise ValueError(
            f"no FlexAttention {'forward' if ft is None else 'backward'} tile for head dims {qk_dim} / {v_dim} "
            f"({itemsize}-byte elements, blocks {block}) fits {shared_memory} bytes of shared memory"
        )
    opts: dict[str, Any] = {
        "fwd_BLOCK_M": ft.block_m,
        "fwd_BLOCK_N": ft.block_n,
        "fwd_num_stages": ft.stages,
        "fwd_num_warps": ft.warps,
    }
    if ft.tma:
        # bulk copies in the forward only: in the backward they measured slower
        opts["fwd_USE_TMA"] = True
    if bt is not None:
        opts.update(
            bwd_BLOCK_M1=bt.block_m1,
            bwd_BLOCK_N1=bt.block_n1,
            bwd_BLOCK_M2=bt.block_m2,
            bwd_BLOCK_N2=bt.block_n2,
            bwd_num_stages=bt.stages,
            bwd_num_warps=bt.warps,
        )
    return opts
