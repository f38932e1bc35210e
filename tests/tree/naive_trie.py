"""An obviously-correct dict-of-children trie, the reference for compaction tests."""

from __future__ import annotations


def naive_compact(trajectories: list[list[int]]) -> dict:
    """Rows numbered in preorder with children in token order (harts' canonical numbering)."""
    root: dict = {}
    for traj in trajectories:
        node = root
        for tok in traj:
            node = node.setdefault(tok, {})
    ids: dict[int, int] = {}  # id(node dict) -> row
    tokens, parent, position = [], [], []
    stack = [(tok, child, -1, 0) for tok, child in sorted(root.items(), reverse=True)]
    while stack:
        tok, node, par, pos = stack.pop()
        row = len(tokens)
        ids[id(node)] = row
        tokens.append(tok)
        parent.append(par)
        position.append(pos)
        stack.extend((t, c, row, pos + 1) for t, c in sorted(node.items(), reverse=True))
    m = []
    for traj in trajectories:
        node = root
        for tok in traj:
            node = node[tok]
            m.append(ids[id(node)])
    q = [0] * len(tokens)
    for r in m:
        q[r] += 1
    nchild = [0] * len(tokens)
    for p in parent:
        if p >= 0:
            nchild[p] += 1
    # segments: maximal fork-free paths, as (first row, start pos, end pos, parent segment)
    seg_of = {}
    segments = []
    for row in range(len(tokens)):
        p = parent[row]
        if p < 0 or nchild[p] >= 2:
            seg_of[row] = len(segments)
            segments.append([row, position[row], position[row] + 1, -1 if p < 0 else seg_of[p]])
        else:
            seg_of[row] = seg_of[p]
            segments[seg_of[p]][2] = position[row] + 1
    return {"tokens": tokens, "parent": parent, "position": position, "m": m, "q": q, "segments": segments}


def naive_work(trajectories: list[list[int]]) -> int:
    """Compact tokens of a set of trajectories: the number of distinct non-empty prefixes."""
    return len({tuple(t[: i + 1]) for t in trajectories for i in range(len(t))})
