"""The step planner with worker processes makes the plan it makes alone, bit for bit."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import warnings

import numpy as np
import pytest

import harts
from harts.plan.step import PlannerWorkers, plan_step
from harts.plan.step import planner as planner_module
from harts.plan.step.step_plan import same_step_plan
from harts.plan.step.workers import completed, run_inline, shared_workers
from harts.trainer.step import TrainConfig
from harts.tree.compact import prefix_index


@pytest.fixture(scope="module")
def workers():
    with PlannerWorkers(2, min_paths=0) as w:
        w.wait_ready()
        yield w


def _cases():
    # (workload, step, dp, capacity, n0): the exact contiguous DP (N <= N0) and the evolved
    # candidates (N > N0, here by a small N0), light and tight capacities, several D
    yield "small", 0, 2, 4096, 512
    yield "small", 1, 4, 2048, 512
    yield "small", 2, 2, 4096, 8
    yield "medium", 0, 8, 65536, 512
    yield "medium", 2, 4, 32768, 512
    yield "medium", 3, 8, 32768, 64


@pytest.mark.parametrize("workload,step,dp,capacity,n0", list(_cases()))
def test_workers_make_the_serial_plan(workers, workload: str, step: int, dp: int, capacity: int, n0: int) -> None:
    batch = harts.workloads.generate(workload, step=step, seed=3)
    index = prefix_index(batch)
    alone = plan_step(index, dp=dp, capacity=capacity, n0=n0)
    both = plan_step(index, dp=dp, capacity=capacity, n0=n0, workers=workers)
    assert same_step_plan(alone, both)
    assert alone.info["winner"] == both.info["winner"]
    assert alone.info["workers"] == 0 and both.info["workers"] == 2
    paper = dict(dp=dp, capacity=capacity, n0=n0, extensions=False)
    assert same_step_plan(plan_step(index, **paper), plan_step(index, **paper, workers=workers))


@pytest.mark.parametrize("workload,step,dp,capacity,n0", list(_cases())[2:])
def test_the_winners_polish_comes_from_a_worker(workers, monkeypatch, workload, step, dp, capacity, n0) -> None:
    # the polish of whichever candidate wins was started in a worker before the winner was known
    batch = harts.workloads.generate(workload, step=step, seed=3)
    index = prefix_index(batch)
    inline = []
    real = planner_module._polish
    monkeypatch.setattr(planner_module, "_polish", lambda *a: inline.append(1) or real(*a))
    plan_step(index, dp=dp, capacity=capacity, n0=n0, workers=workers)
    assert inline == []
    plan_step(index, dp=dp, capacity=capacity, n0=n0)
    assert inline == [1]


def test_workers_with_more_polished_candidates(workers, monkeypatch) -> None:
    # candidates beyond the winner are polished on demand, in this process: still the same plan
    batch = harts.workloads.generate("medium", step=1, seed=0)
    index = prefix_index(batch)
    monkeypatch.setattr(planner_module, "BALANCE_CANDIDATES", 3)
    assert same_step_plan(
        plan_step(index, dp=4, capacity=32768), plan_step(index, dp=4, capacity=32768, workers=workers)
    )


def _die() -> None:
    os._exit(3)


def test_a_dead_worker_falls_back_to_this_process() -> None:
    batch = harts.workloads.generate("small", step=0, seed=1)
    index = prefix_index(batch)
    alone = plan_step(index, dp=2, capacity=4096)
    with PlannerWorkers(1, min_paths=0) as w:
        w.wait_ready()
        w.submit(_die)  # breaks the pool
        with pytest.warns(RuntimeWarning, match="step-planner worker process failed"):
            plan = plan_step(index, dp=2, capacity=4096, workers=w)
            # a broken pool is only noticed when a task's result is read: read until it is
            for _ in range(20):
                if not w.active:
                    break
                plan = plan_step(index, dp=2, capacity=4096, workers=w)
        assert not w.active
        assert same_step_plan(alone, plan)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            again = plan_step(index, dp=2, capacity=4096, workers=w)  # inline, no new warning
        assert same_step_plan(alone, again) and again.info["workers"] == 0


def test_small_steps_plan_in_this_process(workers) -> None:
    batch = harts.workloads.generate("small", step=0, seed=1)
    index = prefix_index(batch)
    few = PlannerWorkers(1, min_paths=batch.num_trajectories + 1)
    try:
        assert few.used_for(batch.num_trajectories + 1) and not few.used_for(batch.num_trajectories)
        plan = plan_step(index, dp=2, capacity=4096, workers=few)
        assert plan.info["workers"] == 0
        assert same_step_plan(plan, plan_step(index, dp=2, capacity=4096, workers=workers))
    finally:
        few.close()
    assert not few.used_for(10**9)
    with pytest.raises(ValueError, match="min_paths"):
        PlannerWorkers(1, min_paths=-1)


def test_workers_ignore_ctrl_c(workers) -> None:
    # Ctrl-C reaches the whole process group: the workers leave it to the parent (no traceback
    # from each of them, no broken pool mid-plan)
    import signal

    from harts.plan.step.workers import _sigint_handler

    assert workers.submit(_sigint_handler).result() == signal.SIG_IGN


def test_closed_workers_plan_inline() -> None:
    w = PlannerWorkers(1)
    w.close()
    assert not w.active
    batch = harts.workloads.generate("tiny", step=0)
    plan = plan_step(batch, dp=1, capacity=4096, workers=w)
    assert plan.info["workers"] == 0


def test_inline_tasks_run_only_when_asked() -> None:
    calls = []
    task = run_inline(calls.append, 1)
    assert calls == []
    assert task.result() is None and task.result() is None
    assert calls == [1]
    assert completed(np.arange(3)).result().tolist() == [0, 1, 2]


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_bad_worker_counts_are_clear_errors(bad) -> None:
    with pytest.raises(ValueError, match="positive integer"):
        PlannerWorkers(bad)


def test_shared_workers_and_train_config() -> None:
    assert shared_workers(0) is None
    with pytest.raises(ValueError, match="integer >= 0"):
        shared_workers(-2)
    with pytest.raises(ValueError, match="planner_workers must be an integer >= 0"):
        TrainConfig(planner_workers=-1)
    assert TrainConfig().planner_workers == 0


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "harts.cli", *args], capture_output=True, text=True, timeout=300)


def test_plan_command_reports_both_timings(tmp_path, capsys, monkeypatch) -> None:
    import json

    import harts.plan.step.workers as planner_workers
    from harts.cli import main

    out = tmp_path / "plan.json"
    argv = ["plan", "--workload", "small", "--steps", "2", "--dp", "2", "--planner-workers", "2", "--json", str(out)]
    monkeypatch.setattr(planner_workers, "MIN_PATHS", 0)  # small steps: plan them with the workers anyway
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "harts s (2 workers)" in text and "harts s (serial)" in text and "the same plans" in text
    rec = json.loads(out.read_text())
    assert rec["planner_workers"] == 2
    assert all(s["harts"]["same_plan_serial"] for s in rec["steps"])
    # below MIN_PATHS the steps are planned alone: one timing column
    monkeypatch.setattr(planner_workers, "MIN_PATHS", 10**9)
    assert main([*argv, "--overwrite"]) == 0
    text = capsys.readouterr().out
    assert "harts s (serial)" not in text and "harts s" in text


def test_plan_command_rejects_a_bad_worker_count() -> None:
    r = _cli("plan", "--workload", "tiny", "--planner-workers", "many")
    assert r.returncode == 2
    assert "--planner-workers" in r.stderr and "Traceback" not in r.stderr


def test_the_option_help_names_the_threshold() -> None:
    import argparse

    from harts.commands._inputs import add_planner_workers_argument
    from harts.plan.step.workers import MIN_PATHS

    p = argparse.ArgumentParser()
    add_planner_workers_argument(p)
    assert f"fewer than {MIN_PATHS:,} trajectories" in p.format_help().replace("\n", " ").replace("  ", " ")


def test_training_plans_with_workers(monkeypatch) -> None:
    from dataclasses import replace

    import harts.plan.step.workers as planner_workers
    from harts.trainer.step import plan_training_step

    monkeypatch.setattr(planner_workers, "MIN_PATHS", 0)
    batch = harts.workloads.generate("small", step=0, seed=4)
    alone_cfg = TrainConfig(capacity=4096)
    alone = plan_training_step(batch, alone_cfg, world=2)
    both = plan_training_step(batch, replace(alone_cfg, planner_workers=2), world=2)
    assert both.plan.info["workers"] == 2 and alone.plan.info["workers"] == 0
    assert same_step_plan(alone.plan, both.plan)
    assert shared_workers(2) is shared_workers(2)  # one pool per process and count


_POOL: list[PlannerWorkers] = []


def _pool() -> PlannerWorkers:
    if not _POOL or not _POOL[0].active:
        _POOL[:] = [PlannerWorkers(2, min_paths=0)]
    return _POOL[0]


@pytest.fixture(scope="module", autouse=False)
def _close_pool():
    yield
    for w in _POOL:
        w.close()


def test_workers_on_random_forests(_close_pool) -> None:
    """Adversarial trees (forks at and around chunk boundaries, prefix and duplicate
    trajectories, several roots), tight and loose capacities, D up to 4, both search paths
    (exact DP and evolution, by N0): the plan with workers is the serial plan."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from tests.strategies import batch_from_forest, random_forest_lists

    @settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(
        seed=st.integers(0, 2**32 - 1),
        dp=st.integers(1, 4),
        slack=st.floats(1.0, 3.0),
        n0=st.sampled_from([2, 512]),
        extensions=st.booleans(),
    )
    def check(seed: int, dp: int, slack: float, n0: int, extensions: bool) -> None:
        rng = np.random.default_rng(seed)
        lengths, parents = random_forest_lists(rng, 4, max_segments=24, max_fanout=4, max_trees=3)
        batch = batch_from_forest(rng, lengths, parents)
        if batch.num_trajectories < dp:
            return
        index = prefix_index(batch)
        longest = int(batch.lengths.max())
        total = int(index.lcp_index.total_work())
        capacity = max(longest, int(slack * total / max(dp, 1) / 2))
        kw = dict(dp=dp, capacity=capacity, n0=n0, extensions=extensions)
        try:
            alone = plan_step(index, **kw)
        except ValueError as err:  # no feasible plan: the workers must say the same
            with pytest.raises(ValueError, match=re.escape(str(err))):
                plan_step(index, **kw, workers=_pool())
            return
        both = plan_step(index, **kw, workers=_pool())
        assert same_step_plan(alone, both) and alone.info["winner"] == both.info["winner"]
        assert both.info["workers"] == 2
        compared.append(batch.num_trajectories)

    compared: list[int] = []
    check()
    assert len(compared) >= 10, compared  # most examples made a plan to compare
