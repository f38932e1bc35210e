"""``harts bench`` times the step that ships: every run of either side (warm-up, timed runs,
Core run, profile) is ``harts.trainer.step.accumulate_step_gradients``, and the bench holds no
microbatch loop of its own."""

from __future__ import annotations

import ast
import pathlib

import torch

import harts
import harts.experiments
import harts.trainer.step as trainer_step
from harts.experiments.step_bench import bench_step, profile_step
from harts.tree.workloads import generate


def _model() -> harts.HybridLM:
    torch.manual_seed(0)
    return harts.HybridLM(harts.HybridConfig.tiny(vocab_size=256, layer_pattern="KM"))


def test_every_run_of_both_sides_is_accumulate_step_gradients(monkeypatch, tmp_path) -> None:
    calls: list[tuple[str, bool, int, bool]] = []
    real = trainer_step.accumulate_step_gradients

    def counting(model, batch, cfg, **kw):  # noqa: ANN001, ANN003, ANN202
        prepared = kw.get("prepared") is not None
        calls.append((cfg.execution.mode, prepared, len(kw["microbatches"]), kw.get("observer") is not None))
        return real(model, batch, cfg, **kw)

    monkeypatch.setattr(trainer_step, "accumulate_step_gradients", counting)
    model, batch = _model(), generate("tiny", step=1)
    r = bench_step(model, batch, capacity=400, repeats=2, profile_dir=str(tmp_path / "prof"))
    nb, nh = r.baseline.microbatches, r.harts.microbatches
    assert nb > 1 and nh > 1
    base = [c for c in calls if c[0] == "trajectory"]
    harts_calls = [c for c in calls if c[0] == "compact"]
    # per side: the warm-up (a few microbatches), two timed runs (all, watched), the profile (one)
    for side, n in ((base, nb), (harts_calls[:4], nh)):
        assert side[0][1] and 1 <= side[0][2] <= n  # the warm-up: prepared ahead
        assert side[1:3] == [(side[0][0], True, n, True)] * 2  # the timed runs: prepared ahead, observed
        assert side[3] == (side[0][0], True, 1, False)  # the profile's microbatch
    assert len(base) == 4
    # harts' Core runs: each microbatch prepared inside the step, as ``harts train`` does
    assert harts_calls[4:] == [("compact", False, nh, True)] * 2
    assert all(p.grad is None for p in model.parameters())

    calls.clear()
    profile_step(model, batch, str(tmp_path / "only"), capacity=400)
    assert [c[:3] for c in calls] == [("trajectory", True, 1), ("trajectory", True, 1)] + [("compact", True, 1)] * 2


def test_the_bench_runs_no_microbatch_of_its_own() -> None:
    """No module of ``harts.experiments`` calls a loss, ``backward`` or the model's forward: the
    one microbatch loop is the trainer's."""
    root = pathlib.Path(harts.experiments.__file__).parent
    found = []
    for path in sorted(root.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute | ast.Name):
                name = node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id
                if name in ("backward", "grpo_loss", "moe_objective", "model"):
                    found.append(f"{path.name}:{node.lineno} {name}")
    assert not found, found
