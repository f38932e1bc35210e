"""The tinker-cookbook's own ``sl_loop`` and ``rl_loop`` recipes, unedited, train against ``harts serve``.

The cookbook pins transformers <= 5.5.4, below harts' ``hf`` extra, so it runs as a client from a
virtual environment of its own (built once under the user's cache directory: ``cookbook_python``),
as docs/SERVE.md tells users to. The recipes ask for ``Qwen/Qwen3.5-9B-Base``'s tokenizer and the
``HuggingFaceH4/no_robots`` / ``openai/gsm8k`` datasets by name; ``_cookbook_fixture.py`` files
small stand-ins under those names in a Hugging Face cache the client reads offline, and the
server serves a tiny model of that tokenizer's vocabulary under the recipes' model name.

Slow: the first run installs the client environment (a few minutes), and the two recipes then
take about two minutes on two cores.
"""

from __future__ import annotations

import fcntl
import importlib.metadata
import json
import math
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.serve._server import Server, serving

pytestmark = pytest.mark.slow

#: the release pip resolves beside harts' ``serve`` extra (the next needs a tml-renderers the
#: registry does not have)
COOKBOOK = "0.5.8"
MODEL_NAME = "Qwen/Qwen3.5-9B-Base"
FIXTURE = Path(__file__).with_name("_cookbook_fixture.py")
STEPS = 5


def _cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "harts"


def cookbook_python() -> Path:
    """The Python of a virtual environment with tinker-cookbook ``COOKBOOK`` (and its math-rl extra,
    which ``rl_loop`` imports), the tinker SDK and the torch this environment has; built on first
    use under the cache directory, kept for later runs."""
    tinker = importlib.metadata.version("tinker")
    torch = importlib.metadata.version("torch").split("+")[0]
    py = f"{sys.version_info[0]}{sys.version_info[1]}"
    venv = _cache_root() / f"cookbook-{COOKBOOK}-tinker-{tinker}-torch-{torch}-py{py}"
    python, ready = venv / "bin" / "python", venv / "ready"
    packages = [f"torch=={torch}", f"tinker=={tinker}", f"tinker-cookbook[math-rl]=={COOKBOOK}"]
    venv.parent.mkdir(parents=True, exist_ok=True)
    # one build at a time (pytest-xdist workers, parallel sessions); "ready" is written last, so a
    # build that was cut off is started over
    with open(venv.parent / f"{venv.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not ready.is_file() or ready.read_text().split() != packages:
            shutil.rmtree(venv, ignore_errors=True)
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
            subprocess.run([str(python), "-m", "pip", "install", "--quiet", *packages], check=True, timeout=1800)
            ready.write_text(" ".join(packages) + "\n")
    return python


@dataclass
class Cookbook:
    python: Path
    server: Server
    workdir: Path
    env: dict[str, str]

    def run(self, recipe: str, *args: str) -> tuple[list[dict], str]:
        """``python -m tinker_cookbook.recipes.RECIPE base_url=... log_path=... ARGS`` in the client
        environment; its metrics.jsonl rows and its log (logs.log)."""
        log_path = self.workdir / recipe
        cmd = [str(self.python), "-m", f"tinker_cookbook.recipes.{recipe}", f"base_url={self.server.url}"]
        cmd += [f"log_path={log_path}", *args]
        proc = subprocess.run(cmd, env=self.env, cwd=self.workdir, capture_output=True, text=True, timeout=1200)
        output = f"{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"
        assert proc.returncode == 0, f"{recipe} exited with {proc.returncode}:\n{output}"
        rows = [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines() if line.strip()]
        return rows, (log_path / "logs.log").read_text()


def _served_model(directory: Path, tokenizer_dir: Path) -> None:
    """harts' tiny preset with the fixture tokenizer's vocabulary, saved as a checkpoint directory."""
    from transformers import AutoTokenizer

    from harts.integrations.native import save_native
    from harts.models.config import HybridConfig
    from harts.models.hybrid_lm import HybridLM

    vocab = len(AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True))
    save_native(HybridLM(HybridConfig.preset("tiny", vocab_size=vocab), seed=0), directory)


@pytest.fixture(scope="module")
def cookbook(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cookbook]:
    if sys.version_info < (3, 11):
        pytest.skip("tinker-cookbook needs Python 3.11 or newer")
    python = cookbook_python()
    workdir = tmp_path_factory.mktemp("cookbook run")
    hf_home, tokenizer_dir, model_dir = workdir / "hf home", workdir / "tokenizer", workdir / "model"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(HF_HOME=str(hf_home), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TINKER_TELEMETRY="0")
    env.update(TINKER_COOKBOOK_RUNS_DIR=str(workdir / "runs"))
    subprocess.run([str(python), str(FIXTURE), str(hf_home), str(tokenizer_dir)], env=env, check=True, timeout=600)
    _served_model(model_dir, tokenizer_dir)
    extra = ("--model-name", MODEL_NAME, "--tokenizer", str(tokenizer_dir))
    with serving(str(model_dir), workdir, *extra) as server:
        yield Cookbook(python, server, workdir, {**env, "TINKER_API_KEY": server.api_key})


def test_sl_loop_trains(cookbook: Cookbook) -> None:
    """sl_loop: cross-entropy on no_robots conversations, STEPS optimizer steps, then its final save."""
    rows, _ = cookbook.run("sl_loop", "batch_size=4", f"max_steps={STEPS}", "lora_rank=4", "max_length=256")
    assert len(rows) == STEPS
    for row in rows:
        assert row["num_sequences"] == 4 and math.isfinite(row["train_mean_nll"]) and row["grad_norm"] > 0
    final = json.loads((cookbook.workdir / "sl_loop" / "checkpoints.jsonl").read_text().splitlines()[-1])
    assert final["name"] == "final" and final["state_path"].startswith("tinker://")
    assert final["sampler_path"].startswith("tinker://")


def test_rl_loop_trains(cookbook: Cookbook) -> None:
    """rl_loop: samples groups with the renderer's string stop sequence, grades them, and takes an
    importance-sampling step on every batch (none skipped for equal rewards), then its final save.
    With about one sample in seven rewarded, a batch of 4 groups of 16 is skipped once in ~10^4."""
    args = ("batch_size=4", "group_size=16", f"max_steps={STEPS}", "lora_rank=4", "max_tokens=48")
    rows, log = cookbook.run("rl_loop", *args)
    assert "skipping training step" not in log
    assert len(rows) == STEPS
    for row in rows:
        assert row["grad_norm"] > 0 and 0 < row["reward/total"] < 1
    final = json.loads((cookbook.workdir / "rl_loop" / "checkpoints.jsonl").read_text().splitlines()[-1])
    assert final["name"] == "final" and final["sampler_path"].startswith("tinker://")
