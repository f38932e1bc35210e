"""The tree mask's FlexAttention ``BlockMask`` built on the host from numpy, with no mask kernel.

``create_block_mask`` evaluates the mask_mod on the whole [P, P] grid on the device (one kernel
of ~13-16 ms per 64k-row microbatch on an H200). The visibility is known on the host, so the
block structure is computed here from ``tree_pre`` / ``tree_end`` in a few milliseconds and only
the block lists are uploaded (non-blocking); the kernel evaluates the mask_mod on partial
blocks only. The blocks equal ``create_block_mask``'s exactly (same lists, same order).

The mask (``harts.ops.attention.tree_mask``): row j is visible to row i iff
``pre[j] <= pre[i] < end[j]`` with both pre >= 0, or i == j. Valid pre values must be distinct
(preorder ids). Per (q block a, kv block b) of ``block_size`` rows, with blocks that reach past
row P counted as holding masked pairs (``create_block_mask`` pads the grid with False):

* FULL iff both blocks are complete and padding-free and
  ``max_K pre <= min_Q pre`` and ``max_Q pre < min_K end``. Exact: the two conditions are the
  all-pairs conditions taken apart (every pair must satisfy both, and they involve i and j
  separately). A pair of blocks sharing >= 2 rows is never full (two distinct pre cannot each
  be <= the other), and the rule says so too.
* EMPTY iff no pair is visible: never when the two blocks share a row (every row sees itself);
  otherwise iff no
  query pre lies in the union of the kv rows' intervals [pre[j], end[j]). Exact: the valid query
  pre of all blocks are cut into runs of consecutive values (one q block each, disjoint, sorted
  by start), each kv row's interval overlaps a contiguous range of runs (two binary searches),
  and the q blocks of that range are the OR of two entries of a sparse table of q-block bitsets
  over the runs. The cost is O(P log R + R log R x n / 64) for R runs: R is about n for rows
  laid out near preorder (document-causal rows, harts' layouts: ~10-20 ms per 64k-row
  microbatch in total), up to P for a shuffled order (~75 ms and a 70 MB table at P = 64k).
* otherwise PARTIAL.

``exact=False`` replaces the EMPTY test by block bounds (``min_K pre <= max_Q pre`` and
``max_K end > min_Q pre``): conservative (never misses a visible pair), exact for
document-causal rows, kept to measure what exactness saves on real layouts.

Blocks may be rectangular, ``block_size=(q rows, kv rows)``: flash-attn-4's Hopper backward
(FlexAttention's ``BACKEND="FLASH"``) reads the mask at KV blocks of 96 rows for MLA's 192 / 128
heads, so its mask is (128, 96). The rules above hold per pair of blocks whatever their sizes,
and a (q, kv) block holding some row on both sides is never empty (the row sees itself).

Shapes: P rows, n_q = ceil(P / q rows) and n_kv = ceil(P / kv rows) blocks; block matrices
[n_q, n_kv].
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from harts.ops.upload import upload

__all__ = ["block_lists", "host_block_mask", "tree_block_classes"]

_DEFAULT_BLOCK = 128  # torch's _DEFAULT_SPARSE_BLOCK_SIZE


def tree_block_classes(
    tree_pre: np.ndarray,
    tree_end: np.ndarray,
    block_size: int | tuple[int, int] = _DEFAULT_BLOCK,
    *,
    exact: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    """Classify every (q block, kv block) of the tree mask (module docstring).

    Args:
        tree_pre: int [P] preorder id of each row, -1 for padding (valid ids distinct).
        tree_end: int [P] end (exclusive) of each row's subtree in preorder (> pre on valid rows).
        block_size: rows per block, one number for both sides or (q rows, kv rows), each >= 2
            (FlexAttention's ``BLOCK_SIZE``; flash-attn-4's Hopper backward wants (128, 96)).
        exact: exact EMPTY test (default), or the conservative block-bounds test.

    Returns:
        (partial_QK, full_QK): bool [n_q, n_kv] each (n = ceil(P / rows per block)), disjoint;
        neither = empty.
    """
    pre = np.asarray(tree_pre, dtype=np.int64)
    end = np.asarray(tree_end, dtype=np.int64)
    P = pre.shape[0]
    if pre.ndim != 1 or end.shape != (P,):
        raise ValueError(f"tree_pre and tree_end must both be [P]; got {pre.shape} and {end.shape}")
    bq, bk = _block_pair(block_size)
    valid = pre >= 0
    if (end[valid] <= pre[valid]).any():
        raise ValueError("tree_end must exceed tree_pre on valid rows (a row's subtree holds the row)")
    runs = _preorder_runs(pre, valid, bq)
    nq, nk = -(-P // bq), -(-P // bk)
    full = _full_blocks(pre, end, valid, bq, bk, nq, nk)
    if exact:
        nonempty = _nonempty_exact(pre, end, valid, bk, nq, nk, runs)
    else:
        nonempty = _nonempty_bounds(pre, end, valid, bq, bk, nq, nk)
    # every row sees itself: the blocks holding a (row, row) pair are never empty
    rows = np.arange(P)
    nonempty[rows // bq, rows // bk] = True
    return nonempty & ~full, full


def _block_pair(block_size: int | tuple[int, int]) -> tuple[int, int]:
    """(q rows, kv rows) per block from one number or a pair; each must be an integer >= 2."""
    pair = (block_size, block_size) if isinstance(block_size, (int, np.integer)) else tuple(block_size)
    if len(pair) != 2 or any(not isinstance(b, (int, np.integer)) or b < 2 for b in pair):
        raise ValueError(f"block_size must be an integer >= 2 or a pair of them (q rows, kv rows); got {block_size!r}")
    return int(pair[0]), int(pair[1])


def _block_reduce(x: np.ndarray, block_size: int, n: int, fill: int, ufunc: np.ufunc) -> np.ndarray:
    """ufunc over each block of x [P] (the last block padded with ``fill``) -> [n]."""
    padded = np.full(n * block_size, fill, dtype=x.dtype)
    padded[: x.shape[0]] = x
    return ufunc.reduce(padded.reshape(n, block_size), axis=1)


def _full_blocks(pre: np.ndarray, end: np.ndarray, valid: np.ndarray, bq: int, bk: int, nq: int, nk: int) -> np.ndarray:
    big = np.iinfo(np.int64).max
    # a row past P counts as padding: create_block_mask pads the grid with masked pairs
    clean_q = _block_reduce(valid, bq, nq, False, np.logical_and)
    clean_k = _block_reduce(valid, bk, nk, False, np.logical_and)
    min_pre_q = _block_reduce(pre, bq, nq, big, np.minimum)
    max_pre_q = _block_reduce(pre, bq, nq, -1, np.maximum)
    max_pre_k = _block_reduce(pre, bk, nk, -1, np.maximum)
    min_end_k = _block_reduce(end, bk, nk, -1, np.minimum)
    return (
        clean_q[:, None]
        & clean_k[None, :]
        & (max_pre_k[None, :] <= min_pre_q[:, None])
        & (max_pre_q[:, None] < min_end_k[None, :])
    )


def _nonempty_bounds(
    pre: np.ndarray, end: np.ndarray, valid: np.ndarray, bq: int, bk: int, nq: int, nk: int
) -> np.ndarray:
    big = np.iinfo(np.int64).max
    vpre_lo_k = _block_reduce(np.where(valid, pre, big), bk, nk, big, np.minimum)
    vend_hi_k = _block_reduce(np.where(valid, end, -1), bk, nk, -1, np.maximum)
    vpre_lo_q = _block_reduce(np.where(valid, pre, big), bq, nq, big, np.minimum)
    vpre_hi_q = _block_reduce(np.where(valid, pre, -1), bq, nq, -1, np.maximum)
    # blocks of padding only have vpre_lo = big / vpre_hi = -1: both tests fail
    return (vpre_lo_k[None, :] <= vpre_hi_q[:, None]) & (vend_hi_k[None, :] > vpre_lo_q[:, None])


def _preorder_runs(pre: np.ndarray, valid: np.ndarray, block_size: int) -> tuple[np.ndarray, ...]:
    """Maximal runs of consecutive valid rows of one (q) block whose pre go up by one, in
    physical order: (start pre, end pre, block) int64 [R] each, plus the order sorting them by
    start. Raises ValueError unless the runs are disjoint, i.e. the valid pre are distinct."""
    rows = np.flatnonzero(valid)
    vpre, block = pre[rows], rows // block_size
    starts = np.ones(rows.size, dtype=bool)
    starts[1:] = (block[1:] != block[:-1]) | (vpre[1:] != vpre[:-1] + 1)
    first = np.flatnonzero(starts)
    run_s = vpre[first]
    run_t = run_s + np.diff(np.append(first, rows.size))
    by_start = np.argsort(run_s, kind="stable")
    if (run_s[by_start][1:] < run_t[by_start][:-1]).any():
        raise ValueError("tree_pre: valid (>= 0) preorder ids must be distinct")
    return run_s, run_t, block[first], by_start


def _nonempty_exact(
    pre: np.ndarray, end: np.ndarray, valid: np.ndarray, bk: int, nq: int, nk: int, runs: tuple[np.ndarray, ...]
) -> np.ndarray:
    out = np.zeros((nq, nk), dtype=bool)
    run_s, run_t, run_q, by_start = runs  # run_q: the q block of each run (physical order)
    R = run_s.size
    if R == 0:
        return out
    rows = np.flatnonzero(valid)
    vpre, block = pre[rows], rows // bk  # kv rows and their kv blocks (nondecreasing)
    s_sorted, t_sorted = run_s[by_start], run_t[by_start]
    # kv row j overlaps the runs [lo, hi) in start order: t > pre[j] and s < end[j]; never
    # none, as [pre[j], end[j]) holds pre[j]
    lo = np.searchsorted(t_sorted, vpre, side="right")
    hi = np.searchsorted(s_sorted, end[rows], side="left")
    # the q blocks of runs [lo, hi): OR of two entries of a sparse table of q-block bitsets
    # over the runs in start order (O(R log R) words to build, O(1) per kv row)
    table = _or_sparse_table(run_q[by_start], nq)
    level = np.log2(hi - lo).astype(np.int64)  # exact for the lengths here (< 2^52)
    hit_words = table[level, lo] | table[level, hi - (1 << level)]
    # OR over the rows of each kv block (rows are in physical order: block nondecreasing)
    first = np.flatnonzero(np.r_[True, block[1:] != block[:-1]])
    acc = np.bitwise_or.reduceat(hit_words, first, axis=0)
    bits = np.unpackbits(acc.astype("<u8").view(np.uint8), axis=1, bitorder="little")[:, :nq]
    out[:, block[first]] = bits.T.astype(bool)
    return out


def _or_sparse_table(labels: np.ndarray, n: int) -> np.ndarray:
    """uint64 [L, R, W]: entry [l, k] = bitset (W = ceil(n / 64) words) of the labels in
    positions k .. k + 2^l - 1 of labels int [R] (values < n); entries whose span passes R are
    incomplete and never read."""
    R, W = labels.size, -(-n // 64)
    L = max(1, int(R).bit_length())
    table = np.zeros((L, R, W), dtype=np.uint64)
    table[0, np.arange(R), labels // 64] = np.left_shift(np.uint64(1), (labels % 64).astype(np.uint64))
    for lvl in range(1, L):
        half = 1 << (lvl - 1)
        table[lvl, : R - half] = table[lvl - 1, : R - half] | table[lvl - 1, half:]
    return table


def block_lists(blocks_QK: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``create_block_mask``'s ordered lists of a block matrix: (num int32 [n_q], indices int32
    [n_q, n_kv]), each row's set blocks first in ascending order, then the rest ascending."""
    num = blocks_QK.sum(axis=1, dtype=np.int32)
    indices = np.argsort(~blocks_QK, axis=1, kind="stable").astype(np.int32)
    return num, indices


