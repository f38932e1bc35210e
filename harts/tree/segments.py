"""Segment forests: maximal fork-free token paths of rollout trees (paper §3.3).

A segment v covers positions ``[start[v], end[v])`` of every trajectory through it and,
in a compact batch, the contiguous compact rows ``[row[v], row[v] + end[v] - start[v])``.
Segments are numbered in preorder (a parent's id is smaller than its children's; one
tree's segments are contiguous) and ``children(v)`` lists children in their fixed order.

Shapes (V = segments, E = V - num_trees child edges):
    start, end, parent, row, tree   int64 [V]
    child_ptr                       int64 [V + 1]   CSR over ``child_idx``
    child_idx                       int64 [E]
    roots                           int64 [num_trees]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["SegmentForest", "parent_depth", "preorder_from_parents", "segments_from_nodes", "segments_from_rows"]


def parent_depth(parent: np.ndarray, weight: np.ndarray | None = None) -> np.ndarray:
    """int64 [N]: depth of every node of a parent-pointer forest (-1 = root), by pointer doubling.

    ``parent`` int [N] in any order (no preorder needed); ``weight`` int64 [N] is the length
    of each node's edge to its parent (default 1; ignored on roots). O(N log depth). Raises
    ``ValueError`` if the parent links contain a cycle.
    """
    jump = np.asarray(parent).astype(np.int64, copy=True)
    has = jump >= 0
    depth = has.astype(np.int64) if weight is None else np.where(has, weight, 0).astype(np.int64)
    active = np.flatnonzero(has)
    for _ in range(jump.size.bit_length() + 1):  # a depth below 2**k is final after k steps
        if not active.size:
            return depth
        j = jump[active]
        # right-hand sides are read before the writes: a simultaneous (Jacobi) doubling step
        depth[active] += depth[j]
        jump[active] = jump[j]
        active = active[jump[active] >= 0]
    if active.size:
        raise ValueError("parent links contain a cycle")
    return depth


def preorder_from_parents(parent: np.ndarray) -> np.ndarray:
    """int64 [N]: preorder permutation of a parent-pointer forest (-1 = root, any order);
    trees and siblings keep id order. O(N) array work per level."""
    # preorder = lexicographic order of root paths: sort by (tree, path ids) is costly; use
    # subtree sizes + first-child offsets instead, computed level by level
    v = parent.size
    depth = parent_depth(parent)
    size = np.ones(v, dtype=np.int64)
    for d in range(int(depth.max()), 0, -1):
        nodes = np.flatnonzero(depth == d)
        np.add.at(size, parent[nodes], size[nodes])
    pos = np.zeros(v, dtype=np.int64)
    roots = np.flatnonzero(parent < 0)
    pos[roots] = np.cumsum(size[roots]) - size[roots]
    for d in range(1, int(depth.max()) + 1):
        nodes = np.flatnonzero(depth == d)  # ascending ids: siblings in id order
        p = parent[nodes]
        # offset of each node among its siblings = exclusive cumsum of sizes within parent
        o = np.argsort(p, kind="stable")
        sp, sz = p[o], size[nodes][o]
        cs = np.cumsum(sz) - sz
        first = np.searchsorted(sp, sp)  # first index of each parent group
        within = cs - cs[first]
        pos[nodes[o]] = pos[sp] + 1 + within
    return np.argsort(pos)


@dataclass(frozen=True, eq=False)
class SegmentForest:
    start: np.ndarray
    end: np.ndarray
    parent: np.ndarray
    row: np.ndarray
    tree: np.ndarray
    child_ptr: np.ndarray
    child_idx: np.ndarray
    roots: np.ndarray
    #: optional display names (one per segment), e.g. from a ``harts calls`` tree file
    names: list[str] | None = None

    @property
    def num_segments(self) -> int:
        return int(self.start.size)

    @property
    def num_trees(self) -> int:
        return int(self.roots.size)

    def __len__(self) -> int:
        return self.num_trees

    @property
    def length(self) -> np.ndarray:
        """int64 [V]: tokens per segment."""
        return self.end - self.start

    def children(self, v: int) -> np.ndarray:
        return self.child_idx[self.child_ptr[v] : self.child_ptr[v + 1]]

    @property
    def num_children(self) -> np.ndarray:
        return np.diff(self.child_ptr)

    def name(self, v: int) -> str:
        return self.names[v] if self.names is not None else f"s{v}"

    def tree_segments(self, t: int) -> np.ndarray:
        """Segment ids of tree t (a contiguous preorder range)."""
        lo = int(self.roots[t])
        hi = int(self.roots[t + 1]) if t + 1 < self.num_trees else self.num_segments
        return np.arange(lo, hi)

    def depth(self) -> np.ndarray:
        """int64 [V]: segment-tree depth (root 0); counts state handoffs on the way down.

        Chains are contracted first: among internal segments in preorder, a segment whose
        parent is the previous internal segment extends a chain (a caterpillar's spine is one
        chain), so its depth is an offset from the chain's first segment; weighted pointer
        doubling then runs over chain starts only. Leaves take their parent's depth + 1.
        """
        v = self.num_segments
        parent = self.parent
        ids = np.flatnonzero(np.diff(self.child_ptr) > 0)
        n = ids.size
        rank = np.full(v, -1, dtype=np.int64)
        rank[ids] = np.arange(n)
        par = parent[ids]
        prank = np.where(par >= 0, rank[np.maximum(par, 0)], -1)  # a non-root's parent is internal
        idx = np.arange(n, dtype=np.int64)
        first = (prank != idx - 1) | (prank < 0)
        run = np.maximum.accumulate(np.where(first, idx, 0))  # chain start of each internal rank
        starts = np.flatnonzero(first)
        sp = prank[starts]
        has = sp >= 0
        # depth(start) = depth(run(sp)) + (sp - run(sp)) + 1: a weighted parent pointer over starts
        pos = np.full(n, -1, dtype=np.int64)
        pos[starts] = np.arange(starts.size)
        jump = np.where(has, pos[run[np.maximum(sp, 0)]], -1)
        dep = parent_depth(jump, weight=np.where(has, sp - run[np.maximum(sp, 0)] + 1, 0))
        depth = np.zeros(v, dtype=np.int64)
        depth[ids] = dep[pos[run]] + idx - run
        leaf = np.flatnonzero((rank < 0) & (parent >= 0))
        depth[leaf] = depth[parent[leaf]] + 1
        return depth

    def subtree_end_rows(self) -> np.ndarray:
        """int64 [V]: one past the last compact row of each segment's subtree (preorder rows)."""
        nch = self.num_children
        # last descendant in preorder = last child's last descendant: pointer doubling
        last = np.arange(self.num_segments)
        last[nch > 0] = self.child_idx[self.child_ptr[1:][nch > 0] - 1]
        while True:
            nxt = last[last]
            if np.array_equal(nxt, last):
                break
            last = nxt
        return self.row[last] + self.length[last]

    @classmethod
    def from_parents(
        cls,
        lengths: Sequence[int] | np.ndarray,
        parents: Sequence[int] | np.ndarray,
        names: Sequence[str] | None = None,
    ) -> tuple[SegmentForest, np.ndarray]:
        """Build a forest from per-segment token counts and parent indices (-1 = root).

        Input order is the fixed child order. Returns the forest (renumbered into
        preorder) and ``new_id`` int64 [V], the preorder id of each input segment.
        Validation (positive lengths, parents in range, no cycles) is the caller's job
        for user input; here it is asserted.
        """
        lengths = np.asarray(lengths, dtype=np.int64)
        parents = np.asarray(parents, dtype=np.int64)
        v = lengths.size
        assert parents.shape == (v,) and np.all(lengths > 0)
        kids: list[list[int]] = [[] for _ in range(v)]
        roots_in: list[int] = []
        for i in range(v):
            p = int(parents[i])
            (roots_in if p < 0 else kids[p]).append(i)
        order = np.empty(v, dtype=np.int64)
        k = 0
        for r in roots_in:
            stack = [r]
            while stack:
                u = stack.pop()
                order[k] = u
                k += 1
                stack.extend(reversed(kids[u]))
        assert k == v, "segment parents contain a cycle"
        new_id = np.empty(v, dtype=np.int64)
        new_id[order] = np.arange(v)
        par = np.where(parents[order] >= 0, new_id[np.maximum(parents[order], 0)], -1)
        length = lengths[order]
        start = np.zeros(v, dtype=np.int64)
        for u in range(v):
            if par[u] >= 0:
                start[u] = start[par[u]] + length[par[u]]
        row = np.zeros(v, dtype=np.int64)
        np.cumsum(length[:-1], out=row[1:])
        forest = _assemble(start, start + length, par, row)
        if names is not None:
            forest = SegmentForest(**{**forest.__dict__, "names": [str(names[int(i)]) for i in order]})
        return forest, new_id


