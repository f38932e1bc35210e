"""``harts train --resume DIR``: a changed ``--lr`` is applied from the next step and said in one
line (the checkpoint's optimizer state would otherwise bring back the old one); a changed setting
that makes another run is refused by name."""

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


def test_resume_names_a_changed_dtype_or_capacity(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    assert main(["train", "--workload", "tiny", "--steps", "2", "--run-dir", str(run), "--save-every", "1"]) == 0
    capsys.readouterr()
    for flag, value, saved in (("--dtype", "float64", "float32"), ("--capacity", "4096", "65536")):
        assert main(["train", "--workload", "tiny", "--steps", "3", "--resume", str(run), flag, value]) == 2
        err = capsys.readouterr().err
        assert f"the run used {flag} {saved}, this command {flag} {value}" in err, err
