"""``examples/tinker_loop.py`` runs end to end (a few steps of SFT and RL, then both saves)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.serve._server import REPO

pytest.importorskip("tinker")
pytest.importorskip("fastapi")


def test_tinker_loop_example_runs(tmp_path):
    env = {**os.environ, "TINKER_TELEMETRY": "0"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    args = ["--sft-steps", "3", "--rl-steps", "2", "--batch-size", "4", "--group-size", "4"]
    args += ["--state-dir", str(tmp_path / "state dir")]
    out = subprocess.run(
        [sys.executable, str(REPO / "examples" / "tinker_loop.py"), *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "sft step   2" in out.stdout and "rl step   1" in out.stdout, out.stdout
    state = next(line.split()[1] for line in out.stdout.splitlines() if line.startswith("state "))
    model_id = state.removeprefix("tinker://").split("/")[0]
    run = tmp_path / "state dir" / "runs" / model_id
    assert (run / "weights" / "final").is_dir() and (run / "sampler_weights" / "final" / "config.json").is_file()
