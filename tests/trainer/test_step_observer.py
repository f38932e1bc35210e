"""``accumulate_step_gradients``' hooks for whoever watches or chooses its microbatches (the
benchmark): an observer told of each microbatch's start and end, a chosen subset of the plan's
microbatches, and their inputs made ahead. None of them changes the gradients."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest
import torch

import harts
from harts.trainer.step import (
    StepObserver,
    TrainConfig,
    accumulate_step_gradients,
    microbatch_inputs,
    microbatch_item,
    plan_training_step,
)
from harts.tree.batch import RolloutBatch
from harts.tree.workloads import generate


class _Log:
    def __init__(self) -> None:
        self.events: list[tuple[str, int, int]] = []

    def microbatch_started(self, index: int, sub: RolloutBatch) -> None:
        self.events.append(("start", index, sub.num_tokens))

    def microbatch_ended(self, index: int, info: Mapping[str, Any]) -> None:
        self.events.append(("end", index, int(info["rows"])))


def _grads(model: harts.HybridLM) -> list[torch.Tensor]:
    out = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("mode", ["compact", "trajectory"])
def test_observer_sees_every_microbatch_and_changes_nothing(mode: str) -> None:
    torch.manual_seed(0)
    model = harts.HybridLM(harts.HybridConfig.tiny(vocab_size=256, layer_pattern="KM"))
    batch = generate("tiny", step=1)
    cfg = TrainConfig(capacity=400, execution=harts.ExecutionConfig(mode=mode))
    planned = plan_training_step(batch, cfg)
    plain = accumulate_step_gradients(model, batch, cfg, planned=planned)
    expected = _grads(model)
    log = _Log()
    observer: StepObserver = log  # a structural Protocol: any object with both methods
    watched = accumulate_step_gradients(model, batch, cfg, planned=planned, observer=observer)
    assert all(torch.equal(a, b) for a, b in zip(_grads(model), expected))
    assert watched.loss == plain.loss
    n = plain.rank_microbatches
    assert n > 1 and [e[:2] for e in log.events] == [(k, i) for i in range(n) for k in ("start", "end")]
    assert sum(e[2] for e in log.events if e[0] == "end") == plain.rows


@pytest.mark.parametrize("statistics", ["microbatch", "step"])
def test_chosen_microbatches_prepared_ahead_match_the_step_s_own_preparation(statistics: str) -> None:
    torch.manual_seed(0)
    model = harts.HybridLM(harts.HybridConfig.tiny(vocab_size=256, layer_pattern="KM"))
    batch = generate("tiny", step=1)
    cfg = TrainConfig(capacity=250, execution=harts.ExecutionConfig(), replicas=2, moe_statistics=statistics)
    planned = plan_training_step(batch, cfg)
    mine = planned.plan.for_replica(1)
    own = accumulate_step_gradients(model, batch, cfg, planned=planned, microbatches=mine)
    expected = _grads(model)
    items = [microbatch_item(model, planned, k) for k in mine]
    prepared = [(it[0], microbatch_inputs(model, it, cfg.execution)) for it in items]
    ahead = accumulate_step_gradients(model, batch, cfg, planned=planned, microbatches=mine, prepared=prepared)
    assert all(torch.equal(a, b) for a, b in zip(_grads(model), expected))
    assert len(mine) == 2 and ahead.loss == own.loss and ahead.rank_microbatches == 2
    assert ahead.prepare_seconds < own.prepare_seconds  # nothing prepared inside the step
    with pytest.raises(ValueError, match="prepared= holds 1 microbatches; this step runs"):
        accumulate_step_gradients(model, batch, cfg, planned=planned, microbatches=mine, prepared=prepared[:1])
    with pytest.raises(ValueError, match="not among the plan's"):
        accumulate_step_gradients(model, batch, cfg, planned=planned, microbatches=[len(planned.plan.microbatches)])
