"""Training steps timed on a (dp, ep, cp, tp) mesh: ``harts bench`` under torchrun, and
``benchmarks/step/multi_gpu.py scaling``.

Every rank runs its share of ``harts train``'s step (``train_step(parallel=state)``): the
model sharded by ``harts.parallel`` (FSDP2, experts split over ``ep``, each microbatch's
compact rows split over the ``cp x tp`` ranks of a row group), one plan replica per row
group. A step is as slow as its slowest rank, so every figure is gathered from all ranks:

    step_seconds                 max over ranks of train_step's seconds
    replica_seconds_measured     [replicas]: each row group's compute time (its slowest rank),
                                 from the plan to the end of its last backward
    replica_seconds_predicted    [replicas]: the plan's per-replica work (compact tokens for
                                 harts, raw tokens for the baseline) scaled to the same mean
    peak_gib_per_rank            [world]: each rank's peak device memory (None off CUDA); under
                                 context parallelism a rank's activations fall as 1 / cp
    mfu                          the model FLOPs the mode executes over step_seconds x world x
                                 the device peak (``harts.models.flops``, counted as the
                                 one-device ``harts bench`` counts them)
    effective_mfu                the step's trajectory-wise FLOPs over the same time: what
                                 harts' prefix sharing is worth

``bench_mesh_step`` times one step both ways (the trajectory-wise baseline with the same
layout and every optimization harts gets) on the same weights: the optimizer runs at learning
rate 0 and the expert-bias update is off, so the step is the real one (gradient reduction over
the mesh, clipping, the AdamW update) and the second side sees the first side's weights.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from harts.experiments.counts import microbatch_counts
from harts.models.execution.config import ExecutionConfig
from harts.models.flops import FlopModel
from harts.models.hybrid_lm import HybridLM
from harts.parallel.build import materialize, moe_experts
from harts.parallel.context_parallel import check_context_parallel
from harts.parallel.mesh import ParallelConfig, ParallelState, init_parallel
from harts.parallel.parallelize import parallelize
from harts.parallel.tensor_parallel import check_tensor_parallel
from harts.plan.baselines.trajectory_plan import plan_trajectory_step
from harts.plan.step import StepPlan, plan_step
from harts.trainer.step import TrainConfig, train_step
from harts.tree.batch import RolloutBatch

__all__ = [
    "MeshBench",
    "MeshStep",
    "bench_mesh_step",
    "check_mesh_model",
    "executed_step_flops",
    "raw_step_flops",
    "shard_model",
    "time_mesh_step",
]


@dataclass
class MeshStep:
    """One side's step on the mesh (module docstring); the same on every rank."""

    step: int
    raw_tokens: int
    microbatches: int
    step_seconds: float
    tokens_per_second_per_gpu: float
    model_tflops: float
    mfu: float | None
    effective_mfu: float | None
    replica_seconds_measured: list[float]
    replica_seconds_predicted: list[float]
    peak_gib_per_rank: list[float | None]
    loss: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class MeshBench:
    """One step both ways on the mesh: the baseline (trajectory) and harts (compact)."""

    step: int
    paths: int
    raw_tokens: int
    baseline: MeshStep
    harts: MeshStep

    @property
    def speedup(self) -> float:
        """Baseline step time / harts step time (slowest rank each)."""
        return self.baseline.step_seconds / max(self.harts.step_seconds, 1e-12)

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "paths": self.paths,
            "raw_tokens": self.raw_tokens,
            "speedup": self.speedup,
            "baseline": self.baseline.to_dict(),
            "harts": self.harts.to_dict(),
        }


def check_mesh_model(model: HybridLM, config: ParallelConfig) -> None:
    """One-line errors, on the model's structure (a meta-device model will do) before any
    storage is made, when ``config`` does not split it: ``tp`` the heads and columns, ``cp``
    the heads and conv channels of one tensor-parallel rank, ``ep`` the experts."""
    check_tensor_parallel(model.config, config.tp)
    check_context_parallel(model.config, config.cp, config.tp)
    config.check_experts(moe_experts(model))


def shard_model(model: HybridLM, config: ParallelConfig, device: str, *, spec: str, seed: int) -> ParallelState:
    """The mesh of ``config`` on the current process group, and ``model`` (a meta-device
    structure from ``load_model(spec, seed=seed, device="meta")``) sharded for it and given
    this rank's values in place. Every rank calls it."""
    state = init_parallel(config, device, moe_experts(model))
    parallelize(model, state)
    materialize(model, state, spec=spec, seed=seed)
    return state


def raw_step_flops(batch: RolloutBatch, flops: FlopModel, logprob_positions: str = "all") -> float:
    """The step's trajectory-wise model FLOPs: every raw row, its logit row (action positions
    only with ``logprob_positions="actions"``), causal pairs (what the baseline executes,
    whatever its microbatching)."""
    return flops.training_flops(*microbatch_counts(batch, None, "trajectory", logprob_positions))


