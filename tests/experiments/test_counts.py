"""What a microbatch executes, counted from its host data (``harts.experiments.counts``)."""

from __future__ import annotations

import harts
from harts.experiments.counts import microbatch_counts


def test_pairs_of_a_tree_and_of_its_trajectories() -> None:
    batch = harts.RolloutBatch.from_trajectories([[1, 5, 9, 2], [1, 5, 9, 7, 7], [1, 4]], advantages=[1.0, -1.0, 0.5])
    model = harts.HybridLM(harts.HybridConfig.tiny(vocab_size=16))
    rows, logit_rows, pairs = microbatch_counts(batch, batch, "trajectory")
    assert (rows, logit_rows, pairs) == (11, 8, 10 + 15 + 3)
    inputs = model.prepare_compact(batch)
    rows, logit_rows, pairs = microbatch_counts(batch, inputs, "compact")
    # trie: 1 -> 5 -> 9 -> {2, 7 -> 7}, 1 -> 4: positions 0,1,2,3,3,4,1
    assert rows == 7 and pairs == 1 + 2 + 3 + 4 + 4 + 5 + 2
    # logits come from rows that have a child: 1 (predicts 5 and 4), 5, 9 (predicts 2 and 7), first 7
    assert logit_rows == 4
