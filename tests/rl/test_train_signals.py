"""SIGINT / SIGTERM during ``harts train``: the weights after the last completed step are saved,
they load, the completed steps' logs are written, and the exit status is 130 / 143."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from harts import ExecutionConfig
from harts.integrations.loading import load_model
from harts.trainer.step import TrainConfig, train_step
from harts.trainer.weights import load_state
from harts.tree.workloads import generate

CLI = "import sys; from harts.cli import main; sys.exit(main())"
ARGS = ["train", "--workload", "tiny", "--steps", "500", "--pattern", "KM", "--threads", "1"]


def replay(steps: int) -> torch.nn.Module:
    """What ``harts train`` computes in ``steps`` steps (same preset, seed, config, optimizer)."""
    torch.set_num_threads(1)
    model = load_model("tiny", vocab_size=generate("tiny").vocab_size, dtype="float32", layer_pattern="KM", seed=0)
    cfg = TrainConfig(capacity=65_536, execution=ExecutionConfig(attention="auto"))
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    for s in range(steps):
        train_step(model, opt, generate("tiny", step=s, seed=0), cfg, step=s)
    return model


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
        [sys.executable, "-c", CLI, *ARGS, "--save", str(save), "--json", str(log)], sig, env
    )
    assert returncode == code, err
    assert "Traceback" not in err
    assert f"harts: interrupted by {signal.Signals(sig).name} after step" in err

    record = json.loads(log.read_text())
    done = record["interrupted"]["completed_steps"]
    assert record["interrupted"]["signal"] == signal.Signals(sig).name
    assert 2 <= done < 500 and [s["step"] for s in record["steps"]] == list(range(done))
    assert f"saved to {save} (weights after step {done - 1})" in out

    saved = {"state_dict": load_state(str(save))}
    expected = replay(done).state_dict()
    assert saved["state_dict"].keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(saved["state_dict"][name], value, rtol=1e-5, atol=1e-7, msg=name)
    # and the saved weights are not those of one step more or less
    fewer = replay(done - 1).state_dict()
    assert any(not torch.allclose(saved["state_dict"][n], fewer[n], rtol=1e-5, atol=1e-7) for n in fewer)
    assert not list(save.glob("*.tmp")) and not list(tmp_path.glob(".log.json*"))


def test_signal_writes_a_resumable_checkpoint(tmp_path):
    """With --run-dir, SIGTERM also writes the full checkpoint of the last completed step."""
    from harts.parallel.checkpoint import latest_checkpoint, load_checkpoint

    run = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1", HARTS_DEBUG="", TQDM_DISABLE="1")
    returncode, _, err = interrupt([sys.executable, "-c", CLI, *ARGS, "--run-dir", str(run)], signal.SIGTERM, env)
    assert returncode == 143, err
    ckpt = latest_checkpoint(run)
    assert ckpt is not None and f"checkpoint {ckpt}" in err
    model = replay(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    state = load_checkpoint(ckpt, model=model, optimizer=opt)
    assert state.step >= 2 and state.data_state == {"next_step": state.step, "replicas": 1}
    expected = replay(state.step).state_dict()
    for name, value in expected.items():
        torch.testing.assert_close(model.state_dict()[name], value, rtol=1e-5, atol=1e-7, msg=name)
    assert opt.state and all(int(s["step"]) == state.step for s in opt.state.values())