def _assemble(start: np.ndarray, end: np.ndarray, parent: np.ndarray, row: np.ndarray) -> SegmentForest:
    v = start.size
    is_root = parent < 0
    tree = np.cumsum(is_root) - 1
    nonroot = np.flatnonzero(~is_root)
    # preorder ids: a stable sort by parent keeps the fixed child order
    child_idx = nonroot[np.argsort(parent[nonroot], kind="stable")]
    counts = np.bincount(parent[nonroot], minlength=v)
    child_ptr = np.zeros(v + 1, dtype=np.int64)
    np.cumsum(counts, out=child_ptr[1:])
    return SegmentForest(
        start=start.astype(np.int64),
        end=end.astype(np.int64),
        parent=parent.astype(np.int64),
        row=row.astype(np.int64),
        tree=tree.astype(np.int64),
        child_ptr=child_ptr,
        child_idx=child_idx.astype(np.int64),
        roots=np.flatnonzero(is_root).astype(np.int64),
    )


def segments_from_rows(parent_row: np.ndarray, position: np.ndarray) -> tuple[SegmentForest, np.ndarray]:
    """Segments of a compact trie whose rows are numbered in preorder.

    ``parent_row`` int64 [C] (-1 for a root row) and ``position`` int64 [C] describe the
    trie. A row starts a segment iff it is a root or its parent has two or more children;
    in preorder a single child directly follows its parent, so segments are contiguous.
    Returns the forest and ``row_segment`` int64 [C].
    """
    c = parent_row.size
    has_parent = parent_row >= 0
    nchild = np.bincount(parent_row[has_parent], minlength=c)
    starts = ~has_parent
    starts[has_parent] = nchild[parent_row[has_parent]] >= 2
    row_segment = np.cumsum(starts) - 1
    seg_row = np.flatnonzero(starts)
    seg_len = np.diff(np.append(seg_row, c))
    seg_start = position[seg_row]
    p = parent_row[seg_row]
    seg_parent = np.where(p >= 0, row_segment[np.maximum(p, 0)], -1)
    return _assemble(seg_start, seg_start + seg_len, seg_parent, seg_row), row_segment.astype(np.int64)


