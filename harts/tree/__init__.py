"""Rollout data without torch: batches, validation, files, compaction, segment trees, workloads."""

from harts.tree.batch import BatchValidationError, RolloutBatch
from harts.tree.compact import CompactBatch, PrefixIndex, compact, prefix_index
from harts.tree.lcp import LCPIndex
from harts.tree.rollout_tree import RolloutTree
from harts.tree.segments import SegmentForest

__all__ = [
    "BatchValidationError",
    "CompactBatch",
    "LCPIndex",
    "PrefixIndex",
    "RolloutBatch",
    "RolloutTree",
    "SegmentForest",
    "compact",
    "prefix_index",
]
