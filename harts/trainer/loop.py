"""The training loop: ``train_step`` over a sequence of batches, optionally planned ahead.

``train(model, batches, cfg)`` runs one optimizer update per batch (``harts.trainer.step``) and
returns the steps' logs; ``harts train`` runs the same steps with checkpoints, signals and
metrics around them (``harts.trainer.run``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable

import torch

from harts.models.hybrid_lm import HybridLM
from harts.parallel.mesh import ParallelState
from harts.trainer.step import StepLog, StepPrefetcher, TrainConfig, check_capacity, parallel_state, train_step
from harts.tree.batch import RolloutBatch

__all__ = ["train"]


def train(
    model: HybridLM,
    batches: Iterable[RolloutBatch],
    cfg: TrainConfig,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    on_step: Callable[[StepLog], None] | None = None,
    parallel: ParallelState | None = None,
    plan_ahead: bool = False,
) -> list[StepLog]:
    """Run ``train_step`` over ``batches``; returns the logs (``on_step`` sees each as it ends).

    ``batches`` may be a lazy iterable; give a list to have every step checked against
    ``cfg.capacity`` before the first one runs. ``plan_ahead``: a background thread takes the
    next batch from ``batches`` and plans it while the current step trains
    (``StepPrefetcher``); only for batches that do not depend on the weights
    being trained (not for rollouts sampled from this model between steps). The logs are the
    same either way; the steps take less wall time.
    """
    if isinstance(batches, (list, tuple)):
        for i, b in enumerate(batches):
            check_capacity(b, cfg.capacity, step=i)
    if optimizer is None:
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    logs = []
    if not plan_ahead:
        for i, batch in enumerate(batches):
            logs.append(train_step(model, optimizer, batch, cfg, step=i, parallel=parallel))
            if on_step is not None:
                on_step(logs[-1])
        return logs
    source = iter(batches)
    with StepPrefetcher(cfg, parallel_state(model, parallel).replicas) as ahead:
        ahead.submit(0, lambda: next(source, None))
        for i in itertools.count():
            planned = ahead.take(i)
            if planned is None:
                break
            ahead.submit(i + 1, lambda: next(source, None))
            logs.append(train_step(model, optimizer, planned.source, cfg, step=i, parallel=parallel, planned=planned))
            if on_step is not None:
                on_step(logs[-1])
    return logs
