"""Property test: random rollout trees, compact == trajectory-wise (float64); plus input errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings

from harts import RolloutBatch
from tests.models._trees import batch_of
from tests.models.test_compact_vs_trajectory import check_agreement, make_model
from tests.strategies import tree_trajectories

_MODEL = make_model("KGMA", moe=True)


@settings(max_examples=25)
@given(tree_trajectories())
def test_random_trees_agree(trajs) -> None:
    check_agreement(_MODEL, batch_of(trajs))


def test_rejects_bad_inputs() -> None:
    batch = RolloutBatch.from_trajectories([[1, 2, 100]])
    with pytest.raises(ValueError, match="vocab_size"):
        _MODEL(batch, mode="compact")
    ok = RolloutBatch.from_trajectories([[1, 2, 3]])
    with pytest.raises(ValueError, match="mode"):
        _MODEL(ok, mode="tree")
    with pytest.raises(ValueError, match="attention"):
        _MODEL(ok, mode="compact", attention="flash")


@pytest.mark.slow
@pytest.mark.parametrize("pattern", ["KKKM", "GGGA"])
def test_small_workload_agrees(pattern: str) -> None:
    import harts

    batch = harts.workloads.generate("small")
    torch.manual_seed(0)
    model = make_model(pattern, moe=True, vocab_size=batch.vocab_size, chunk_size=16)
    check_agreement(model, batch, recompute=True)
