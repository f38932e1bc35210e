"""Load and plan the next training step while the current one trains.

Planning a step (``harts.rl.train.plan_training_step``: capacity check, the step planner, its
compaction) is numpy on the host and needs neither the model nor the device. Done between
steps it is time the device stands idle: on an H200, 1.5-2.5 s per ``swe`` replica step
against 46 s of training, 0.3-0.4 s per ``medium`` step against 5 s (README, sessions 9-10).
``StepPrefetcher`` runs it, and the loading of the step's batch, in one background thread:

    with StepPrefetcher(cfg, world) as ahead:
        ahead.submit(0, load_step_0)
        for i in range(num_steps):
            planned = ahead.take(i)                 # waits only if planning is still running
            if i + 1 < num_steps:
                ahead.submit(i + 1, partial(load_step, i + 1))
            train_step(model, opt, planned.source, cfg, planned=planned)

The thread overlaps training because torch releases the GIL inside its operators (and the
host waits in them while the device is busy); numpy releases it in its array loops. The plan
is the one the training thread would have made (planning is deterministic), so the run's
results do not change. An exception raised while loading or planning step k is raised by
``take(k)``, in the training thread, with its traceback.

Only for batches that do not depend on the weights being trained: rollouts sampled from the
model between steps must be planned after they are sampled.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from harts.rl.train import PlannedStep, TrainConfig, plan_training_step
from harts.tree.batch import RolloutBatch

__all__ = ["StepPrefetcher"]


class StepPrefetcher:
    """One background thread that loads and plans submitted steps in submission order."""

    def __init__(self, cfg: TrainConfig, world: int = 1) -> None:
        self.cfg, self.world = cfg, world
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="harts-plan")
        self._pending: dict[Any, Future] = {}
        #: seconds ``take`` waited for each key (the planning not hidden behind training)
        self.waited: dict[Any, float] = {}

    def submit(self, key: Any, load: Callable[[], RolloutBatch | None]) -> None:
        """Start loading (``load()``; None: nothing to train) and planning step ``key``."""
        if key in self._pending:
            raise ValueError(f"step {key!r} was already submitted")
        self._pending[key] = self._pool.submit(self._load_and_plan, load)

    def _load_and_plan(self, load: Callable[[], RolloutBatch | None]) -> PlannedStep | None:
        batch = load()
        return None if batch is None else plan_training_step(batch, self.cfg, self.world)

    def take(self, key: Any) -> PlannedStep | None:
        """The planned step ``key`` (None if its loader returned None), waiting for it if needed;
        re-raises what loading or planning raised. KeyError if ``key`` was never submitted."""
        if key not in self._pending:
            raise KeyError(f"step {key!r} was not submitted")
        future = self._pending.pop(key)
        t0 = time.perf_counter()
        try:
            return future.result()
        finally:
            self.waited[key] = time.perf_counter() - t0

    def close(self) -> None:
        """Drop steps not yet started; a plan already running finishes in the background."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._pending.clear()

    def __enter__(self) -> StepPrefetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
