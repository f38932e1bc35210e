"""JSONL / Parquet round trips and clear errors for malformed files."""

from __future__ import annotations

import json

import numpy as np
import pytest

import harts
from harts import BatchValidationError, RolloutBatch

FIELDS = (
    "tokens",
    "offsets",
    "action_mask",
    "advantages",
    "old_logprobs",
    "ref_logprobs",
    "loss_weights",
    "group_ids",
    "tree_ids",
)


#: the per-token fields, whose entry at a trajectory's first token is never read (files keep one
#: value per predicted token)
PER_TOKEN = ("action_mask", "advantages", "old_logprobs", "ref_logprobs", "loss_weights")


def assert_same(a: RolloutBatch, b: RolloutBatch) -> None:
    """Every entry of ``a`` that is read equals ``b``'s."""
    predicted = np.ones(a.num_tokens, dtype=bool)
    predicted[a.offsets[:-1]] = False
    for name in FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None and name in PER_TOKEN:
            np.testing.assert_array_equal(x[predicted], y[predicted], err_msg=name)
        elif x is not None:
            np.testing.assert_array_equal(x, y, err_msg=name)
    assert a.vocab_size == b.vocab_size


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_round_trip_workload(tmp_path, suffix):
    batch = harts.workloads.generate("tiny", step=0, seed=1)
    path = tmp_path / f"batch{suffix}"
    batch.save(path)
    back = RolloutBatch.load(path)
    assert_same(batch, back)


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_round_trip_minimal(tmp_path, suffix):
    batch = RolloutBatch.from_trajectories([[3, 1], [3, 2, 2]])
    path = tmp_path / f"b{suffix}"
    batch.save(path)
    assert_same(batch, RolloutBatch.load(path))


def write_lines(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def test_per_trajectory_advantage_and_header(tmp_path):
    p = write_lines(
        tmp_path / "b.jsonl",
        [
            json.dumps({"format": "harts.rollout_batch", "version": 1, "vocab_size": 10}),
            json.dumps({"tokens": [1, 2, 3], "advantages": 0.5, "group_id": 1}),
            json.dumps({"tokens": [1, 4], "advantages": -0.5, "group_id": 1}),
        ],
    )
    b = RolloutBatch.load(p)
    assert b.vocab_size == 10 and b.advantages.tolist() == [0.5] * 3 + [-0.5] * 2
    assert b.group_ids.tolist() == [1, 1]


@pytest.mark.parametrize(
    "lines, message",
    [
        (['{"tokens": [1, 2], "advantages": 0}', "{oops"], r"b.jsonl: line 2: not valid JSON"),
        (
            ['{"tokens": [1, 2], "advantages": 0}', '{"advantages": 1.0}'],
            r"trajectory 1 \(line 2\): missing required field 'tokens'",
        ),
        (
            ['{"tokens": [1, 2], "advantages": 0, "logprobs": [-1]}', '{"tokens": [3], "advantages": 0}'],
            r"trajectory 1 \(line 2\): has no 'logprobs' but trajectory 0 \(line 1\) does",
        ),
        (['{"tokens": [1, 2], "advantages": NaN}'], r"trajectory 0 \(line 1\): advantages is nan"),
        (
            ['{"tokens": [1, 2], "advantages": 0, "loss_weights": [1.0, null]}'],
            r"trajectory 0 \(line 1\): loss_weights, position 1 is null \(must be a finite number\)",
        ),
        (
            ['{"tokens": [1, 2], "advantages": 0}', '{"tokens": [], "advantages": 0}'],
            r"trajectory 1 \(line 2\): tokens is empty",
        ),
        (['{"tokens": [1, 2], "advantages": 0, "colour": 3}'], r"unknown field\(s\) \['colour'\]"),
        (
            ['{"tokens": [1, 2], "advantages": 0, "action_mask": [false, true, true]}'],
            r"trajectory 0 \(line 1\): action_mask has 3 values for 2 tokens \(one per predicted token",
        ),
        ([], "holds no trajectories"),
    ],
)
def test_bad_jsonl(tmp_path, lines, message):
    p = write_lines(tmp_path / "b.jsonl", lines)
    with pytest.raises(BatchValidationError, match=message):
        RolloutBatch.load(p)


def test_vocab_override_and_errors(tmp_path):
    p = write_lines(tmp_path / "b.jsonl", ['{"tokens": [1, 20], "advantages": 1}'])
    with pytest.raises(BatchValidationError, match="token id 20 is out of vocabulary"):
        RolloutBatch.load(p, vocab_size=8)
    with pytest.raises(BatchValidationError, match="missing.jsonl: no such batch file"):
        RolloutBatch.load(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="unknown batch file type '.csv'"):
        RolloutBatch.from_trajectories([[1]]).save(tmp_path / "x.csv")
