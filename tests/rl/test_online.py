"""The online loop: per-step metrics, resumable state, compact == trajectory-wise in float64,
and (slow) a reward that rises on the built-in task."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
import torch

from harts.envs import ToolLookup
from harts.models.config import HybridConfig
from harts.models.execution.config import ExecutionConfig
from harts.models.hybrid_lm import HybridLM
from harts.rl.metrics import MetricsWriter, read_metrics
from harts.rollout.collect import RolloutConfig
from harts.trainer.online import OnlineConfig, OnlineState, OnlineTrainer
from harts.trainer.step import TrainConfig

TIMINGS = ("sample_seconds", "step_seconds", "tokens_per_second")


def _trainer(mode: str = "compact", dtype: str = "float32", tasks: int = 4, lr: float = 3e-3) -> OnlineTrainer:
    torch.manual_seed(0)
    model = HybridLM(HybridConfig.tiny(vocab_size=16, dtype=dtype))
    cfg = OnlineConfig(
        rollout=RolloutConfig(tasks=tasks),
        train=TrainConfig(lr=lr, execution=ExecutionConfig(mode=mode)),
        updates=2,
        seed=0,
    )
    return OnlineTrainer(model, ToolLookup, cfg)


def _strip(record: dict) -> dict:
    return {k: v for k, v in record.items() if k not in TIMINGS}


def test_step_metrics_and_metrics_file(tmp_path) -> None:  # noqa: ANN001
    trainer = _trainer()
    with MetricsWriter(str(tmp_path)) as writer:
        for _ in range(2):
            writer.write(trainer.step())
    records = read_metrics(str(tmp_path))
    assert [r["step"] for r in records] == [0, 1]
    for r in records:
        for key in ("reward", "kl", "clip_frac", "entropy", "compression", "mismatch", "step_seconds"):
            assert math.isfinite(r[key]), key
        assert 0 <= r["clip_frac"] <= 1 and 0 <= r["reward"] <= 1
        assert r["compression"] > 1  # the trees share their prompts and turns
        assert r["mismatch"] < 1e-4  # float32: sampler and trainer run the same layers
        assert 0 < r["entropy"] <= math.log(16) + 1e-9
    assert records[0]["kl"] == 0.0 < records[1]["kl"]  # the reference is the initial policy
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 2


def test_state_dict_resumes_the_same_run() -> None:
    a = _trainer()
    a.step()
    # what a checkpoint holds, through torch.save / torch.load (weights_only: plain types only)
    buf = io.BytesIO()
    torch.save({"online": a.state_dict(), "model": a.model.state_dict(), "opt": a.optimizer.state_dict()}, buf)
    expected = _strip(a.step())
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    b = _trainer()
    b.state = OnlineState(seed=123)  # another seed: everything must come from the checkpoint
    with torch.no_grad():
        for p in [*b.model.parameters(), *b.reference.parameters()]:
            p.add_(1.0)
    b.model.load_state_dict(saved["model"])
    b.optimizer.load_state_dict(saved["opt"])
    b.load_state_dict(saved["online"])
    assert _strip(b.step()) == expected
    assert b.state.step == 2 and len(b.state.history) == 2


def test_compact_and_trajectory_runs_agree_float64() -> None:
    runs = {}
    for mode in ("compact", "trajectory"):
        t = _trainer(mode, "float64")
        runs[mode] = [t.step() for _ in range(3)]
    for c, t in zip(runs["compact"], runs["trajectory"]):
        assert c["reward"] == t["reward"] and c["raw_tokens"] == t["raw_tokens"]
        assert abs(c["loss"] - t["loss"]) < 1e-9
        assert abs(c["kl"] - t["kl"]) < 1e-9 and abs(c["entropy"] - t["entropy"]) < 1e-9
        assert c["mismatch"] < 1e-9 and t["mismatch"] < 1e-9


@pytest.mark.slow
def test_reward_rises_on_tool_lookup() -> None:
    """The demo's claim (its defaults: 32 tasks, 60 steps): the mean reward of the last 5 steps is
    at least twice the first 5 steps', and above guessing a value without reading the tool."""
    t = _trainer(tasks=32)
    rewards = [t.step()["reward"] for _ in range(60)]
    first, last = np.mean(rewards[:5]), np.mean(rewards[-5:])
    assert last >= 2 * first
    assert last > 1.2 / ToolLookup().num_values


def test_a_run_is_deterministic() -> None:
    a, b = _trainer(), _trainer()
    for _ in range(2):
        assert _strip(a.step()) == _strip(b.step())


def test_restore_undoes_a_step_bitwise() -> None:
    """``snapshot`` / ``restore`` (what ``harts demo`` undoes a half-done step with): a step
    taken after restoring equals the step taken from the snapshot's moment."""
    t = _trainer(dtype="float64")
    t.step()
    snap = t.snapshot()
    first = _strip(t.step())
    weights = {n: p.detach().clone() for n, p in t.model.named_parameters()}
    t.restore(snap)
    assert t.state.step == 1 and len(t.state.history) == 1
    assert _strip(t.step()) == first
    assert all(torch.equal(p, weights[n]) for n, p in t.model.named_parameters())
