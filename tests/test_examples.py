"""``examples/chat_batch.py`` and ``examples/engine_loop.py`` run end to end, small, on the CPU
(``examples/tinker_loop.py`` has its own test under tests/serve)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from harts.tree.batch import RolloutBatch

REPO = Path(__file__).resolve().parents[1]


def _example(name: str, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TQDM_DISABLE": "1", "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    out = subprocess.run(
        [sys.executable, str(REPO / "examples" / name), *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return out


def test_chat_batch(tmp_path: Path) -> None:
    pytest.importorskip("mistral_common")
    out = _example("chat_batch.py", tmp_path, "--out", "chat dir/chat.jsonl", "--train-steps", "2")
    batch = RolloutBatch.load(str(tmp_path / "chat dir" / "chat.jsonl"))
    assert batch.num_trajectories == 7 and batch.vocab_size == 131_072
    assert "2.39x" in out.stdout and "step 1:" in out.stdout
    # the assistant's answers are the actions, the prompts are not
    assert 0 < batch.action_mask.sum() < batch.num_tokens


def test_chat_batch_reads_messages_and_names_a_bad_one(tmp_path: Path) -> None:
    pytest.importorskip("mistral_common")
    (tmp_path / "m.jsonl").write_text(
        '{"id": "u", "parent_id": null, "role": "user", "content": "hi"}\n'
        '{"id": "a", "parent_id": "u", "role": "assistant", "content": "hello", "reward": 1}\n'
        '{"id": "b", "parent_id": "u", "role": "assistant", "content": "hey", "reward": 0}\n'
    )
    out = _example("chat_batch.py", tmp_path, "--messages", "m.jsonl", "--out", "m.parquet")
    assert "2 conversations" in out.stdout and RolloutBatch.load(str(tmp_path / "m.parquet")).num_trajectories == 2


def test_engine_loop(tmp_path: Path) -> None:
    args = ["--steps", "2", "--prompts", "2", "--group-size", "2", "--max-tokens", "3", "--out", "out dir"]
    out = _example("engine_loop.py", tmp_path, *args)
    assert "step   1" in out.stdout and "reloaded: the same weights" in out.stdout
    assert (tmp_path / "out dir" / "sampler" / "model.safetensors").is_file()
    assert (tmp_path / "out dir" / "state").is_dir()
