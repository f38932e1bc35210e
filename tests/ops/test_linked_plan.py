"""``plan_linked_rounds``: a layout's rounds as one call (host plan; the op itself runs on CUDA,
``tests/ops/test_tree_kernel.py``)."""

from __future__ import annotations

import numpy as np
import pytest

from harts.ops.linear_attn.tree_kernel import plan_linked_rounds


def _layout_rounds(seed: int):  # noqa: ANN202
    from harts.models.config import HybridConfig
    from harts.models.hybrid_lm import HybridLM
    from tests.models._trees import mixed_batch

    model = HybridLM(HybridConfig.tiny(dtype="float64"))
    layout = model.prepare_compact(mixed_batch(model.config.chunk_size, seed=seed)).layout
    rounds = [(np.asarray(r.cu_seqlens), np.asarray(r.init_state), np.asarray(r.requests), np.asarray(r.request_ids))
              for r in layout.rounds]  # fmt: skip
    return rounds, int(layout.chunk_size)


@pytest.mark.parametrize("seed", [0, 4, 7])
def test_every_sequence_starts_from_the_state_its_layout_names(seed: int) -> None:
    """Each linked sequence's pool entry is the state the layout hands it: the export slot of
    the requested chunk boundary, the producing sequence's final state, or zero."""
    rounds, B = _layout_rounds(seed)
    plan = plan_linked_rounds(rounds, B)
    assert plan is not None and len(rounds) > 1
    starts = plan.round_starts
    assert plan.lengths.tolist() == [int(x) for cu, *_ in rounds for x in np.diff(cu)]
    e, n = plan.export_slots, plan.num_seqs
    made = {}
    for r, (_, _, req, ids) in enumerate(rounds):
        for (s, count), sid in zip(np.asarray(req).reshape(-1, 2), ids):
            made[int(sid)] = (int(starts[r] + s), int(count))
    slot_chunk = {int(plan.io.export_index[c]): c for c in np.flatnonzero(plan.io.export_index >= 0)}
    linked = 0
    for r, (_, init, _, _) in enumerate(rounds):
        for s, sid in enumerate(np.asarray(init).tolist()):
            pool = int(plan.init_pool[starts[r] + s])
            if sid < 0:
                assert pool == e + n
                continue
            linked += 1
            seq, count = made[sid]
            if count == plan.lengths[seq]:  # the producer's final state
                assert pool == e + seq
            elif count == 0:  # the state the producer itself started from
                assert pool == plan.init_pool[seq]
            else:  # exported at the start of the requested chunk, its gradient injected at the end of the one before
                assert pool < e and slot_chunk[pool] == plan.io.chunk_offsets[seq] + count // B
                assert plan.io.inject_index[slot_chunk[pool] - 1] == pool
    assert linked > 0
    assert (plan.init_pool[: starts[1]] == e + n).all() and plan.pool_size == e + n + 1


def test_unaligned_requests_leave_the_rounds_apart_and_unknown_states_are_named() -> None:
    cu = np.array([0, 100])
    assert plan_linked_rounds([(cu, np.array([-1]), np.array([[0, 70]]), np.array([0]))], 64) is None
    with pytest.raises(ValueError, match="state 5, which no earlier round produces"):
        plan_linked_rounds([(cu, np.array([5]), np.zeros((0, 2)), np.zeros(0))], 64)
    same_round = [(np.array([0, 64, 128]), np.array([-1, 0]), np.array([[0, 64]]), np.array([0]))]
    with pytest.raises(ValueError, match="sequence 1 of round 0 starts from state 0"):
        plan_linked_rounds(same_round, 64)