def segments_from_nodes(
    tree_parent: np.ndarray,
    node_order: np.ndarray,
    node_row: np.ndarray,
    node_len: np.ndarray,
    node_pos: np.ndarray,
    c: int,
) -> tuple[SegmentForest, np.ndarray]:
    """``segments_from_rows`` of the trie whose rows are the tree's (non-empty) nodes laid out in
    preorder ``node_order`` (node v: rows ``node_row[v]`` .. + ``node_len[v]``, first position
    ``node_pos[v]``), from the nodes alone: a node starts a segment iff it is a root or its parent
    node has two or more children (a node's inner rows have one child each, its last row the
    node's children). The same arrays as ``segments_from_rows``, without its passes over C rows."""
    parent_o = tree_parent[node_order]
    nkids = np.bincount(tree_parent[tree_parent >= 0], minlength=tree_parent.size)
    starts_o = (parent_o < 0) | (nkids[np.maximum(parent_o, 0)] >= 2)
    seg_of_node = np.empty(node_order.size, dtype=np.int64)
    seg_of_node[node_order] = np.cumsum(starts_o) - 1
    row_segment = np.repeat(seg_of_node[node_order], node_len[node_order])
    seg_nodes = node_order[starts_o]
    seg_row = node_row[seg_nodes]
    seg_len = np.diff(np.append(seg_row, c))
    seg_start = node_pos[seg_nodes]
    p = tree_parent[seg_nodes]
    seg_parent = np.where(p >= 0, seg_of_node[np.maximum(p, 0)], -1)
    return _assemble(seg_start, seg_start + seg_len, seg_parent, seg_row), row_segment
