"""``scripts/multi_gpu.sh`` and its python entry points (``benchmarks.step.multi_gpu``), on CPU with gloo."""

from __future__ import annotations

import copy
import json
import os
import subprocess

import pytest

from benchmarks.step.multi_gpu import _group, compare, main

SMALL = ["--model", "tiny", "--workload", "tiny", "--capacity", "400", "--threads", "1"]


def test_parameter_groups():
    assert _group("embed_tokens.weight") == "embed_tokens"
    assert _group("layers.3.mlp.experts.gate_up_proj") == "layers.3.mlp.experts"
    assert _group("layers.3.mlp.gate.weight") == "layers.3.mlp.gate"
    assert _group("layers.0.mlp.up_proj.weight") == "layers.0.mlp"
    assert _group("layers.2.self_attn.q_proj.weight") == "layers.2.self_attn"


def test_correctness_entry_and_compare(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    for out in (a, b):
        assert main(["correctness", "--replicas", "2", *SMALL, "--out", str(out)]) == 0
    one, rerun = json.loads(a.read_text()), json.loads(b.read_text())
    assert one["microbatches"] >= 2 and one["expert_counts"] and len(one["grad_norms"]) > 5
    assert compare(one, rerun, one, floor=1e-5)["passed"]
    # a gradient norm off by more than the tolerance is caught, and named
    bad = copy.deepcopy(one)
    key = sorted(bad["grad_norms"])[0]
    bad["grad_norms"][key] *= 1 + 1e-3
    result = compare(one, rerun, bad, floor=1e-5)
    assert not result["passed"] and result["failed"] == [f"grad_norm[{key}]"]


@pytest.mark.slow
def test_script_on_two_cpu_processes(tmp_path):
    env = dict(
        os.environ,
        DEVICE="cpu",
        NGPUS="2",
        PYTHON="python",
        OMP_NUM_THREADS="1",
        CORR_MODEL="--model tiny",
        CORR_WORK="--workload tiny --capacity 400",
        CORR_EP="2",
        SCALE_DS="1 2",
        SCALE_MODEL="--model tiny",
        SCALE_WORK="--workload tiny --steps 1",
        SCALE_FLAGS="--dtype float32 --capacity 400",
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run(
        ["bash", os.path.join(root, "scripts", "multi_gpu.sh"), str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads((tmp_path / "correctness.json").read_text())["passed"]
    for d in (1, 2):
        scaling = json.loads((tmp_path / f"scaling_D{d}.json").read_text())
        for mode in ("compact", "trajectory"):
            step = scaling["modes"][mode][0]
            assert len(step["replica_seconds_measured"]) == len(step["replica_seconds_predicted"]) == d
            assert step["tokens_per_second_per_gpu"] > 0


def test_scaling_counts_the_flops_each_mode_executes():
    """MFU in the scaling report: harts is charged its compact rows and tree pairs, the baseline
    its raw rows and causal pairs (the counts ``harts bench`` uses), over every replica."""
    import numpy as np

    from benchmarks.step.multi_gpu import _executed_flops, _raw_flops
    from harts.models import HybridConfig, HybridLM
    from harts.models.execution.config import ExecutionConfig
    from harts.models.flops import FlopModel
    from harts.plan.step import plan_step
    from harts.tree.workloads import generate

    model = HybridLM(HybridConfig.tiny(vocab_size=256))
    batch = generate("tiny")
    plan = plan_step(batch, dp=2, capacity=4096)
    fm = FlopModel.from_model(model)
    compact = _executed_flops(model, batch, plan, ExecutionConfig(mode="compact"), fm)
    traj = _raw_flops(batch, fm)  # the baseline executes every raw row, whatever its microbatches
    lengths = batch.lengths.astype(np.int64)
    raw = fm.training_flops(
        batch.num_tokens, len(batch.predicting_positions()), int((lengths * (lengths + 1) // 2).sum())
    )
    assert traj == raw
    assert 0 < compact < traj


def test_bad_recompute_skip_is_an_argument_error(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(
            [
                "correctness",
                "--replicas",
                "2",
                *SMALL,
                "--out",
                str(tmp_path / "a.json"),
                "--recompute-skip",
                "attention",
            ]
        )
    assert exit_.value.code == 2
    assert "needs recompute=True" in capsys.readouterr().err
