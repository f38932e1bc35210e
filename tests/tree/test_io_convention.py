"""Batch files take advantages and the sampler's log-probs as harts.Engine and Tinker's datums do:
one value per predicted token (``len(tokens) - 1``), the log-probs named ``logprobs``. The older
form (one value per token, ``old_logprobs``) is still read, with one deprecation line per file."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

from harts import RolloutBatch
from harts.tree.io import BatchFormatWarning

#: two trajectories in the Engine's / Tinker's form: fields per predicted token
TRAJECTORIES = [
    {"tokens": [5, 1, 2, 3], "advantages": [0.5, -1.0, 2.0], "logprobs": [-0.1, -2.0, -0.7]},
    {"tokens": [5, 1, 4], "advantages": [1.5, 0.25], "logprobs": [-0.3, -1.2]},
]


def older_form(traj: dict) -> dict:
    """``traj`` as batch files spelled it before: per-token lists (entry 0 unused), ``old_logprobs``."""
    return {
        "tokens": traj["tokens"],
        "advantages": [9.0, *traj["advantages"]],
        "old_logprobs": [0.0, *traj["logprobs"]],
    }


def write_jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_a_file_reads_as_the_engine_reads_the_same_trajectories(tmp_path):
    from harts.trainer.engine import trajectories_to_batch

    path = write_jsonl(tmp_path / "b.jsonl", TRAJECTORIES)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the current form warns of nothing
        loaded = RolloutBatch.load(path)
    engine = trajectories_to_batch(TRAJECTORIES, vocab_size=8)
    predicted = np.ones(loaded.num_tokens, dtype=bool)
    predicted[loaded.offsets[:-1]] = False
    np.testing.assert_array_equal(loaded.tokens, engine.tokens)
    np.testing.assert_array_equal(loaded.action_mask, engine.action_mask)
    np.testing.assert_array_equal(loaded.advantages[predicted], engine.advantages[predicted])
    np.testing.assert_array_equal(loaded.old_logprobs[predicted], engine.old_logprobs[predicted])
    assert loaded.advantages[predicted].tolist() == [0.5, -1.0, 2.0, 1.5, 0.25]


def test_the_older_form_reads_the_same_batch_with_one_warning_line(tmp_path):
    new = RolloutBatch.load(write_jsonl(tmp_path / "new.jsonl", TRAJECTORIES))
    path = write_jsonl(tmp_path / "old.jsonl", [older_form(t) for t in TRAJECTORIES])
    with pytest.warns(BatchFormatWarning) as caught:
        old = RolloutBatch.load(path)
    assert len(caught) == 1
    line = str(caught[0].message)
    assert "\n" not in line
    assert line.startswith(f"{path}: the older batch-file form ('old_logprobs' for 'logprobs'; one value per token")
    assert "in advantages, logprobs) is deprecated" in line
    assert issubclass(BatchFormatWarning, FutureWarning)  # shown to users by default
    predicted = np.ones(new.num_tokens, dtype=bool)
    predicted[new.offsets[:-1]] = False
    for name in ("advantages", "old_logprobs"):
        np.testing.assert_array_equal(getattr(old, name)[predicted], getattr(new, name)[predicted], err_msg=name)


def test_save_writes_the_predicted_token_form(tmp_path):
    batch = RolloutBatch.load(write_jsonl(tmp_path / "in.jsonl", TRAJECTORIES))
    out = tmp_path / "out.jsonl"
    batch.save(str(out))
    records = [json.loads(line) for line in out.read_text().splitlines()[1:]]
    for rec, traj in zip(records, TRAJECTORIES):
        assert rec["advantages"] == traj["advantages"]
        assert rec["logprobs"] == traj["logprobs"]
        assert "old_logprobs" not in rec
        assert len(rec["action_mask"]) == len(traj["tokens"]) - 1


def test_both_names_in_one_record_is_an_error(tmp_path):
    from harts import BatchValidationError

    rec = dict(TRAJECTORIES[0], old_logprobs=[0.0, -0.1, -2.0, -0.7])
    with pytest.raises(BatchValidationError, match="has both 'logprobs' and its older name 'old_logprobs'"):
        RolloutBatch.load(write_jsonl(tmp_path / "b.jsonl", [rec]))
