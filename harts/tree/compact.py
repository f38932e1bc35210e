"""Prefix compaction: RolloutBatch -> CompactBatch (paper §2.1, §3.1, §3.2).

Two semantic positions share a compact row iff their trajectories have identical token
prefixes up to and including that position, across trees too. Compact rows are numbered
in preorder of the token trie with children in token order, so every segment (maximal
fork-free path) is a contiguous row range and a parent row always precedes its children.

Algorithm (general input): stable lexicographic sort of the trajectories, adjacent LCPs,
then trie construction in one pass over the sorted order: trajectory k shares its first
``adj_lcp[k]`` rows with trajectory k-1 and appends fresh rows for the rest, O(S).
Explicit rollout trees (``RolloutBatch.from_tree``) build the same trie from node spans
without comparing token sequences, provided siblings (and roots) start with distinct
tokens; otherwise they take the general path so the result is identical either way.

Shapes (S = semantic positions, C = compact rows, N = trajectories):
    tokens               int64 [C]   token id of each compact row
    semantic_to_compact  int64 [S]   m: S -> C, original batch order
    multiplicity         int64 [C]   q_c = |m^-1(c)|, sums to S
    parent               int64 [C]   parent row, -1 for a first token
    position             int64 [C]   index within its trajectories (RoPE position id)
    row_segment          int64 [C]   segment of each row
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from harts.tree.batch import RolloutBatch
from harts.tree.lcp import LCPIndex
from harts.tree.rollout_tree import RolloutTree
from harts.tree.segments import SegmentForest, parent_depth, segments_from_nodes, segments_from_rows

__all__ = ["CompactBatch", "PrefixIndex", "compact", "prefix_index", "lexicographic_order", "adjacent_lcp"]


@dataclass(frozen=True, eq=False)
class PrefixIndex:
    """A batch and the LCP index of its lexicographically sorted trajectories: everything the step
    planner reads (compact work of any subset, Eq. 5) and enough to compact any subset
    (``select``), without the trie of the whole batch (``prefix_index`` builds it in O(N) token
    comparisons, or from an explicit tree's nodes; ``compact`` also writes the S- and C-sized
    arrays)."""

    batch: RolloutBatch
    lcp_index: LCPIndex

    @property
    def num_trajectories(self) -> int:
        return self.batch.num_trajectories

    @property
    def num_compact_tokens(self) -> int:
        """C of the whole batch, from the LCP index."""
        return int(self.lcp_index.total_work())

    def select(self, indices: Sequence[int] | np.ndarray) -> CompactBatch:
        """``compact(self.batch.select(indices))`` from the LCP index (tested equal).

        Compaction's cost is the lexicographic sort and the adjacent LCPs (token comparisons);
        for a subset both follow from this batch's LCP index (sorted positions, range-minimum
        LCPs), so only the O(S_sub) trie construction runs.
        """
        idx = np.asarray(indices, dtype=np.int64)
        sub = self.batch.select(idx)  # validates the indices
        # sorted order of the subset: by this batch's sorted position, identical trajectories
        # (one class) by their index in the subset, as a stable sort of the subset would
        lcp = self.lcp_index
        new_class = np.ones(self.num_trajectories, dtype=bool)
        new_class[1:] = (lcp.adj_lcp[1:] != lcp.sorted_len[1:]) | (lcp.sorted_len[1:] != lcp.sorted_len[:-1])
        cls = np.cumsum(new_class)[lcp.rank[idx]]
        order = np.lexsort((np.arange(idx.size), cls))
        r = lcp.rank[idx[order]]
        adj = np.zeros(idx.size, dtype=np.int64)
        if idx.size > 1:
            lo, hi = np.minimum(r[:-1], r[1:]), np.maximum(r[:-1], r[1:])
            adj[1:] = lcp.sorted_len[lo]  # one trajectory selected twice: its whole length
            two = lo < hi
            adj[1:][two] = lcp.range_min(lo[two] + 1, hi[two] + 1)
        return _compact_sorted(sub, order, adj)


@dataclass(frozen=True, eq=False)
class CompactBatch:
    """A batch after prefix compaction; see the module docstring for shapes."""

    batch: RolloutBatch
    tokens: np.ndarray
    semantic_to_compact: np.ndarray
    multiplicity: np.ndarray
    parent: np.ndarray
    position: np.ndarray
    row_segment: np.ndarray
    segment_trees: SegmentForest
    lcp_index: LCPIndex

    @property
    def num_compact_tokens(self) -> int:
        """C: unique prefix-shared token rows (compact-token work of the whole batch)."""
        return int(self.tokens.size)

    @property
    def num_semantic_tokens(self) -> int:
        """S: semantic positions (raw tokens of every trajectory)."""
        return self.batch.num_tokens

    @property
    def num_trajectories(self) -> int:
        return self.batch.num_trajectories

    @property
    def traj_offsets(self) -> np.ndarray:
        """int64 [N + 1]: trajectory j owns semantic positions [offsets[j], offsets[j+1])."""
        return self.batch.offsets

    @property
    def compression(self) -> float:
        """S / C: non-replay compact-row compression."""
        return self.num_semantic_tokens / self.num_compact_tokens

    @property
    def prefix_index(self) -> PrefixIndex:
        """The batch with its LCP index: what planning and ``select`` need of a compaction."""
        return PrefixIndex(self.batch, self.lcp_index)

    def select(self, indices: Sequence[int] | np.ndarray) -> CompactBatch:
        """``compact(self.batch.select(indices))`` without compacting again (``PrefixIndex.select``)."""
        return self.prefix_index.select(indices)

    def __repr__(self) -> str:
        f = self.segment_trees
        return (
            f"CompactBatch(trajectories={self.num_trajectories}, S={self.num_semantic_tokens}, "
            f"C={self.num_compact_tokens}, compression={self.compression:.2f}x, "
            f"trees={f.num_trees}, segments={f.num_segments})"
        )


def lexicographic_order(batch: RolloutBatch) -> np.ndarray:
    """int64 [N]: trajectory indices in stable lexicographic token order.

    Token ids are non-negative, so big-endian fixed-width bytes compare exactly like the
    token sequences (a proper prefix sorts first) and ``sorted`` runs on memcmp.
    """
    width = ">u4" if batch.num_tokens == 0 or int(batch.tokens.max()) < 2**32 else ">u8"
    keys = [t.astype(width).tobytes() for t in batch.trajectories()]
    return np.array(sorted(range(len(keys)), key=keys.__getitem__), dtype=np.int64)


def _first_mismatch(a: np.ndarray, b: np.ndarray) -> int:
    n = min(a.size, b.size)
    # compare in growing blocks: forks are usually early relative to long trajectories
    lo = 0
    block = 256
    while lo < n:
        hi = min(n, lo + block)
        neq = np.flatnonzero(a[lo:hi] != b[lo:hi])
        if neq.size:
            return lo + int(neq[0])
        lo = hi
        block *= 4
    return n


def adjacent_lcp(seqs: list[np.ndarray]) -> np.ndarray:
    """int64 [N]: LCP of each sequence with the one before it (0 for the first)."""
    out = np.zeros(len(seqs), dtype=np.int64)
    for k in range(1, len(seqs)):
        out[k] = _first_mismatch(seqs[k - 1], seqs[k])
    return out


def compact(batch: RolloutBatch) -> CompactBatch:
    """Compact a rollout batch into unique prefix-shared rows (see module docstring)."""
    if batch.tree is not None and _tree_is_canonical(batch):
        return _compact_from_tree(batch)
    return _compact_sorted(batch)


def prefix_index(batch: RolloutBatch) -> PrefixIndex:
    """The batch's ``PrefixIndex`` (the same LCP index as ``compact(batch).lcp_index``) without
    building the trie: a canonical explicit tree gives it from its nodes (``_tree_lcp_index``),
    other input from the lexicographic sort and adjacent LCPs of the token sequences."""
    tree = batch.tree
    if tree is not None and _tree_is_canonical(batch):
        return PrefixIndex(
            batch, _tree_lcp_index(tree, batch.lengths, _node_preorder(tree), _node_start(tree), tree.leaf_paths())
        )
    return PrefixIndex(batch, _sorted_lcp_index(batch))


def _sorted_lcp_index(batch: RolloutBatch) -> LCPIndex:
    """The LCP index by sorting the token sequences (any input)."""
    trajs = batch.trajectories()
    order = lexicographic_order(batch)
    return LCPIndex(order, batch.lengths, adjacent_lcp([trajs[j] for j in order]))


def _tree_lcp_index(
    tree: RolloutTree, lengths: np.ndarray, node_order: np.ndarray, node_start: np.ndarray, paths: list[np.ndarray]
) -> LCPIndex:
    """The LCP index of a canonical tree's trajectories (lengths ``lengths``, root-to-leaf node paths
    ``paths``) from its nodes alone, given their trie preorder ``_node_preorder`` and ``_node_start``.

    With children in first-token order, the trie's preorder of the leaves is the lexicographic
    order (no leaf prefixes another). Two adjacent leaves' token sequences agree exactly up to
    the end of their deepest common node: below it their paths enter siblings, whose first
    tokens differ (canonical), and distinct roots differ at the first token."""
    leaf_rank = np.empty(tree.num_nodes, dtype=np.int64)
    leaf_rank[node_order] = np.arange(tree.num_nodes)
    order = np.argsort(leaf_rank[tree.leaves], kind="stable")
    node_end = node_start + np.diff(tree.offsets)
    lcp = np.zeros(order.size, dtype=np.int64)
    for k in range(1, order.size):
        a, b = paths[order[k - 1]], paths[order[k]]
        n = min(a.size, b.size)
        differ = np.flatnonzero(a[:n] != b[:n])
        common = int(differ[0]) if differ.size else n
        if common:
            lcp[k] = node_end[a[common - 1]]
    return LCPIndex(order, lengths, lcp)


def _node_start(tree: RolloutTree) -> np.ndarray:
    """int64 [nodes]: the position of each node's first token in its trajectories (the summed
    lengths of its ancestors)."""
    node_len = np.diff(tree.offsets)
    return parent_depth(tree.parent, node_len[np.maximum(tree.parent, 0)])


def _node_preorder(tree: RolloutTree) -> np.ndarray:
    """int64 [nodes]: the tree's nodes in the trie's preorder (roots and children by first token)."""
    first = tree.tokens[tree.offsets[:-1]]
    kids: list[list[int]] = [[] for _ in range(tree.num_nodes)]
    for v in np.lexsort((first, tree.parent)):
        p = int(tree.parent[v])
        if p >= 0:
            kids[p].append(int(v))
    roots = sorted(tree.roots.tolist(), key=lambda r: first[r])
    visit: list[int] = []
    stack = roots[::-1]
    while stack:
        u = stack.pop()
        visit.append(u)
        stack.extend(reversed(kids[u]))
    return np.asarray(visit, dtype=np.int64)


def _compact_sorted(
    batch: RolloutBatch, order: np.ndarray | None = None, lcp: np.ndarray | None = None
) -> CompactBatch:
    """The trie from the stable lexicographic ``order`` int64 [N] and the adjacent LCPs
    ``lcp`` int64 [N] of the sorted trajectories (computed here when not given)."""
    n = batch.num_trajectories
    lengths = batch.lengths
    if order is None:
        index = _sorted_lcp_index(batch)
        order, lcp = index.order, index.adj_lcp
    assert lcp is not None
    sorted_len = lengths[order]
    fresh = sorted_len - lcp  # rows each sorted trajectory adds
    row_start = np.zeros(n, dtype=np.int64)
    np.cumsum(fresh[:-1], out=row_start[1:])
    c = int(fresh.sum())

    m = np.empty(batch.num_tokens, dtype=np.int64)
    first_parent = np.full(n, -1, dtype=np.int64)
    prev = m[:0]
    for k in range(n):
        j = order[k]
        dst = m[batch.offsets[j] : batch.offsets[j + 1]]
        l = int(lcp[k])
        if l:
            dst[:l] = prev[:l]
            first_parent[k] = prev[l - 1]
        dst[l:] = np.arange(row_start[k], row_start[k] + fresh[k])
        prev = dst

    # rows of sorted trajectory k: positions lcp[k]..len-1, tokens from its own span
    run = np.repeat(np.arange(n), fresh)
    within = np.arange(c) - row_start[run]
    position = lcp[run] + within
    tokens = batch.tokens[batch.offsets[order][run] + position]
    parent = np.arange(c, dtype=np.int64) - 1
    has_rows = fresh > 0
    parent[row_start[has_rows]] = first_parent[has_rows]
    return _finish(batch, tokens, m, parent, position, LCPIndex(order, lengths, lcp))


def _tree_is_canonical(batch: RolloutBatch) -> bool:
    """True when the tree's structure equals the token trie's (distinct sibling first tokens)."""
    tree = batch.tree
    assert tree is not None
    first = tree.tokens[tree.offsets[:-1]]
    key = np.stack([tree.parent, first], axis=1)
    return np.unique(key, axis=0).shape[0] == tree.num_nodes


def _compact_from_tree(batch: RolloutBatch) -> CompactBatch:
    tree = batch.tree
    assert tree is not None
    nn = tree.num_nodes
    node_len = np.diff(tree.offsets)
    # children sorted by first token: preorder of nodes == preorder of the token trie
    node_order = _node_preorder(tree)
    node_row = np.empty(nn, dtype=np.int64)
    lens_in_order = node_len[node_order]
    starts = np.zeros(nn, dtype=np.int64)
    np.cumsum(lens_in_order[:-1], out=starts[1:])
    node_row[node_order] = starts
    c = int(node_len.sum())

    node_pos = _node_start(tree)
    run = np.repeat(node_order, lens_in_order)
    within = np.arange(c) - node_row[run]
    position = node_pos[run] + within
    tokens = tree.tokens[tree.offsets[run] + within]
    parent = np.arange(c, dtype=np.int64) - 1
    pn = tree.parent[node_order]
    parent[starts] = np.where(pn >= 0, node_row[np.maximum(pn, 0)] + node_len[np.maximum(pn, 0)] - 1, -1)

    paths = tree.leaf_paths()
    m = _semantic_rows(paths, node_len, node_row, batch.num_tokens)
    segments = segments_from_nodes(tree.parent, node_order, node_row, node_len, node_pos, c)
    lcp_index = _tree_lcp_index(tree, batch.lengths, node_order, node_pos, paths)
    return _finish(batch, tokens, m, parent, position, lcp_index, segments)


def _semantic_rows(paths: list[np.ndarray], node_len: np.ndarray, node_row: np.ndarray, s: int) -> np.ndarray:
    """int64 [S]: the compact row of every semantic token, trajectory j's tokens being its root-to-leaf
    ``paths[j]`` (node indices) laid end to end in trajectory order.

    Each (trajectory, node) pair is a run of consecutive rows starting at ``node_row[node]``, so
    ``m`` is a cumulative sum of ones with a jump at every pair's first token: one pass over S
    instead of a per-trajectory arange / repeat / subtract."""
    pair_node = np.concatenate(paths) if paths else np.zeros(0, dtype=np.int64)
    pair_len = node_len[pair_node]
    first = node_row[pair_node]
    pair_start = np.zeros(pair_node.size, dtype=np.int64)
    np.cumsum(pair_len[:-1], out=pair_start[1:])
    step = np.ones(s, dtype=np.int64)
    if pair_node.size:
        # the row a pair starts at, minus the row the run before it ended on
        step[pair_start[0]] = first[0]
        step[pair_start[1:]] = first[1:] - (first[:-1] + pair_len[:-1] - 1)
    return np.cumsum(step, out=step)


def _finish(
    batch: RolloutBatch,
    tokens: np.ndarray,
    m: np.ndarray,
    parent: np.ndarray,
    position: np.ndarray,
    lcp_index: LCPIndex,
    segments: tuple[SegmentForest, np.ndarray] | None = None,
) -> CompactBatch:
    """The batch from its rows; ``segments``: ``segments_from_rows(parent, position)`` where the
    caller has it more cheaply (the tree path)."""
    c = tokens.size
    forest, row_segment = segments if segments is not None else segments_from_rows(parent, position)
    return CompactBatch(
        batch=batch,
        tokens=tokens.astype(np.int64, copy=False),
        semantic_to_compact=m,
        multiplicity=np.bincount(m, minlength=c).astype(np.int64),
        parent=parent,
        position=position.astype(np.int64, copy=False),
        row_segment=row_segment,
        segment_trees=forest,
        lcp_index=lcp_index,
    )
