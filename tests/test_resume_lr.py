"""``harts train --resume DIR --lr X``: the new learning rate is applied from the next step and
said in one line (the checkpoint's optimizer state would otherwise bring back the old one)."""

from __future__ import annotations

from pathlib import Path

import pytest

from harts.cli import main


def test_resume_applies_and_prints_a_changed_lr(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    assert main(["train", "--workload", "tiny", "--steps", "2", "--run-dir", str(run), "--save-every", "1"]) == 0
    capsys.readouterr()
    assert main(["train", "--workload", "tiny", "--steps", "3", "--resume", str(run), "--lr", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "--lr 0.5 from step 2 on (the checkpoint's run used 0.0001)" in out

    # resuming with the run's own learning rate says nothing about it
    again = tmp_path / "again"
    assert main(["train", "--workload", "tiny", "--steps", "2", "--run-dir", str(again), "--save-every", "1"]) == 0
    capsys.readouterr()
    assert main(["train", "--workload", "tiny", "--steps", "3", "--resume", str(again)]) == 0
    assert "--lr" not in capsys.readouterr().out
