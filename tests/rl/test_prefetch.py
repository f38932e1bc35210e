"""Planning the next step while the current one trains (``harts.rl.prefetch``,
``train(plan_ahead=True)``): the same results, planned in the background thread, errors raised
at their own step."""

from __future__ import annotations

import threading
from dataclasses import asdict

import pytest
import torch

import harts.trainer.step as train_mod
from harts import ExecutionConfig, HybridConfig, HybridLM
from harts.errors import CapacityError
from harts.trainer.loop import train
from harts.trainer.step import StepPrefetcher, TrainConfig, accumulate_step_gradients, plan_training_step
from harts.tree.workloads import generate

TIMES = {"plan_seconds", "prepare_seconds", "train_seconds", "tokens_per_second"}


def _model() -> HybridLM:
    torch.manual_seed(0)
    return HybridLM(HybridConfig.tiny(dtype="float64", vocab_size=256, layer_pattern="KMA", num_experts=4))


def _batches(n: int = 3) -> list:
    return [generate("tiny", step=i, seed=3) for i in range(n)]


@pytest.mark.parametrize("mode", ["compact", "trajectory"])
def test_planning_ahead_changes_no_result(mode: str) -> None:
    cfg = TrainConfig(capacity=400, lr=1e-3, execution=ExecutionConfig(mode=mode))
    runs = []
    for plan_ahead in (False, True):
        model = _model()
        logs = train(model, _batches(), cfg, plan_ahead=plan_ahead)
        runs.append(([{k: v for k, v in asdict(log).items() if k not in TIMES} for log in logs], model.state_dict()))
    (logs_a, weights_a), (logs_b, weights_b) = runs
    assert len(logs_a) == 3 and logs_a == logs_b
    for name, w in weights_a.items():
        assert torch.equal(w, weights_b[name]), name


def test_steps_are_planned_in_the_background_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    planned_on: list[str] = []
    original = train_mod.plan_step

    def recording(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        planned_on.append(threading.current_thread().name)
        return original(*args, **kwargs)

    monkeypatch.setattr(train_mod, "plan_step", recording)
    train(_model(), iter(_batches()), TrainConfig(capacity=400), plan_ahead=True)
    assert len(planned_on) == 3 and all(name.startswith("harts-plan") for name in planned_on)
    planned_on.clear()
    train(_model(), _batches(1), TrainConfig(capacity=400))
    assert planned_on == [threading.current_thread().name]  # without plan_ahead: in the caller's thread


def test_an_error_is_raised_at_its_own_step() -> None:
    def batches():  # noqa: ANN202
        yield generate("tiny", step=0, seed=3)
        raise OSError("step 1's file is unreadable")

    done: list[int] = []
    with pytest.raises(OSError, match="step 1's file is unreadable"):
        train(
            _model(), batches(), TrainConfig(capacity=400), on_step=lambda log: done.append(log.step), plan_ahead=True
        )
    assert done == [0]
    # the tiny workload's steps 0 and 2 (seed 3) have 162 and 237 tokens in their longest
    # trajectory: capacity 200 fails at step 2, after steps 0 and 1 have trained
    done.clear()
    steps = _batches(3)
    with pytest.raises(CapacityError, match="more than capacity=200"):
        train(
            _model(), iter(steps), TrainConfig(capacity=200), on_step=lambda log: done.append(log.step), plan_ahead=True
        )
    assert done == [0, 1]


def test_a_plan_made_for_another_batch_or_replica_count_is_refused() -> None:
    a, b = _batches(2)
    cfg = TrainConfig(capacity=400)
    with pytest.raises(ValueError, match="made for another batch"):
        accumulate_step_gradients(_model(), a, cfg, planned=plan_training_step(b, cfg))
    with pytest.raises(ValueError, match="has 2 replicas; this step runs 1"):
        accumulate_step_gradients(
            _model(), a, cfg, planned=plan_training_step(a, TrainConfig(capacity=400, replicas=2))
        )


def test_prefetcher_keys() -> None:
    with StepPrefetcher(TrainConfig(capacity=400)) as ahead:
        ahead.submit("a", lambda: None)
        with pytest.raises(ValueError, match="already submitted"):
            ahead.submit("a", lambda: None)
        assert ahead.take("a") is None and "a" in ahead.waited
        with pytest.raises(KeyError, match="was not submitted"):
            ahead.take("b")
