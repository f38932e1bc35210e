"""``harts train --resume DIR``: a changed ``--lr`` is applied from the next step and said in one
line (the checkpoint's optimizer state would otherwise bring back the old one), and so is a
changed number of plan replicas; a changed setting that makes another run -- a flag, or an
optimizer or loss setting that no flag sets -- is refused by name in one line."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from harts.cli import main
from harts.parallel.checkpoint import checkpoint_path


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


def _train(*argv: str) -> list[str]:
    return ["train", "--workload", "tiny", "--pattern", "KM", *argv]


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two steps planned for 2 replicas on one process, a checkpoint after each."""
    run = tmp_path_factory.mktemp("saved") / "run"
    assert main(_train("--steps", "2", "--run-dir", str(run), "--save-every", "1", "--replicas", "2")) == 0
    return run


def _copy_with_extra(saved_run: Path, tmp_path: Path, change: Callable[[dict[str, Any]], None]) -> Path:
    """A copy of ``saved_run`` whose newest checkpoint's saved identity ``change`` edits."""
    run = tmp_path / "run"
    shutil.copytree(saved_run, run)
    meta = checkpoint_path(run, 2) / "meta.json"
    doc = json.loads(meta.read_text())
    change(doc["extra"])
    meta.write_text(json.dumps(doc))
    return run


def test_resume_names_a_changed_moe_stats(saved_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    argv = _train("--steps", "3", "--resume", str(saved_run), "--replicas", "2", "--moe-stats", "step")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the run used --moe-stats microbatch, this command --moe-stats step" in err, err


@pytest.mark.parametrize(
    "group, key, saved, now",
    [("AdamW", "weight_decay", 0.1, 0.0), ("AdamW", "eps", 1e-6, 1e-08), ("TrainConfig", "max_grad_norm", 0.5, 1.0)],
)
def test_resume_names_a_changed_setting_without_a_flag(
    saved_run: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    group: str,
    key: str,
    saved: float,
    now: float,
) -> None:
    """The optimizer's and the step's settings that no flag sets are part of the run too (a
    checkpoint of code with other defaults is refused by name, not continued differently)."""
    run = _copy_with_extra(saved_run, tmp_path, lambda extra: extra[group].__setitem__(key, saved))
    capsys.readouterr()
    assert main(_train("--steps", "3", "--resume", str(run), "--replicas", "2")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"the run used {group}.{key} {saved}, this command {group}.{key} {now}" in err, err


def test_resume_refuses_a_checkpoint_that_does_not_record_a_setting(
    saved_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _copy_with_extra(saved_run, tmp_path, lambda extra: extra.pop("moe-stats"))
    capsys.readouterr()
    assert main(_train("--steps", "3", "--resume", str(run), "--replicas", "2")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "does not record --moe-stats" in err and "--moe-stats microbatch" in err, err


def test_resume_with_other_replicas_runs_and_says_so(
    saved_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Another number of replicas (a run moved to more or fewer ranks) changes the step plan:
    allowed, and printed."""
    run = _copy_with_extra(saved_run, tmp_path, lambda extra: None)
    capsys.readouterr()
    assert main(_train("--steps", "3", "--resume", str(run))) == 0
    out = capsys.readouterr().out
    assert "--replicas 1 from step 2 on (the checkpoint's run planned 2 replicas" in out, out


def test_resume_refuses_another_model_configuration(
    saved_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The run records a digest of its whole model configuration: a checkpoint whose model's
    config changed under the same flags (a --model DIR whose config.json was edited, same tensor
    shapes) is refused in one line, not continued as another model."""
    from harts.models.config import HybridConfig
    from harts.trainer.run import config_digest

    tiny = HybridConfig.preset("tiny")
    assert config_digest(tiny) == config_digest(HybridConfig.preset("tiny"))
    assert config_digest(tiny) != config_digest(tiny.replace(rms_norm_eps=tiny.rms_norm_eps * 2))
    run = _copy_with_extra(saved_run, tmp_path, lambda extra: extra.__setitem__("model-config", "0123456789abcdef"))
    capsys.readouterr()
    assert main(_train("--steps", "3", "--resume", str(run), "--replicas", "2")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "model configuration (digest 0123456789abcdef) differs" in err, err

    older = _copy_with_extra(saved_run, tmp_path / "older", lambda extra: extra.pop("model-config"))
    assert main(_train("--steps", "3", "--resume", str(older), "--replicas", "2")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "does not record its model configuration's digest" in err, err
