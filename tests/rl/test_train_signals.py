"""SIGINT / SIGTERM during ``harts train``: the weights after the last completed step are saved,
they load, the completed steps' logs are written, and the exit status is 130 / 143."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from harts.integrations.loading import load_model
from harts.trainer.weights import load_state
from harts.tree.workloads import generate

CLI = "import sys; from harts.cli import main; sys.exit(main())"
ARGS = ["train", "--workload", "tiny", "--pattern", "KM", "--threads", "1"]
LONG = ["--steps", "500"]


def replay(tmp_path: Path, *steps: int) -> list[dict[str, torch.Tensor]]:
    """The weights ``harts train`` saves after each of ``steps`` completed steps, from runs that
    are not interrupted: the same command and code path as the interrupted run (its own process,
    one thread), so the two must agree bit for bit on any CPU. A replay through ``train_step``
    inside the pytest worker (whose torch state earlier tests shaped, without the run's
    prefetched plans) landed about 2e-6 relative away on a fresh 2-core machine: AdamW's
    normalised update turns last-bit differences of small gradients into lr-sized ones, so no
    tolerance derived from one step's rounding bounds a few steps of it."""
    env = dict(os.environ, OMP_NUM_THREADS="1", HARTS_DEBUG="", TQDM_DISABLE="1")
    runs = []
    for n in steps:
        save = tmp_path / f"replay-{n}"
        cmd = [sys.executable, "-c", CLI, *ARGS, "--steps", str(n), "--save", str(save)]
        runs.append((save, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)))
    out = []
    for save, proc in runs:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        out.append(load_state(str(save)))
    return out


def interrupt(cmd: list[str], sig: int, env: dict[str, str], step1: str = "step 1:") -> tuple[int, str, str]:
    """Run ``cmd``, send ``sig`` once two steps have completed (a stdout line starting with
    ``step1``, leading spaces aside); (exit status, stdout, stderr)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        for line in proc.stdout:  # wait until two steps have completed, then interrupt the run
            if line.lstrip().startswith(step1):
                break
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=200)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, out, err


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"])
def test_signal_saves_the_last_completed_step(tmp_path, sig, code):
    save, log = tmp_path / "ckpt", tmp_path / "log.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", HARTS_DEBUG="")
    returncode, out, err = interrupt(
        [sys.executable, "-c", CLI, *ARGS, *LONG, "--save", str(save), "--json", str(log)], sig, env
    )
    assert returncode == code, err
    assert "Traceback" not in err
    assert f"harts: interrupted by {signal.Signals(sig).name} after step" in err

    record = json.loads(log.read_text())
    done = record["interrupted"]["completed_steps"]
    assert record["interrupted"]["signal"] == signal.Signals(sig).name
    assert 2 <= done < 500 and [s["step"] for s in record["steps"]] == list(range(done))
    assert f"saved to {save} (weights after step {done - 1})" in out

    saved = load_state(str(save))
    expected, fewer = replay(tmp_path, done, done - 1)
    assert saved.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(saved[name], value), name
    # and the saved weights are not those of one step fewer
    assert any(not torch.equal(saved[n], fewer[n]) for n in fewer)
    assert not list(save.glob("*.tmp")) and not list(tmp_path.glob(".log.json*"))


def test_signal_writes_a_resumable_checkpoint(tmp_path):
    """With --run-dir, SIGTERM also writes the full checkpoint of the last completed step."""
    from harts.parallel.checkpoint import latest_checkpoint, load_checkpoint

    run = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1", HARTS_DEBUG="", TQDM_DISABLE="1")
    returncode, _, err = interrupt(
        [sys.executable, "-c", CLI, *ARGS, *LONG, "--run-dir", str(run)], signal.SIGTERM, env
    )
    assert returncode == 143, err
    ckpt = latest_checkpoint(run)
    assert ckpt is not None and f"checkpoint {ckpt}" in err
    model = load_model("tiny", vocab_size=generate("tiny").vocab_size, dtype="float32", layer_pattern="KM", seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    state = load_checkpoint(ckpt, model=model, optimizer=opt)
    assert state.step >= 2 and state.data_state == {"next_step": state.step, "replicas": 1}
    (expected,) = replay(tmp_path, state.step)
    for name, value in expected.items():
        assert torch.equal(model.state_dict()[name], value), name
    assert opt.state and all(int(s["step"]) == state.step for s in opt.state.values())
