"""``harts train`` on files reports advantage statistics and the clip fraction per step, and warns
once when a batch's advantages are all zero (its policy loss then cannot change the weights)."""

from __future__ import annotations

import json

import numpy as np

from harts.cli import main
from harts.tree.batch import RolloutBatch


def _batch_file(tmp_path, advantages) -> str:  # noqa: ANN001
    rng = np.random.default_rng(0)
    trajs = [rng.integers(0, 60, size=n) for n in (9, 12, 7)]
    path = str(tmp_path / "b.jsonl")
    RolloutBatch.from_trajectories(trajs, advantages=advantages).save(path)
    return path


def _train(capsys, path: str, *extra: str) -> tuple[int, str, str]:  # noqa: ANN001
    code = main(["train", "--workload", path, "--steps", "2", "--pattern", "KM", *extra])
    out, err = capsys.readouterr()
    return code, out, err


def test_zero_advantages_warn_once(tmp_path, capsys) -> None:  # noqa: ANN001
    code, out, err = _train(capsys, _batch_file(tmp_path, [0.0, 0.0, 0.0]))
    assert code == 0
    assert err.count("every advantage is zero") == 1
    assert "adv mean" in out and "adv!=0" in out


def test_advantage_statistics_in_table_and_json(tmp_path, capsys) -> None:  # noqa: ANN001
    out_json = tmp_path / "log.json"
    code, out, err = _train(capsys, _batch_file(tmp_path, [1.0, -1.0, 0.5]), "--json", str(out_json))
    assert code == 0 and "every advantage is zero" not in err
    step = json.loads(out_json.read_text())["steps"][0]
    # action tokens: every token but the first of each trajectory (8, 11 and 6 of them)
    adv = np.repeat([1.0, -1.0, 0.5], [8, 11, 6])
    assert abs(step["adv_mean"] - adv.mean()) < 1e-12 and abs(step["adv_std"] - adv.std()) < 1e-12
    assert step["adv_nonzero"] == 1.0 and 0.0 <= step["clip_frac"] <= 1.0


def test_reward_statistics_where_the_batch_has_rewards(tmp_path, capsys) -> None:  # noqa: ANN001
    rng = np.random.default_rng(0)
    trajs = [rng.integers(0, 60, size=n) for n in (9, 12, 7)]
    path = str(tmp_path / "r.jsonl")
    RolloutBatch.from_trajectories(trajs, advantages=[1.0, -1.0, 0.5], rewards=[1.0, 0.0, 0.5]).save(path)
    out_json = tmp_path / "log.json"
    code, out, _ = _train(capsys, path, "--json", str(out_json))
    assert code == 0 and "reward" in out
    step = json.loads(out_json.read_text())["steps"][0]
    assert abs(step["reward_mean"] - 0.5) < 1e-12 and abs(step["reward_std"] - np.std([1.0, 0.0, 0.5])) < 1e-12
    # a batch without rewards: no statistics, a dash in the table
    code, out, _ = _train(capsys, _batch_file(tmp_path, [1.0, -1.0, 0.5]), "--json", str(out_json), "--overwrite")
    assert code == 0 and json.loads(out_json.read_text())["steps"][0]["reward_mean"] is None


def test_no_prepare_ahead_trains_the_same_steps(tmp_path, capsys) -> None:  # noqa: ANN001
    # the microbatches prepared in the training thread (--no-prepare-ahead) or on a background
    # thread (default): the same inputs, so the same losses and gradient norms
    path = _batch_file(tmp_path, [1.0, -1.0, 0.5])
    logs = []
    for extra in ((), ("--no-prepare-ahead",)):
        out_json = tmp_path / f"log{len(logs)}.json"
        code, _, _ = _train(capsys, path, "--capacity", "16", "--json", str(out_json), *extra)
        assert code == 0
        logs.append(json.loads(out_json.read_text())["steps"])
    for a, b in zip(*logs, strict=True):
        assert a["microbatches"] > 1
        assert (a["loss"], a["grad_norm"]) == (b["loss"], b["grad_norm"])
