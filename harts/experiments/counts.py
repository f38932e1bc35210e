"""What one microbatch executes, counted from its host data: rows, LM-head rows, visible
attention pairs (the work ``harts.models.flops`` turns into FLOPs and MFU), the sequential chunk
steps of its linear-attention recurrence, and which microbatches a bench's warm-up runs.

Nothing here touches the device: every count is read from the batch and the prepared inputs
(``HybridLM.prepare_compact``'s layout in compact mode).
"""

from __future__ import annotations

import numpy as np

from harts.tree.batch import RolloutBatch

__all__ = [
    "layout_chunk_steps",
    "microbatch_counts",
    "recurrence_chunk_steps",
    "trajectory_chunk_steps",
    "warmup_microbatches",
]


def microbatch_counts(
    sub: RolloutBatch,
    inputs,  # noqa: ANN001
    mode: str,
    logprob_positions: str = "all",
) -> tuple[int, int, int]:
    """(rows, logit rows, visible attention pairs) that one microbatch executes (host data only):
    ``inputs`` is what the model runs (a ``prepare_compact`` result in compact mode; unused in
    trajectory mode). Logit rows are those the LM head computes under ``logprob_positions``
    (``ExecutionConfig``): every predicting position, or those whose target is an action; in
    compact mode the unique physical rows among them. ``FlopModel.training_flops`` of these is
    the work MFU counts."""
    pred = sub.predicting_positions()
    if logprob_positions == "actions":
        pred = pred[sub.action_logprob_entries()]
    if mode == "trajectory":
        lengths = sub.lengths.astype(np.int64)
        return int(sub.num_tokens), int(len(pred)), int((lengths * (lengths + 1) // 2).sum())
    layout = inputs.layout
    own = ~np.asarray(layout.is_pad, dtype=bool)
    pairs = int((np.asarray(layout.position)[own] + 1).sum())
    logit_rows = int(np.unique(np.asarray(layout.semantic_to_phys)[pred]).size)
    return int(inputs.cb.num_compact_tokens), logit_rows, pairs


def recurrence_chunk_steps(
    sub: RolloutBatch,
    inputs,  # noqa: ANN001
    mode: str,
    chunk_size: int,
) -> int:
    """Sequential chunk steps of one microbatch's linear-attention state recurrence, per layer
    (host data only): the chunks of its longest sequence in trajectory mode (one call, every
    trajectory a sequence), and in compact mode the sum over its calls (rounds: each waits for
    the one before) of the chunks of each call's longest sequence, replayed rows included.
    ``inputs`` is a ``prepare_compact`` result in compact mode (unused in trajectory mode)."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    if mode == "trajectory":
        return trajectory_chunk_steps(sub.lengths, chunk_size)
    return layout_chunk_steps(inputs.layout, chunk_size)


def trajectory_chunk_steps(lengths: np.ndarray, chunk_size: int) -> int:
    """``recurrence_chunk_steps`` of a trajectory-wise microbatch from its trajectory lengths [N]:
    the chunks of the longest (one call, every trajectory a sequence)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    return int(-(-int(lengths.max()) // chunk_size)) if lengths.size else 0


def layout_chunk_steps(layout, chunk_size: int) -> int:  # noqa: ANN001 - a harts.plan.layout.Layout
    """``recurrence_chunk_steps`` of a compact microbatch from its layout: the sum over its
    calls of the chunks of each call's longest sequence (``cu_seqlens``, replay included)."""
    steps = 0
    for view in layout.rounds:
        seq = np.diff(np.asarray(view.cu_seqlens, dtype=np.int64))
        if seq.size:
            steps += int(-(-int(seq.max()) // chunk_size))
    return steps


def warmup_microbatches(executed_rows: list[int], rows: list[int]) -> list[int]:
    """Indices of the microbatches the untimed warm-up runs (compile, autotune, allocator), so
    that the timed step meets no first-time compilation:

    * the first;
    * the one with the fewest ``rows`` (a call below ``harts.ops.compiled.MIN_ROWS`` rows is
      padded, which compiles the glue once more);
    * the first whose executed row count (``executed_rows``: the T the kernels take, physical
      rows with replay in compact mode) is a multiple of 16 if the first's is not, or the other
      way round. Triton compiles a kernel once per divisibility class of its integer arguments
      (a multiple of 16 gets its own binary), and every fla / tree / Inductor kernel takes T:
      without this warm-up the first timed microbatch of the other class pays those
      compilations (``benchmarks/results/ling3-tiny_h200_2026-12-01_selective-recompute.md``).
    """
    if not executed_rows:
        return []
    chosen = [0, min(range(len(rows)), key=lambda i: rows[i])]
    first_class = executed_rows[0] % 16 == 0
    other = next((i for i, t in enumerate(executed_rows) if (t % 16 == 0) != first_class), None)
    if other is not None:
        chosen.append(other)
    return list(dict.fromkeys(chosen))
