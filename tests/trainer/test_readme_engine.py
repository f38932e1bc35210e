"""The README's engine example runs as written (it is the first thing a user copies)."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def _engine_example() -> str:
    text = README.read_text()
    section = text[text.index("### 3. Train from your own RL loop") :]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "the README's engine section has no python example"
    return match.group(1)


def test_readme_engine_example_runs(tmp_path: pathlib.Path) -> None:
    code = _engine_example()
    assert len(code.strip().splitlines()) <= 15
    (tmp_path / "example.py").write_text(code)
    run = subprocess.run([sys.executable, "example.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert re.search(r"loss -?\d+\.\d+, grad norm \d+\.\d+, log-probs per rollout \[4, 3\]", run.stdout), run.stdout
    assert (tmp_path / "ckpt" / "step1" / "state.json").is_file()
    assert (tmp_path / "ckpt" / "sampler1" / "model.safetensors").is_file()
