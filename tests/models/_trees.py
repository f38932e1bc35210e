"""Small adversarial rollout trees for compact-vs-trajectory tests (chunk size B).

Each builder returns token lists; a branch copies ``base[:p]`` and continues with fresh
tokens whose first one differs from ``base[p]``, so the fork lies exactly at position p.
"""

from __future__ import annotations

import numpy as np

from harts.tree.batch import RolloutBatch
from tests.strategies import TreeBuilder


def batch_of(trajs: list[list[int]], seed: int = 0) -> RolloutBatch:
    """A batch with random advantages, action masks, old and ref log-probs (GRPO inputs)."""
    rng = np.random.default_rng(seed + 1)
    n = len(trajs)
    return RolloutBatch.from_trajectories(
        trajs,
        advantages=rng.normal(size=n),
        action_mask=[[i > 0 and rng.random() < 0.8 for i in range(len(t))] for t in trajs],
        old_logprobs=[rng.normal(-4.0, 0.3, len(t)) for t in trajs],
        ref_logprobs=[rng.normal(-4.0, 0.3, len(t)) for t in trajs],
    )


def tree_cases(B: int, vocab: int = 64, seed: int = 0) -> dict[str, list[list[int]]]:
    """name -> trajectories; every case named in issue 5's correctness list."""
    t = TreeBuilder(vocab, seed)
    cases: dict[str, list[list[int]]] = {}
    base = t.fresh(3 * B + 5)
    cases["forks_near_chunk_boundaries"] = [base] + [
        t.branch(base, p, n) for p, n in [(B - 1, 5), (B, B + 3), (B + 1, 2), (2 * B - 1, 7), (2 * B + 1, B)]
    ]
    base = t.fresh(3 * B)
    side = t.branch(base, 2 * B + 2, 6)
    cases["several_forks_in_one_chunk"] = [
        base,
        side,
        t.branch(base, 2 * B + 3, 4),
        t.branch(base, 2 * B + 5, 9),
        t.branch(side, 2 * B + 4, 3),
        t.branch(base, 2 * B + 6, 1),
    ]
    chain = [t.fresh(8 * B)]
    for p in [3, B + 2, 2 * B - 1, 3 * B + 3, 4 * B + 5, 5 * B + 1, 6 * B + 6]:
        chain.append(t.branch(chain[-1], p, 8 * B - p))
    cases["chain_of_handoffs"] = chain
    base = t.fresh(2 * B)
    cases["fan_out_9"] = [base] + [t.branch(base, B + 3, 1 + i) for i in range(9)]
    base = t.fresh(B + 4)
    cases["fork_at_position_1"] = [base, t.branch(base, 1, B + 2), t.branch(base, 1, 3)]
    base = t.fresh(2 * B + 3)
    cases["identical_and_prefix"] = [base, list(base), base[: B + 2], base[:1], t.branch(base, B + 5, 4)]
    cases["several_trees"] = [t.fresh(B + 2), t.fresh(2 * B + 1)]
    cases["several_trees"] += [
        t.branch(cases["several_trees"][0], B - 1, 5),
        t.branch(cases["several_trees"][1], B + 1, B),
    ]
    return cases


def mixed_batch(B: int, vocab: int = 64, seed: int = 0) -> RolloutBatch:
    """All cases in one batch: several trees (distinct first tokens are not needed: equal
    first tokens just merge into one trie, which is a case of its own)."""
    trajs = [tr for case in tree_cases(B, vocab, seed).values() for tr in case]
    return batch_of(trajs, seed)
