"""The one set of random-tree generators and hypothesis strategies of the test suite.

Segment forests (Algorithm 1, layout): ``random_forest_lists`` / ``spine_forest`` give
(lengths, parents) with forks at kB-1, kB, kB+1 and inside chunks, ``forests`` draws a
``SegmentForest``, ``batch_from_forest`` / ``compact_batches`` turn one into token trajectories.
Token trajectories (compaction, planner, models): ``trajectory_lists`` (small alphabets,
duplicates and prefixes), ``random_forest_batch`` (paths forked off earlier paths of a few
trees), ``tree_trajectories`` with ``TreeBuilder`` (forks at exact positions). Explicit trees:
``rollout_trees``. Torch-side row forests for the ops tests live in ``tests/ops/_trees.py``.
"""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

import harts
from harts.tree.batch import RolloutBatch
from harts.tree.compact import compact
from harts.tree.segments import SegmentForest


# ------------------------------------------------------------ segment forests
def end_candidates(start: int, b: int) -> list[int]:
    """Fork positions around the next chunk boundaries (kB-1, kB, kB+1) and inside the chunk."""
    k0 = start // b
    cands = {k * b + o for k in range(k0, k0 + 3) for o in (-1, 0, 1)}
    cands |= {start + 1, start + 2, start + 2 * b + 3}
    return sorted(c for c in cands if c > start)


def random_forest_lists(
    rng: np.random.Generator, b: int, max_segments: int = 10, max_fanout: int = 6, max_trees: int = 3
) -> tuple[list[int], list[int]]:
    """(lengths, parents) of a random forest with fork positions near chunk boundaries."""
    lengths: list[int] = []
    parents: list[int] = []
    ends: list[int] = []
    n_trees = int(rng.integers(1, max_trees + 1))
    for _ in range(n_trees):
        queue = [(-1, 0)]
        while queue and len(lengths) < max_segments:
            par, start = queue.pop(0)
            end = int(rng.choice(end_candidates(start, b)))
            me = len(lengths)
            lengths.append(end - start)
            parents.append(par)
            ends.append(end)
            room = max_segments - len(lengths) - len(queue)
            fan = int(rng.choice([0, 0, 1, 2, 2, 3, 4, 5, 6]))
            fan = min(fan, max_fanout, max(room, 0))
            queue.extend((me, end) for _ in range(fan))
    return lengths, parents


def spine_forest(rng: np.random.Generator, b: int, max_spine: int = 40) -> tuple[list[int], list[int]]:
    """Caterpillar-like trees: long spines whose forks carry 0-3 leaves before and/or after
    the continuing child, fork ends at kB-1, kB, kB+1 or inside a chunk, and now and then a
    fork with two internal children (a nested caterpillar) or a leaf-only fork."""
    lengths: list[int] = []
    parents: list[int] = []
    ends: list[int] = []

    def add(par: int, start: int) -> int:
        end = int(rng.choice(end_candidates(start, b)))
        lengths.append(end - start)
        parents.append(par)
        ends.append(end)
        return len(lengths) - 1

    def spine(par: int, start: int, n: int) -> None:
        u = add(par, start)
        for i in range(n):
            before, after = int(rng.integers(0, 3)), int(rng.integers(0, 2))
            for _ in range(before):
                add(u, ends[u])
            if i > 0 and rng.random() < 0.1:  # a second internal child: a short nested spine
                spine(u, ends[u], int(rng.integers(1, 4)))
            nxt = add(u, ends[u])
            for _ in range(after):
                add(u, ends[u])
            u = nxt
        for _ in range(int(rng.integers(0, 3))):  # the spine ends in a leaf-only fork or a leaf
            add(u, ends[u])

    for _ in range(int(rng.integers(1, 3))):
        spine(-1, 0, int(rng.integers(1, max_spine)))
    return lengths, parents


@st.composite
def forests(draw, max_segments: int = 10, max_fanout: int = 6, max_trees: int = 3):
    """(forest, B): small forests whose forks sit at kB-1, kB, kB+1 and inside chunks."""
    b = draw(st.sampled_from([2, 4, 8, 64]))
    seed = draw(st.integers(0, 2**32 - 1))
    lengths, parents = random_forest_lists(np.random.default_rng(seed), b, max_segments, max_fanout, max_trees)
    forest, _ = SegmentForest.from_parents(lengths, parents)
    return forest, b


def batch_from_forest(rng: np.random.Generator, lengths: list[int], parents: list[int]) -> harts.RolloutBatch:
    """One trajectory per leaf (plus a few prefixes and duplicates); siblings and roots start
    with distinct tokens so the trie keeps the forest's forks."""
    n = len(lengths)
    kids: list[list[int]] = [[] for _ in range(n)]
    roots = []
    for i, p in enumerate(parents):
        (roots if p < 0 else kids[p]).append(i)
    toks: list[np.ndarray] = [np.zeros(0, np.int64)] * n
    for rank, r in enumerate(roots):
        toks[r] = np.concatenate([[50 + rank], rng.integers(0, 3, lengths[r] - 1)])
    for i in range(n):
        for rank, c in enumerate(kids[i]):
            toks[c] = np.concatenate([[10 + rank], rng.integers(0, 3, lengths[c] - 1)])
    trajs = []

    def path(v: int) -> np.ndarray:
        parts = []
        while v >= 0:
            parts.append(toks[v])
            v = parents[v]
        return np.concatenate(parts[::-1])

    for v in range(n):
        if not kids[v]:
            trajs.append(path(v))
    for t in list(trajs[:3]):
        trajs.append(t[: int(rng.integers(1, t.size + 1))])  # a prefix trajectory
        trajs.append(t.copy())  # a duplicate
    order = rng.permutation(len(trajs))
    return harts.RolloutBatch.from_trajectories([trajs[i] for i in order])


