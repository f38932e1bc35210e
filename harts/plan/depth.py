"""State-handoff depth of every semantic position (paper §5.4, Figure 4's horizontal axis).

A child segment takes its parent's recurrent state at the fork: one *state handoff*. The
paper counts handoffs logically: "crossing one parent-child segment boundary counts as one
handoff ... tokens in the root segment have d = 0; tokens in a child segment at depth d have
inherited state d times". That is the segment-tree depth of the token's segment,
``handoff_depth``; it does not depend on the call plan or on replay.

The call plan materializes only some of those handoffs: a direct continuation runs in its
parent's input sequence (the state never leaves the kernel), while a side branch starts a new
sequence from an exported boundary state (with replay) or from the fork's exact state (no
replay). ``imported_state_depth`` counts those: the sequence-tree depth of the token's
sequence. It is the count the no-replay ablation can differ on, since every imported state is
where replay and no-replay part ways.

Shapes (S = semantic positions of the batch, original order): both functions return int64 [S].
"""

from __future__ import annotations

import numpy as np

from harts.plan.calls import CallPlan
from harts.tree.compact import CompactBatch
from harts.tree.segments import parent_depth

__all__ = ["handoff_depth", "imported_state_depth"]


def handoff_depth(cb: CompactBatch) -> np.ndarray:
    """int64 [S]: segment-tree depth of each semantic position's segment (the paper's d).

    Position ``offsets[j] + i`` of trajectory j gets the number of fork boundaries between
    the root and its token. A fork exists only where two trajectories of *this* batch diverge,
    so the same trajectory can have a smaller depth in a smaller microbatch.
    """
    seg_depth = cb.segment_trees.depth()
    return seg_depth[cb.row_segment[cb.semantic_to_compact]]


def imported_state_depth(cb: CompactBatch, plan: CallPlan) -> np.ndarray:
    """int64 [S]: how many input sequences on the way from the root to each semantic position
    started from a state exported by another sequence (0 on the root's own sequence).

    ``plan`` must be ``cb``'s call plan. Sequences are the same with and without replay (the
    ablation changes where a side sequence's state comes from, not which sequences exist).
    """
    f = plan.forest
    if f.num_segments != cb.segment_trees.num_segments or not np.array_equal(f.row, cb.segment_trees.row):
        raise ValueError("imported_state_depth: the plan was made for a different segment forest than cb's")
    fork = plan.seq_fork
    seq_parent = np.where(fork >= 0, plan.seg_seq[np.maximum(fork, 0)], -1)
    seq_depth = parent_depth(seq_parent)
    return seq_depth[plan.seg_seq[cb.row_segment[cb.semantic_to_compact]]]
