"""``scripts/multi_gpu.sh`` and its python entry points (``benchmarks.step.multi_gpu``), on CPU with gloo."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

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
        PYTHON=sys.executable,
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


def _context_env(ngpus: int) -> dict:
    """The script's context part with the GPU model swapped for the tiny one (its commands
    otherwise as written for GPUs), gloo processes."""
    return dict(
        os.environ,
        DEVICE="cpu",
        NGPUS=str(ngpus),
        PYTHON=sys.executable,
        OMP_NUM_THREADS="1",
        PARTS="context",
        CP_MODEL="--model tiny",
        CP_TS="400",
        CP_CS="2",
        CP_WORK="--workload tiny --steps 1",
        CP_FLAGS="--dtype float32 --threads 1",
    )


def _script(tmp_path, env: dict) -> subprocess.CompletedProcess:  # noqa: ANN001
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cmd = ["bash", os.path.join(root, "scripts", "multi_gpu.sh"), str(tmp_path)]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)


def test_context_part_at_world_size_one(tmp_path):
    """One device: the one-GPU runs of the context part (correctness twice, scaling) run, C = 1
    runs through torchrun, and C = 2 is skipped (C > N); the tensor part runs the same with --tp."""
    r = _script(tmp_path, {**_context_env(1), "CP_CS": "1 2", "PARTS": "context tensor", "TP_TS": "400", "TP_PS": "1"})
    assert r.returncode == 0, r.stdout + r.stderr
    scale = json.loads((tmp_path / "cp_scale_T400_C1.json").read_text())
    assert scale["cp"] == 1 and scale["modes"]["compact"][0]["step_seconds"] > 0
    one, rerun = (json.loads((tmp_path / f"cp_corr_T400_{n}.json").read_text()) for n in ("one", "rerun"))
    assert compare(one, rerun, one, floor=1e-5)["passed"]
    # CP_CS="1": the C-rank commands as written (through torchrun) at world size 1, equal to
    # one process within the reruns' noise
    assert json.loads((tmp_path / "cp_correctness_T400_cp1.json").read_text())["passed"]
    assert json.loads((tmp_path / "cp_scale_T400_cp1.json").read_text())["world_size"] == 1
    assert not (tmp_path / "cp_scale_T400_cp2.json").exists()
    # the tensor part: the same runs with --tp (files tp_*)
    assert json.loads((tmp_path / "tp_correctness_T400_tp1.json").read_text())["passed"]
    eff = json.loads((tmp_path / "tp_eff_T400_tp1.json").read_text())
    assert eff["tp"] == 1 and eff["ranks"] == 1


@pytest.mark.slow
def test_context_part_on_two_cpu_processes(tmp_path):
    r = _script(tmp_path, _context_env(2))
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads((tmp_path / "cp_correctness_T400_cp2.json").read_text())["passed"]
    eff = json.loads((tmp_path / "cp_eff_T400_cp2.json").read_text())
    assert eff["cp"] == 2 and eff["modes"]["compact"][0]["efficiency"] > 0


def test_efficiency_of_a_context_parallel_group():
    from benchmarks.step.multi_gpu import efficiency

    def run(world: int, seconds: float, peak: float) -> dict:
        step = {"step": 0, "step_seconds": seconds, "peak_gib_per_rank": [peak] * world}
        return {"world_size": world, "cp": world, "capacity": 131_072, "modes": {"compact": [step]}}

    e = efficiency(run(1, 10.0, 60.0), run(4, 3.125, 16.0))
    assert e["modes"]["compact"][0]["efficiency"] == pytest.approx(0.8)
    assert e["modes"]["compact"][0]["peak_ratio"] == pytest.approx(16 / 60)
    with pytest.raises(ValueError, match="different T"):
        efficiency(run(1, 10.0, 60.0), {**run(2, 6.0, 30.0), "capacity": 65_536})


def test_the_gpu_model_splits_over_cp_4():
    """qwen3_next_80b_a3b (the context part's GPU model): heads and conv channels divide by 2 and 4."""
    from harts.models import HybridConfig
    from harts.parallel.context_parallel import check_context_parallel

    cfg = HybridConfig.preset("qwen3_next_80b_a3b", layers=8)
    for cp in (2, 4):
        check_context_parallel(cfg, cp)