def executed_step_flops(
    model: HybridLM, batch: RolloutBatch, plan: StepPlan, execution: ExecutionConfig, flops: FlopModel
) -> float:
    """harts' step FLOPs as compact execution runs them, over every replica: compact rows, their
    logit rows and tree-visible pairs (the same count as ``harts bench``, so MFU means the same
    thing in both reports)."""
    rows = logit_rows = pairs = 0
    for d in range(plan.dp):
        for cb, cp in plan.prepare_replica(d, model.config.chunk_size):
            inputs = model.prepare_compact(cb, execution, plan=cp)
            r, lr, pr = microbatch_counts(cb.batch, inputs, "compact", execution.logprob_positions)
            rows, logit_rows, pairs = rows + r, logit_rows + lr, pairs + pr
    return flops.training_flops(rows, logit_rows, pairs)


def _gathered(state: ParallelState, mine: tuple[float, float, float | None]) -> list[Any]:
    """``mine`` from every rank, in rank order ([world] tuples)."""
    if state.world_size == 1:
        return [mine]
    out: list[Any] = [None] * state.world_size
    dist.all_gather_object(out, mine)
    return out


def time_mesh_step(
    model: HybridLM,
    optimizer: torch.optim.Optimizer,
    batch: RolloutBatch,
    cfg: TrainConfig,
    state: ParallelState,
    *,
    step: int = 0,
    peak_tflops: float | None = None,
    flops: FlopModel | None = None,
) -> MeshStep:
    """One ``train_step`` of ``batch`` under ``cfg`` on every rank of ``state``, timed (module
    docstring); every rank calls it and gets the same figures."""
    device = state.device
    flops = flops or FlopModel.from_model(model)
    marks: dict[str, float] = {}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    def progress(done: int, total: int) -> None:
        if 0 < done < total:
            return  # the loop keeps the device busy between microbatches: no sync there
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        marks["start" if done == 0 else "end"] = time.perf_counter()

    log = train_step(model, optimizer, batch, cfg, step=step, progress=progress, parallel=state)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    gathered = _gathered(state, (marks["end"] - marks["start"], log.train_seconds, peak))
    compute, seconds_per_rank = [g[0] for g in gathered], [g[1] for g in gathered]
    execution, world = cfg.execution, state.world_size
    # the plan train_step ran: harts' step plan, or the baseline's raw-token packing
    # (one replica per row group)
    if execution.mode == "compact":
        plan = plan_step(batch, dp=state.replicas, capacity=cfg.capacity)
        work = plan.work_matrix().sum(1).astype(float)
        model_flops = executed_step_flops(model, batch, plan, execution, flops)
    else:
        raw_plan = plan_trajectory_step(batch.lengths, dp=state.replicas, capacity=cfg.capacity)
        work = raw_plan.replica_work().astype(float)
        model_flops = raw_step_flops(batch, flops, execution.logprob_positions)
    # a replica (a row group: cp x tp ranks) takes as long as its slowest rank
    n = state.row_ranks
    per_replica = [max(compute[r * n : (r + 1) * n]) for r in range(state.replicas)]
    predicted = work / work.mean() * float(np.mean(per_replica))
    raw_flops = raw_step_flops(batch, flops, execution.logprob_positions)
    seconds = max(seconds_per_rank)

    def mfu(f: float) -> float | None:
        return f / (seconds * world * peak_tflops * 1e12) if peak_tflops else None

    return MeshStep(
        step=step,
        raw_tokens=batch.num_tokens,
        microbatches=log.microbatches,
        step_seconds=seconds,
        tokens_per_second_per_gpu=batch.num_tokens / seconds / world,
        model_tflops=model_flops / 1e12,
        mfu=mfu(model_flops),
        effective_mfu=mfu(raw_flops),
        replica_seconds_measured=per_replica,
        replica_seconds_predicted=predicted.tolist(),
        peak_gib_per_rank=[g[2] for g in gathered],
        loss=log.loss,
    )


def bench_mesh_step(
    model: HybridLM,
    batch: RolloutBatch,
    state: ParallelState,
    *,
    capacity: int,
    execution: ExecutionConfig,
    step: int = 0,
    warmup: bool = True,
    peak_tflops: float | None = None,
    planner_workers: int = 0,
    on_side: Callable[[str], None] | None = None,
) -> MeshBench:
    """Step ``batch`` both ways on the mesh, the baseline first, each after an untimed step of
    the same batch (kernel autotuning, allocator) unless ``warmup`` is off. Both sides run
    ``execution`` (its mode set per side) with the fused log-prob, at capacity ``capacity``
    per row group; the weights do not change (module docstring). ``on_side(name)`` is called
    as each side starts ("baseline", "harts")."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0, weight_decay=0.0)
    flops = FlopModel.from_model(model)
    sides: dict[str, MeshStep] = {}
    for name, mode in (("baseline", "trajectory"), ("harts", "compact")):
        if on_side is not None:
            on_side(name)
        cfg = TrainConfig(
            capacity=capacity,
            execution=replace(execution, mode=mode, fused_logprobs=True),
            lr=0.0,
            expert_bias_rate=0.0,
            planner_workers=planner_workers,
        )
        if warmup:
            train_step(model, optimizer, batch, cfg, step=step, parallel=state)
        sides[name] = time_mesh_step(
            model, optimizer, batch, cfg, state, step=step, peak_tflops=peak_tflops, flops=flops
        )
    optimizer.zero_grad(set_to_none=True)
    return MeshBench(
        step=step,
        paths=batch.num_trajectories,
        raw_tokens=batch.num_tokens,
        baseline=sides["baseline"],
        harts=sides["harts"],
    )
