"""Random rollout-tree batches for planner tests (trees of shared prefixes)."""

from __future__ import annotations

import numpy as np

from harts.tree.batch import RolloutBatch


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
