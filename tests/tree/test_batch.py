"""RolloutBatch construction and every validation error, with its message."""

from __future__ import annotations

import numpy as np
import pytest

from harts import BatchValidationError, RolloutBatch
from harts.tree.compact import compact


def test_from_trajectories_layout_and_defaults():
    b = RolloutBatch.from_trajectories([[1, 2, 3], [4, 5]], advantages=[0.5, -1.0], group_ids=[0, 0])
    assert b.num_trajectories == 2 and b.num_tokens == 5 and b.num_logprobs == 3
    assert b.offsets.tolist() == [0, 3, 5]
    assert b.action_mask.tolist() == [False, True, True, False, True]
    assert b.advantages.tolist() == [0.5, 0.5, 0.5, -1.0, -1.0]
    assert b.logprob_index().tolist() == [-1, 0, 1, -1, 2]
    assert b.next_token_targets().tolist() == [2, 3, 5]
    assert b.predicting_positions().tolist() == [0, 1, 3]


def test_per_token_advantages_and_metadata():
    b = RolloutBatch.from_trajectories(
        [[1, 2], [3, 4, 5]],
        advantages=[[0.0, 1.0], [0.0, 2.0, 3.0]],
        old_logprobs=[[0.0, -1.0], [0.0, -2.0, -3.0]],
        loss_weights=[[1.0, 1.0], [1.0, 0.5, 0.5]],
        action_mask=[[False, True], [False, False, True]],
    )
    assert b.advantages.tolist() == [0.0, 1.0, 0.0, 2.0, 3.0]
    assert b.old_logprobs.tolist() == [0.0, -1.0, 0.0, -2.0, -3.0]
    sub = b.select([1])
    assert sub.trajectory(0).tolist() == [3, 4, 5] and sub.loss_weights.tolist() == [1.0, 0.5, 0.5]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(trajectories=[[1, 2], []]), "trajectory 1 is empty"),
        (dict(trajectories=[]), "at least one trajectory"),
        (dict(trajectories=[[1, -3]]), "trajectory 0, position 1: negative token id -3"),
        (
            dict(trajectories=[[1, 2], [3, 99]], vocab_size=50),
            "trajectory 1, position 1: token id 99 is out of vocabulary",
        ),
        (
            dict(trajectories=[[1, 2]], action_mask=[[False, True, True]]),
            "action_mask: trajectory 0 has 3 values for 2 tokens",
        ),
        (dict(trajectories=[[1, 2]], action_mask=[[True, True]]), "trajectory 0 marks its first token as an action"),
        (dict(trajectories=[[1, 2], [3]], advantages=[1.0]), "advantages: has 1 entries but the batch has 2"),
        (
            dict(trajectories=[[1, 2], [3]], advantages=[1.0, float("nan")]),
            "advantages: trajectory 1, position 0 is nan",
        ),
        (
            dict(trajectories=[[1, 2]], old_logprobs=[[0.0, float("inf")]]),
            "old_logprobs: trajectory 0, position 1 is inf",
        ),
        (dict(trajectories=[[1, 2]], ref_logprobs=[[0.0]]), "ref_logprobs: trajectory 0 has 1 values for 2 tokens"),
        (
            dict(trajectories=[[1, 2]], loss_weights=[[1.0, float("nan")]]),
            "loss_weights: trajectory 0, position 1 is nan",
        ),
        (dict(trajectories=[[1, 2]], group_ids=[0, 1]), "group_ids: has 2 entries but the batch has 1"),
        (dict(trajectories=[[1.5, 2]]), "trajectory 0: token ids must be integers"),
    ],
)
def test_validation_errors(kwargs, message):
    trajs = kwargs.pop("trajectories")
    with pytest.raises(BatchValidationError, match=message.replace("(", r"\(").replace(")", r"\)")):
        RolloutBatch.from_trajectories(trajs, **kwargs)


def node(nid, parent, tokens, **kw):
    return {"id": nid, "parent": parent, "tokens": tokens, **kw}


@pytest.mark.parametrize(
    "nodes, message",
    [
        ([node("r", None, [1]), node("a", "zz", [2])], "node 'a': parent 'zz' does not exist"),
        ([node("r", None, [1]), node("r", None, [2])], "duplicate node id 'r'"),
        ([node("r", None, [1]), node("a", "b", [2]), node("b", "a", [3])], "is on a parent cycle"),
        ([node("r", "r", [1])], "node 'r' is on a parent cycle"),
        ([node("r", None, [1]), node("a", "r", [])], "node 'a' has an empty token span"),
        ([node("r", None, [1, 2], logprobs=[0.0, 0.0, 0.0])], "node 'r': logprobs has 3 values for 2 tokens"),
        ([node("r", None, [1]), node("a", "r", [2, 3], logprobs=[0.0])], "node 'a': logprobs has 1 values for 2"),
        ([node("r", None, [1, 2], loss_weights=[1.0, float("nan")])], r"node 'r': loss_weights\[1\] is nan"),
        ([node("r", None, [1]), node("a", "r", [2], advantage=float("inf"))], "node 'a': advantage is inf"),
        (
            [node("r", None, [1], advantage=1.0), node("a", "r", [2])],
            "'advantage' is per trajectory and belongs on a leaf",
        ),
        ([node("r", None, [1, 2], action_mask=[True, True])], "marks the root's first token as an action"),
        ([], "at least one node"),
        ([{"parent": None, "tokens": [1]}], "node #0 has no 'id'"),
    ],
)
def test_tree_validation_errors(nodes, message):
    with pytest.raises(BatchValidationError, match=message):
        RolloutBatch.from_tree(nodes)


def test_tree_out_of_vocab_is_named():
    with pytest.raises(BatchValidationError, match="token id 70 is out of vocabulary"):
        RolloutBatch.from_tree([node("r", None, [1, 70])], vocab_size=64)


def test_tree_paths_become_trajectories_in_leaf_order():
    nodes = [
        node("r", None, [1, 2], action_mask=[False]),
        node("x", "r", [3], advantage=1.0, group_id=4),
        node("y", "r", [5, 6], advantage=-1.0, group_id=4, logprobs=[-0.1, -0.2]),
        node("s", None, [9]),
    ]
    b = RolloutBatch.from_tree(nodes)
    assert [t.tolist() for t in b.trajectories()] == [[1, 2, 3], [1, 2, 5, 6], [9]]
    assert b.advantages.tolist() == [1.0, 1.0, 1.0, -1.0, -1.0, -1.0, -1.0, 0.0]
    assert b.tree_ids.tolist() == [0, 0, 1]
    assert b.group_ids.tolist() == [4, 4, -1]
    # nodes that carry no logprobs get zeros; the metadata is present for all
    assert b.old_logprobs.tolist() == [0.0, 0.0, 0.0, 0.0, 0.0, -0.1, -0.2, 0.0]
    assert b.action_mask.tolist() == [False, False, True, False, False, True, True, False]


def test_select_rejects_bad_indices():
    b = RolloutBatch.from_trajectories([[1], [2]])
    with pytest.raises(BatchValidationError, match="out of range"):
        b.select([0, 2])


def test_repr_and_public_api():
    b = RolloutBatch.from_trajectories([[1, 2]], vocab_size=10)
    assert "trajectories=1" in repr(b)
    cb = compact(b)
    assert "compression" in repr(cb)
    assert np.array_equal(cb.traj_offsets, [0, 2])
