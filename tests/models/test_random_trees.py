"""Property test: random rollout trees, compact == trajectory-wise (float64); plus input errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harts import RolloutBatch
from tests.models._trees import TreeBuilder, batch_of
from tests.models.test_compact_vs_trajectory import B, check_agreement, make_model

_MODEL = make_model("KGMA", moe=True)


@st.composite
def random_forest(draw):
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


@settings(max_examples=25)
@given(random_forest())
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
