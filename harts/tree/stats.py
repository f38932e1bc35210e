"""Batch statistics: the calibration table of ``harts stats`` (paths, tokens, forks, depth)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from harts.tree.compact import CompactBatch

__all__ = ["BatchStats", "batch_stats"]


@dataclass(frozen=True)
class BatchStats:
    """Shape of one compacted batch (all counts in tokens unless named otherwise)."""

    paths: int
    raw_tokens: int
    compact_tokens: int
    compression: float
    trees: int
    segments: int
    forks: int
    #: side branches: sum over forks of (children - 1)
    side_branches: int
    max_depth: int
    max_fanout: int
    max_path: int
    mean_path: float
    #: segments of 1-15 tokens, and the longest segment
    short_segments: int
    max_segment: int
    #: forks whose position p has p mod chunk in {B-1, 0, 1}
    forks_near_chunk_boundary: int
    chunk_size: int

    def to_dict(self) -> dict:
        return asdict(self)


def batch_stats(cb: CompactBatch, chunk_size: int = 64) -> BatchStats:
    f = cb.segment_trees
    nchild = f.num_children
    forks = nchild >= 2
    lengths = cb.batch.lengths
    fork_pos = f.end[forks] % chunk_size
    return BatchStats(
        paths=cb.num_trajectories,
        raw_tokens=cb.num_semantic_tokens,
        compact_tokens=cb.num_compact_tokens,
        compression=round(cb.compression, 4),
        trees=f.num_trees,
        segments=f.num_segments,
        forks=int(forks.sum()),
        side_branches=int((nchild[forks] - 1).sum()),
        max_depth=int(f.depth().max()),
        max_fanout=int(nchild.max()) if nchild.size else 0,
        max_path=int(lengths.max()),
        mean_path=round(float(lengths.mean()), 1),
        short_segments=int((f.length <= 15).sum()),
        max_segment=int(f.length.max()),
        forks_near_chunk_boundary=int(np.isin(fork_pos, [chunk_size - 1, 0, 1]).sum()),
        chunk_size=chunk_size,
    )