def host_block_mask(
    tree_pre: np.ndarray,
    tree_end: np.ndarray,
    mask_mod: Callable[..., torch.Tensor],
    device: torch.device,
    block_size: int | tuple[int, int] = _DEFAULT_BLOCK,
):  # noqa: ANN201 - torch's BlockMask, imported lazily
    """FlexAttention ``BlockMask`` of the tree mask over P = len(tree_pre) rows, built on the host.

    Args:
        tree_pre, tree_end: int [P] host arrays (``tree_block_classes``).
        mask_mod: the mask as FlexAttention evaluates it on partial blocks (device tensors).
        device: where the block lists go; uploaded non-blocking from fresh host tensors, so
            building the mask never waits for the device.
        block_size: rows per block, one number for both sides or (q rows, kv rows).

    Returns:
        BlockMask with kv lists [1, 1, n_q] / [1, 1, n_q, n_kv] and the q-side (backward) lists
        [1, 1, n_kv] / [1, 1, n_kv, n_q] that ``BlockMask.from_kv_blocks`` would derive, computed
        here instead of on the device.
    """
    from torch.nn.attention.flex_attention import BlockMask

    partial, full = tree_block_classes(tree_pre, tree_end, block_size)
    lists = [*block_lists(partial), *block_lists(full), *block_lists(partial.T), *block_lists(full.T)]
    up = [upload(x[None, None], device) for x in lists]
    P = len(tree_pre)
    return BlockMask(
        seq_lengths=(P, P),
        kv_num_blocks=up[0],
        kv_indices=up[1],
        full_kv_num_blocks=up[2],
        full_kv_indices=up[3],
        q_num_blocks=up[4],
        q_indices=up[5],
        full_q_num_blocks=up[6],
        full_q_indices=up[7],
        BLOCK_SIZE=_block_pair(block_size),
        mask_mod=mask_mod,
    )
