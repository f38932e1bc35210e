"""``harts train`` never trains on silently: a learning rate outside (0, 1] is refused before any
work, and a step whose loss is not finite stops the run with one line naming it, exit 2, and
nothing saved (the checkpoints of earlier steps stay)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from harts.cli import main
from harts.tree.batch import RolloutBatch

TRAIN = ["train", "--pattern", "KM", "--capacity", "256", "--dtype", "float32"]


def _run(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, str, str]:
    try:
        code = main([*TRAIN, *(str(a) for a in argv)])
    except SystemExit as exit_:  # argparse's errors
        code = int(exit_.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def test_a_huge_learning_rate_is_refused_before_any_work(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    code, stdout, err = _run(capsys, "--workload", "tiny", "--steps", "1", "--lr", "1e30", "--save", out)
    assert code == 2 and "argument --lr: 1e+30 is outside (0, 1]" in err, err
    assert "step 0" not in stdout and not out.exists()


def test_a_diverging_step_stops_the_run_and_saves_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Step 1's advantages of +-3e38 overflow its float32 loss (inf - inf): the run stops there, with step 0's
    checkpoint kept and neither --save nor --json written."""
    rng = np.random.default_rng(0)
    files = []
    for name, adv in (("a.jsonl", 1.0), ("b.jsonl", 3e38)):
        trajs = [rng.integers(0, 60, size=n) for n in (9, 11, 7, 12)]
        path = tmp_path / name
        RolloutBatch.from_trajectories(trajs, advantages=[adv, -adv, adv, -adv]).save(str(path))
        files.append(path)
    out, log, run = tmp_path / "out", tmp_path / "log.json", tmp_path / "run"
    argv = ["--data", *files, "--save", out, "--json", log, "--run-dir", run, "--save-every", "1"]
    code, stdout, err = _run(capsys, *argv)
    assert code == 2, (stdout, err)
    lines = [line for line in err.splitlines() if line.startswith("harts:")]
    assert lines == [
        "harts: error: step 1: the loss is nan; the weights and the optimizer state are left as they were before "
        "this step and nothing was saved (the checkpoints of earlier steps stay; a lower --lr?)"
    ], err
    assert "Traceback" not in err and "step 0: loss" in stdout and "step 1: loss" not in stdout
    assert not out.exists() and not log.exists()
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-00000001"]
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [0]
