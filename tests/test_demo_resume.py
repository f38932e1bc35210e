"""``harts demo`` checkpoints: a resumed run equals the uninterrupted one (float64, bitwise),
``metrics.jsonl`` continues without duplicated or lost rows, a step that fails halfway is undone
and the completed steps are kept, the resume checks name the flag, and SIGINT / SIGTERM save
the last completed step and exit 130 / 143."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
from pathlib import Path

import pytest
import torch

from harts.cli import main
from harts.parallel.checkpoint import checkpoint_path, latest_checkpoint
from tests.rl.test_train_signals import interrupt

SMALL = ["demo", "--tasks", "2", "--group-size", "2", "--updates", "2", "--dtype", "float64"]
TIMINGS = ("sample_seconds", "step_seconds", "tokens_per_second")


def _demo(capsys, *argv) -> tuple[int, str, str]:  # noqa: ANN001
    code = main([*SMALL, *(str(a) for a in argv)])
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


def _rows(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(x).items() if k not in TIMINGS} for x in lines]


def _meta(ckpt: Path) -> dict:
    from harts.parallel.checkpoint import read_checkpoint

    got = read_checkpoint(ckpt)
    return {"step": got.step, "data_state": got.data_state, "extra": got.extra}


def _model_state(ckpt: Path) -> dict[str, torch.Tensor]:
    """A checkpoint's weights and optimizer state, loaded into a fresh demo model."""
    from harts.envs import ToolLookup
    from harts.models.config import HybridConfig
    from harts.models.hybrid_lm import HybridLM
    from harts.parallel.checkpoint import load_checkpoint

    torch.manual_seed(123)  # other initial weights: everything must come from the checkpoint
    model = HybridLM(HybridConfig.tiny(vocab_size=ToolLookup().vocab_size, dtype="float64"))
    opt = torch.optim.AdamW(model.parameters())
    load_checkpoint(ckpt, model=model, optimizer=opt)
    state = {f"model.{k}": v for k, v in model.state_dict().items()}
    for i, s in enumerate(opt.state.values()):
        state |= {f"opt.{i}.{k}": v for k, v in s.items()}
    return state


def _assert_same_checkpoint(a: Path, b: Path) -> None:
    sa, sb = _model_state(a), _model_state(b)
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa), a
    ma, mb = _meta(a)["data_state"]["online"], _meta(b)["data_state"]["online"]
    assert torch.equal(ma["state"]["sampler"], mb["state"]["sampler"])
    assert ma["state"]["task_rng"] == mb["state"]["task_rng"]
    assert all(torch.equal(ma["reference"][k], mb["reference"][k]) for k in ma["reference"])


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:  # noqa: ANN001
    """4 steps in one go, a checkpoint after each."""
    run = tmp_path_factory.mktemp("demo") / "straight"
    assert main([*SMALL, "--steps", "4", "--save-every", "1", "--run-dir", str(run)]) == 0
    return run


def test_resume_equals_the_uninterrupted_run(straight, tmp_path, capsys) -> None:  # noqa: ANN001
    run = tmp_path / "run"
    code, _, _ = _demo(capsys, "--steps", "3", "--save-every", "2", "--run-dir", run)
    assert code == 0
    ckpt = checkpoint_path(run, 2)
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "data.safetensors",
        "dcp",
        "meta.json",
        "rng",
    ]  # no hf/: no transformers model
    shutil.rmtree(checkpoint_path(run, 3))  # as if the run had died after step 2, its row written
    assert [r["step"] for r in _rows(run)] == [0, 1, 2]

    code, out, _ = _demo(capsys, "--steps", "4", "--resume", run)
    assert code == 0 and f"resumed {run} after step 1" in out
    assert _rows(run) == _rows(straight)  # step 2 computed again, once; every record equal
    summary = json.loads((run / "summary.json").read_text())
    expected = json.loads((straight / "summary.json").read_text())
    assert summary["losses"] == expected["losses"] and summary["rewards"] == expected["rewards"]
    assert len(summary["losses"]) == 4
    _assert_same_checkpoint(latest_checkpoint(run), latest_checkpoint(straight))


