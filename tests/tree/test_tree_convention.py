"""Rollout-tree nodes take their lists as batch files, harts.Engine and Tinker's datums do: one
value per predicted token (a root's first token is predicted by nothing, so a root's lists have
``len(tokens) - 1`` entries), the sampler's log-probs named ``logprobs``. The older form (a
root's lists one per token, ``old_logprobs``) is still read, with one deprecation line."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from harts import RolloutBatch
from harts.errors import BatchValidationError
from harts.tree.io import BatchFormatWarning

#: one root (a prompt of three tokens) and two continuations, lists per predicted token
NODES = [
    {"id": "p", "parent": None, "tokens": [5, 1, 2], "advantages": [0.5, -1.0], "logprobs": [-0.1, -2.0]},
    {"id": "a", "parent": "p", "tokens": [3, 4], "advantages": [2.0, 1.5], "logprobs": [-0.7, -0.3]},
    {"id": "b", "parent": "p", "tokens": [6], "advantages": [0.25], "logprobs": [-1.2], "action_mask": [False]},
]


def older_form(nodes: list[dict]) -> list[dict]:
    """``nodes`` as trees spelled them before: a root's lists one per token, ``old_logprobs``."""
    out = []
    for node in nodes:
        pad = [9.0] if node["parent"] is None else []
        new = {k: v for k, v in node.items() if k != "logprobs"}
        new["advantages"] = pad + node["advantages"]
        new["old_logprobs"] = [-3.0] * len(pad) + node["logprobs"]
        out.append(new)
    return out


def test_a_tree_reads_as_the_engine_reads_its_paths():
    from harts.trainer.engine import trajectories_to_batch

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the current form warns of nothing
        tree = RolloutBatch.from_tree(NODES)
    paths = [
        {"tokens": [5, 1, 2, 3, 4], "advantages": [0.5, -1.0, 2.0, 1.5], "logprobs": [-0.1, -2.0, -0.7, -0.3]},
        {"tokens": [5, 1, 2, 6], "advantages": [0.5, -1.0, 0.25], "logprobs": [-0.1, -2.0, -1.2]},
    ]
    engine = trajectories_to_batch(paths, vocab_size=8)
    predicted = np.ones(tree.num_tokens, dtype=bool)
    predicted[tree.offsets[:-1]] = False
    np.testing.assert_array_equal(tree.tokens, engine.tokens)
    np.testing.assert_array_equal(tree.advantages[predicted], engine.advantages[predicted])
    np.testing.assert_array_equal(tree.old_logprobs[predicted], engine.old_logprobs[predicted])
    assert tree.action_mask.tolist() == [False, True, True, True, True, False, True, True, False]


def test_the_older_form_reads_the_same_batch_with_one_warning_line():
    new = RolloutBatch.from_tree(NODES)
    with pytest.warns(BatchFormatWarning) as caught:
        old = RolloutBatch.from_tree(older_form(NODES))
    assert len(caught) == 1
    line = str(caught[0].message)
    assert "\n" not in line
    assert line.startswith("rollout-tree nodes in the older form ('old_logprobs' for 'logprobs'; a root's advantages")
    predicted = np.ones(new.num_tokens, dtype=bool)
    predicted[new.offsets[:-1]] = False
    for name in ("advantages", "old_logprobs", "action_mask"):
        np.testing.assert_array_equal(getattr(old, name)[predicted], getattr(new, name)[predicted], err_msg=name)


def test_a_root_list_of_neither_length_names_both_forms():
    bad = [{**NODES[0], "advantages": [0.5]}, *NODES[1:]]
    with pytest.raises(BatchValidationError, match=r"node 'p': advantages has 1 values for 3 tokens; expected 2 \(one"):
        RolloutBatch.from_tree(bad)
    both = [{**NODES[0], "old_logprobs": [-0.1, -2.0]}, *NODES[1:]]
    with pytest.raises(BatchValidationError, match="node 'p': has both 'logprobs' and its older name 'old_logprobs'"):
        RolloutBatch.from_tree(both)


def test_built_in_workloads_build_their_trees_without_a_warning():
    from harts.tree.workloads import workload_steps

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        workload_steps("tiny", 1, seed=0)[0][1]()