@st.composite
def compact_batches(draw, max_segments: int = 14):
    b = draw(st.sampled_from([2, 4, 8]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    lengths, parents = random_forest_lists(rng, b, max_segments=max_segments, max_fanout=6, max_trees=3)
    return compact(batch_from_forest(rng, lengths, parents)), b


# ------------------------------------------------------------ token trajectories
@st.composite
def trajectory_lists(draw, max_traj: int = 10, alphabet: int = 3) -> list[list[int]]:
    """Small alphabets force sharing; duplicates and prefixes are drawn on purpose."""
    tok = st.integers(0, alphabet - 1)
    base = draw(st.lists(st.lists(tok, min_size=1, max_size=12), min_size=1, max_size=max_traj))
    out = list(base)
    for t in base:
        action = draw(st.sampled_from(["keep", "dup", "prefix", "extend"]))
        if action == "dup":
            out.append(list(t))
        elif action == "prefix":
            out.append(t[: draw(st.integers(1, len(t)))])
        elif action == "extend":
            out.append(t + draw(st.lists(tok, min_size=1, max_size=4)))
    return draw(st.permutations(out))


def random_forest_batch(
    rng: np.random.Generator,
    *,
    trees: int = 3,
    paths: int = 20,
    vocab: int = 4,
    max_seg: int = 12,
    shared_root: int = 0,
) -> RolloutBatch:
    """``paths`` trajectories drawn from ``trees`` random prefix trees.

    Each new path copies a prefix of an earlier path of its tree (a fork) and appends a
    fresh random suffix; ``shared_root`` tokens common to every tree mimic a system prompt.
    Small vocabularies make accidental cross-tree sharing and duplicates likely.
    """
    root = rng.integers(0, vocab, shared_root).tolist()
    by_tree: list[list[list[int]]] = [[] for _ in range(trees)]
    out: list[list[int]] = []
    tree_ids = []
    for _ in range(paths):
        t = int(rng.integers(trees))
        if by_tree[t] and rng.random() < 0.85:
            base = by_tree[t][int(rng.integers(len(by_tree[t])))]
            keep = int(rng.integers(0, len(base) + 1))
            path = base[:keep]
        else:
            path = root + [t + vocab]
        path = path + rng.integers(0, vocab, int(rng.integers(0 if path else 1, max_seg + 1))).tolist()
        if not path:
            path = [0]
        by_tree[t].append(path)
        out.append(path)
        tree_ids.append(t)
    return RolloutBatch.from_trajectories(out, tree_ids=tree_ids)


class TreeBuilder:
    def __init__(self, vocab: int, seed: int) -> None:
        self.vocab = vocab
        self.rng = np.random.default_rng(seed)

    def fresh(self, n: int, avoid: int | None = None) -> list[int]:
        toks = self.rng.integers(0, self.vocab, n).tolist()
        if avoid is not None and n and toks[0] == avoid:
            toks[0] = (avoid + 1) % self.vocab
        return toks

    def branch(self, base: list[int], p: int, n_new: int) -> list[int]:
        assert 1 <= p <= len(base)
        return base[:p] + self.fresh(n_new, avoid=base[p] if p < len(base) else None)


@st.composite
def tree_trajectories(draw, B: int = 8):
    """Token trajectories of random trees for model tests: fresh roots and branches forking at
    any position, new segments up to ~3 chunks (chunk size ``B``)."""
    t = TreeBuilder(vocab=64, seed=draw(st.integers(0, 2**16)))
    trajs = [t.fresh(draw(st.integers(1, 3 * B + 3)))]
    for _ in range(draw(st.integers(0, 7))):
        if draw(st.booleans()):
            base = trajs[draw(st.integers(0, len(trajs) - 1))]
            p = draw(st.integers(1, len(base)))
            trajs.append(t.branch(base, p, draw(st.integers(0 if p < len(base) else 1, 2 * B + 1))))
        else:
            trajs.append(t.fresh(draw(st.integers(1, 2 * B))))
    return trajs


# ------------------------------------------------------------ explicit trees
@st.composite
def rollout_trees(draw):
    """Random explicit trees; sibling first tokens may collide (the general path then)."""
    n = draw(st.integers(1, 12))
    nodes = []
    for i in range(n):
        parent = None if i == 0 or draw(st.booleans()) and i < 3 else draw(st.integers(0, i - 1))
        toks = draw(st.lists(st.integers(0, 3), min_size=1, max_size=5))
        nodes.append({"id": f"n{i}", "parent": None if parent is None else f"n{parent}", "tokens": toks})
    return draw(st.permutations(nodes))