def test_resume_checks_name_the_flag(straight, tmp_path, capsys) -> None:  # noqa: ANN001
    run = tmp_path / "run"
    shutil.copytree(straight, run)
    code, out, err = _demo(capsys, "--steps", "4", "--resume", run, "--lr", "0.01")
    assert code == 2 and "--lr 0.003" in err and "--lr 0.01" in err and out == ""
    code, _, err = _demo(capsys, "--steps", "4", "--resume", run, "--mode", "trajectory")
    assert code == 2 and "--mode compact" in err
    code, _, err = _demo(capsys, "--steps", "3", "--resume", run)
    assert code == 2 and "completed 4 steps" in err
    code, _, err = _demo(capsys, "--steps", "4", "--resume", tmp_path / "none")
    assert code == 2 and "no complete checkpoint" in err
    code, _, err = _demo(capsys, "--steps", "4", "--resume", run, "--run-dir", run)
    assert code == 2 and "--resume" in err
    code, _, err = _demo(capsys, "--steps", "4", "--run-dir", run)
    assert code == 2 and "--overwrite" in err
    assert _rows(run) == _rows(straight)  # none of these touched the run


def test_a_failing_step_is_undone_and_the_completed_steps_kept(straight, tmp_path, capsys, monkeypatch) -> None:  # noqa: ANN001
    """Step 2 fails in its second update, after the first has changed the weights: the
    checkpoint holds the run after step 1 (bitwise), and resuming it finishes the run."""
    import harts.trainer.online as online

    calls = {"n": 0}
    real = online.train_step

    def failing(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls["n"] += 1
        if calls["n"] == 6:  # 2 updates per step: step 2's second
            raise RuntimeError("simulated failure")
        return real(*args, **kwargs)

    monkeypatch.setattr(online, "train_step", failing)
    run = tmp_path / "run"
    with pytest.raises(RuntimeError, match="simulated failure"):
        main([*SMALL, "--steps", "4", "--run-dir", str(run)])
    err = capsys.readouterr().err
    assert "step 2 failed (RuntimeError) after step 1; keeping the 2 completed step(s)" in err
    assert latest_checkpoint(run) == checkpoint_path(run, 2)
    _assert_same_checkpoint(checkpoint_path(run, 2), checkpoint_path(straight, 2))
    assert [r["step"] for r in _rows(run)] == [0, 1]

    monkeypatch.setattr(online, "train_step", real)
    code, _, _ = _demo(capsys, "--steps", "4", "--resume", run)
    assert code == 0 and _rows(run) == _rows(straight)
    _assert_same_checkpoint(latest_checkpoint(run), latest_checkpoint(straight))


def test_truncate_metrics_keeps_the_steps_before(tmp_path) -> None:  # noqa: ANN001
    from harts.rl.metrics import truncate_metrics

    rows = [json.dumps({"step": s}) for s in range(4)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(rows) + '\n{"step": 4, "rew')  # the last cut off
    assert truncate_metrics(str(tmp_path), 2) == 3
    assert (tmp_path / "metrics.jsonl").read_text() == rows[0] + "\n" + rows[1] + "\n"
    assert truncate_metrics(str(tmp_path), 2) == 0


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"])
def test_signal_saves_the_last_completed_step(straight, tmp_path, sig, code) -> None:  # noqa: ANN001
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "harts.cli", *SMALL, "--steps", "500", "--run-dir", str(run)]
    env = dict(os.environ, OMP_NUM_THREADS="1", HARTS_DEBUG="", TQDM_DISABLE="1")
    returncode, _, err = interrupt(cmd, sig, env, step1="1   ")  # the table row of step 1
    assert returncode == code, err
    assert "Traceback" not in err and f"harts: interrupted by {signal.Signals(sig).name} after step" in err
    ckpt = latest_checkpoint(run)
    assert ckpt is not None and f"checkpoint {ckpt}" in err and "--resume" in err
    done = _meta(ckpt)["step"]
    assert 2 <= done < 500 and [r["step"] for r in _rows(run)] == list(range(done))
    k = min(done, 4)
    assert _rows(run)[:k] == _rows(straight)[:k]
    if done <= 4:  # the straight run has checkpoints after steps 1..4
        _assert_same_checkpoint(ckpt, checkpoint_path(straight, done))


def test_resume_both_modes(tmp_path, capsys) -> None:  # noqa: ANN001
    """``--mode both`` keeps a run (and its checkpoints) per mode; --resume continues both."""
    run = tmp_path / "both"
    code, _, _ = _demo(capsys, "--steps", "1", "--mode", "both", "--run-dir", run)
    assert code == 0
    code, out, _ = _demo(capsys, "--steps", "2", "--mode", "both", "--resume", run)
    assert code == 0 and "the same rewards for 2 of 2 steps" in out
    for mode in ("compact", "trajectory"):
        assert [r["step"] for r in _rows(run / mode)] == [0, 1]
        assert latest_checkpoint(run / mode) == checkpoint_path(run / mode, 2)
