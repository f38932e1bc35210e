"""Training-step speed: harts (compact) against the trajectory-wise baseline, same weights.

Both sides run the step ``harts train`` runs, ``harts.trainer.step.accumulate_step_gradients``
(forward, the GRPO loss normalized by the step's denominator, the MoE router objective,
backward; gradients accumulate, no optimizer update), over the whole step (every trajectory), as
in the paper's Table 4. The timers only watch it: a ``StepObserver`` marks each microbatch's
start and end in the device's stream order, region timers (``harts.models.regions``) attribute
time to components, and the clock and device syncs sit outside the call. No second copy of the
microbatch loop exists, so what is timed is what trains.

* baseline: the trees are expanded into trajectories and packed, in batch order, into
  microbatches of at most T raw tokens (``harts.plan.baselines.trajectory_plan``, the plan
  ``harts train --mode trajectory`` runs); each microbatch runs ``mode="trajectory"``;
* harts: ``plan_step(dp=D, capacity=T)`` groups trajectories by compact work; each
  microbatch's slice of the step's compaction and its call plan come from the plan
  (``StepPlan.prepare_microbatch``), it is laid out, then runs ``mode="compact"``.

Both sides get the same model (a LoRA model too: the same adapters, the same frozen base), the
same kernels and options (linear-attention backend, attention implementation, fused log-probs,
log-prob positions, grouped-GEMM MoE, recomputation).

With ``dp = D > 1`` one replica's share is timed (``accumulate_step_gradients(microbatches=...)``):
harts runs the microbatches the step planner gives replica ``replica``; the baseline's
microbatches are dealt to D replicas by raw tokens (largest first, to the lightest replica with
fewer than its share) and replica ``replica``'s are run. Every replica's predicted work is
reported (harts: compact tokens from the plan; baseline: raw tokens).

Reported per step and side: rows, tokens/s (harts: compact rows and raw-equivalent), model
TFLOP/s and MFU (``harts.models.flops``; with a frozen base, only the work training needs), a
per-component time breakdown from region timers (CUDA events on GPU), the untimed warm-up's time,
and peak memory. Per step:

    compression   raw rows / non-replay compact rows of the harts microbatches
    F/B/Grad      baseline time / harts time (forward + backward + gradients), every
                  microbatch's inputs prepared before the clock starts
                  (``accumulate_step_gradients(prepared=...)``)
    Core          baseline time / harts' Core time: the step planner (whole-step compaction
                  included), then the microbatches as ``harts train`` runs them, each prepared
                  (slice, call plan, layout, LM-head plan) on a host thread while the one before
                  it is launched (``harts.plan.prefetch``). This is a second
                  timed harts run (``core_run``); without it, Core charges planning and every
                  microbatch's preparation made ahead (``plan_seconds``) in full.

The planning that Core pays beyond F/B/Grad (``BenchSide.critical_plan_seconds``) is the Core
time less the F/B/Grad time of the run with everything prepared ahead.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

import harts.models.regions as regions
from harts.experiments import probes
from harts.experiments.bench_result import BenchSide, StepBench
from harts.experiments.counts import microbatch_counts, recurrence_chunk_steps, warmup_microbatches
from harts.models.execution.config import ExecutionConfig
from harts.models.flops import FlopModel
from harts.models.hybrid_lm import HybridLM
from harts.models.layers.registry import mixer_specs
from harts.plan.baselines.trajectory_plan import TrajectoryPlan, plan_trajectory_step
from harts.plan.step import PlannerWorkers, StepPlan, plan_step
from harts.plan.step.step_plan import same_step_plan
from harts.trainer import step as trainer_step
from harts.trainer.step import PlannedStep, TrainConfig, microbatch_inputs, microbatch_item
from harts.tree.batch import RolloutBatch

__all__ = ["bench_step", "profile_step"]


@dataclass
class _Side:
    """One side of the bench: its step as ``accumulate_step_gradients`` takes it (config and
    plan), the timed replica's microbatches and their inputs, prepared ahead."""

    name: str
    cfg: TrainConfig
    planned: PlannedStep
    #: the timed replica's microbatch ids, in slot order, and their (sub, inputs)
    ks: list[int]
    prepared: list[tuple[RolloutBatch, Any]]
    #: seconds preparing them took
    prepare_seconds: float


def _make_side(
    model: HybridLM,
    batch: RolloutBatch,
    plan: StepPlan | TrajectoryPlan,
    execution: ExecutionConfig,
    *,
    capacity: int,
    replica: int,
    first_only: bool = False,
) -> _Side:
    """``plan``'s side of the bench (harts for a ``StepPlan``, the baseline for a
    ``TrajectoryPlan``): replica ``replica``'s microbatches (its first alone with ``first_only``),
    each prepared as the step prepares it (``microbatch_item``, ``microbatch_inputs``)."""
    compact = isinstance(plan, StepPlan)
    cfg = TrainConfig(
        capacity=capacity, execution=replace(execution, mode="compact" if compact else "trajectory"), replicas=plan.dp
    )
    planned = PlannedStep(source=batch, batch=batch, plan=plan, plan_seconds=0.0)
    ks = plan.for_replica(replica)[: 1 if first_only else None]
    t0 = time.perf_counter()
    items = [microbatch_item(model, planned, k) for k in ks]
    prepared = [(item[0], microbatch_inputs(model, item, cfg.execution)) for item in items]
    return _Side("harts" if compact else "baseline", cfg, planned, ks, prepared, time.perf_counter() - t0)


def _run(model: HybridLM, side: _Side, only: Sequence[int] | None = None, observer: Any = None) -> Any:  # noqa: ANN401
    """The shipped step over ``side``'s prepared microbatches (those at positions ``only``, for
    the warm-up and the profile): ``accumulate_step_gradients``, watched by ``observer``."""
    at = range(len(side.ks)) if only is None else only
    return trainer_step.accumulate_step_gradients(
        model,
        side.planned.batch,
        side.cfg,
        planned=side.planned,
        microbatches=[side.ks[i] for i in at],
        prepared=[side.prepared[i] for i in at],
        observer=observer,
    )


class _Marks:
    """A ``StepObserver`` for the bench: each microbatch's start and end marked in the device's
    stream order (``probes.mark``: a CUDA event, no sync), its rows (non-replay compact rows in
    compact mode), the calls and replay rows, and a progress bar moved along."""

    def __init__(self, device: torch.device, bar: Any = None) -> None:  # noqa: ANN401
        self.device, self.bar = device, bar
        self.started: list[object] = []
        self.ended: list[object] = []
        self.rows: list[int] = []
        self.calls = self.replay_rows = 0

    def microbatch_started(self, index: int, sub: RolloutBatch) -> None:
        self.started.append(probes.mark(self.device))

    def microbatch_ended(self, index: int, info: Mapping[str, Any]) -> None:
        self.ended.append(probes.mark(self.device))
        self.rows.append(int(info.get("compact_rows", info["rows"])))
        self.calls += int(info["calls"])
        self.replay_rows += int(info["replay_rows"])
        if self.bar is not None:
            self.bar.update(1)

    def start_to_start(self) -> list[float]:
        """Each microbatch's seconds from its start to the next one's (the last: to its end), so
        host gaps between microbatches count (call after the device synchronized)."""
        marks = [*self.started, self.ended[-1]] if self.ended else []
        return [probes.between(a, b) for a, b in zip(marks, marks[1:])]

    def end_to_end(self, origin: object) -> list[float]:
        """Each microbatch's seconds from the end of the one before it (the first: from
        ``origin``), so its wait for its preparation counts."""
        marks = [origin, *self.ended]
        return [probes.between(a, b) for a, b in zip(marks, marks[1:])]


@dataclass
class _Pass:
    """One timed run of a side's microbatches (``_timed_pass``)."""

    seconds: float
    breakdown: dict
    mb_seconds: list[float]
    mb_rows: list[int]
    rows: int
    calls: int
    replay: int


def _timed_pass(model: HybridLM, side: _Side, bar: Any) -> _Pass:  # noqa: ANN401
    """Run ``side``'s step once under the region timers, the device synchronized at both ends:
    wall seconds, seconds per component and phase ("other": the rest), per-microbatch seconds
    (device events on CUDA) and rows, and the forward's counts. Gradients are discarded."""
    device = model.embed_tokens.weight.device
    model.zero_grad(set_to_none=True)
    probes.sync(device)
    marks = _Marks(device, bar)
    with regions.RegionTimer(device) as timer:
        t0 = time.perf_counter()
        _run(model, side, observer=marks)
        probes.sync(device)
        seconds = time.perf_counter() - t0
    breakdown = timer.totals()
    # the recomputed layers' work outside every core region is "other"'s recomputation
    layer = breakdown.pop(regions.LAYER, {})
    in_regions = sum(sum(v.values()) for v in breakdown.values())
    breakdown["other"] = {
        "forward": 0.0,
        "backward": 0.0,
        "recompute": layer.get("recompute", 0.0),
        "total": max(seconds - in_regions, 0.0),
    }
    for v in breakdown.values():
        v.setdefault("total", sum(v.values()))
    model.zero_grad(set_to_none=True)
    rows = marks.rows
    return _Pass(seconds, breakdown, marks.start_to_start(), rows, sum(rows), marks.calls, marks.replay_rows)


def _median_index(xs: Sequence[float]) -> int:
    """The index of the median of ``xs`` (the lower median for an even count)."""
    return sorted(range(len(xs)), key=xs.__getitem__)[(len(xs) - 1) // 2]


@dataclass
class _Options:
    """How ``bench_step`` runs each side (its arguments of the same names)."""

    warmup: bool
    flop_model: FlopModel
    progress: Callable[[int, str], Any] | None = None
    profile_dir: str | None = None
    clock_origin: float | None = None
    repeats: int = 1


def _run_side(model: HybridLM, side: _Side, opts: _Options, *, plan_seconds: float) -> BenchSide:
    """One side timed: its warm-up (untimed), ``opts.repeats`` timed runs (the median reported),
    the profile of its first microbatch; every figure of ``BenchSide`` but Core's."""
    device = model.embed_tokens.weight.device
    mode, prepared = side.cfg.execution.mode, side.prepared
    counts = [microbatch_counts(sub, x, mode, side.cfg.execution.logprob_positions) for sub, x in prepared]
    # the recurrence's chain only where the model has a linear-attention layer
    linear = any(s.family == "linear" for s in mixer_specs(model.config.layer_pattern))
    chunk = model.config.chunk_size
    chains = [recurrence_chunk_steps(sub, x, mode, chunk) for sub, x in prepared] if linear else []
    warm = 0.0
    if opts.warmup and prepared:
        executed = [sub.num_tokens if mode == "trajectory" else x.layout.num_rows for sub, x in prepared]
        probes.sync(device)
        t0 = time.perf_counter()
        _run(model, side, only=warmup_microbatches(executed, [c[0] for c in counts]))
        probes.sync(device)
        warm = time.perf_counter() - t0
    model.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    probes.sync(device)
    graphs, syncs, variants = probes.compiled_graphs(), probes.allocator_syncs(device), probes.triton_variants()
    to_timed = None if opts.clock_origin is None else round(time.perf_counter() - opts.clock_origin, 3)
    passes = [_bar_pass(model, side, opts, r) for r in range(opts.repeats)]
    runs = [p.seconds for p in passes]
    chosen = passes[_median_index(runs)]
    peak = _peak_gib(device)
    if opts.profile_dir and prepared:
        path = os.path.join(opts.profile_dir, f"{side.name}.json")
        probes.profile_microbatch(functools.partial(_run, model, side, [0]), device, path)
        model.zero_grad(set_to_none=True)
    logit_rows, pairs = sum(c[1] for c in counts), sum(c[2] for c in counts)
    return BenchSide(
        microbatches=len(prepared),
        rows=chosen.rows,
        calls=chosen.calls,
        replay_rows=chosen.replay,
        plan_seconds=round(plan_seconds + (side.prepare_seconds if mode == "compact" else 0.0), 4),
        train_seconds=round(chosen.seconds, 4),
        peak_memory_gb=None if peak is None else round(peak, 3),
        raw_tokens=sum(sub.num_tokens for sub, _ in prepared),
        logit_rows=logit_rows,
        attention_pairs=pairs,
        flops=opts.flop_model.training_flops(chosen.rows, logit_rows, pairs),
        warmup_seconds=round(warm, 3),
        compiles_in_timed_step=probes.compiled_graphs() - graphs,
        triton_variants_in_timed_step=probes.TRITON_VARIANTS[variants:],
        allocator_syncs=probes.allocator_syncs(device) - syncs,
        seconds_to_timed=to_timed,
        train_seconds_runs=[round(x, 4) for x in runs],
        breakdown={k: {p: round(s, 4) for p, s in v.items()} for k, v in chosen.breakdown.items()},
        microbatch_seconds=[round(x, 5) for x in chosen.mb_seconds],
        microbatch_rows=chosen.mb_rows,
        microbatch_pairs=[int(c[2]) for c in counts],
        microbatch_chain=chains,
    )


def _bar_pass(model: HybridLM, side: _Side, opts: _Options, r: int) -> _Pass:
    """Timed run ``r`` of ``side`` with its progress bar (when ``opts.progress`` makes one)."""
    desc = f"{side.name} microbatches" + (f" ({r + 1}/{opts.repeats})" if opts.repeats > 1 else "")
    bar = opts.progress(len(side.prepared), desc) if opts.progress else None
    try:
        return _timed_pass(model, side, bar)
    finally:
        if bar is not None:
            bar.close()


def _peak_gib(device: torch.device) -> float | None:
    """The device's peak allocated memory since its last reset, GiB (None off CUDA)."""
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / 2**30


def _core_run_seconds(model: HybridLM, side: _Side) -> tuple[float, list[float], float]:
    """Wall seconds of harts' microbatches as ``harts train`` runs them, each microbatch's seconds
    (device events on CUDA, from the start of the run for the first), and the seconds the host
    waited for the preparations: ``accumulate_step_gradients`` prepares each microbatch on a host
    thread while the one before it is launched (``cfg.prepare_ahead``, no device sync between
    them). Gradients are discarded."""
    device = model.embed_tokens.weight.device
    model.zero_grad(set_to_none=True)
    probes.sync(device)
    marks = _Marks(device)
    # under the region timers as the F/B/Grad run (their events cost the same in both runs)
    with regions.RegionTimer(device):
        t0 = time.perf_counter()
        origin = probes.mark(device)
        acc = trainer_step.accumulate_step_gradients(
            model, side.planned.batch, side.cfg, planned=side.planned, microbatches=side.ks, observer=marks
        )
        probes.sync(device)
        seconds = time.perf_counter() - t0
    model.zero_grad(set_to_none=True)
    return seconds, marks.end_to_end(origin), acc.prepare_seconds


def _with_core_run(harts: BenchSide, model: HybridLM, side: _Side, plan_seconds: float, repeats: int) -> BenchSide:
    """``harts`` with its Core figures: the step planner's time measured before plus a run that
    prepares every microbatch as ``harts train`` does (its clock holds every preparation)."""
    device = model.embed_tokens.weight.device
    graphs, syncs, variants = probes.compiled_graphs(), probes.allocator_syncs(device), probes.triton_variants()
    core = [_core_run_seconds(model, side) for _ in range(repeats)]
    runs = [plan_seconds + seconds for seconds, _, _ in core]
    median = _median_index(runs)
    return replace(
        harts,
        core_seconds=round(runs[median], 4),
        core_seconds_runs=[round(x, 4) for x in runs],
        core_microbatch_seconds=[round(x, 5) for x in core[median][1]],
        core_prepare_wait_seconds=round(core[median][2], 4),
        compiles_in_core_run=probes.compiled_graphs() - graphs,
        triton_variants_in_core_run=probes.TRITON_VARIANTS[variants:],
        allocator_syncs_in_core_run=probes.allocator_syncs(device) - syncs,
    )


def _timed_plan(
    batch: RolloutBatch, dp: int, capacity: int, planner_workers: PlannerWorkers | None
) -> tuple[StepPlan, float, float | None, bool | None]:
    """The step plan and its seconds; with worker processes also the seconds of planning in
    this process alone and whether that made the same plan (else None, None)."""
    t0 = time.perf_counter()
    plan = plan_step(batch, dp=dp, capacity=capacity, workers=planner_workers)
    plan_seconds = time.perf_counter() - t0
    if not int(plan.info.get("workers", 0)):
        return plan, plan_seconds, None, None
    t0 = time.perf_counter()
    serial = plan_step(batch, dp=dp, capacity=capacity)
    return plan, plan_seconds, round(time.perf_counter() - t0, 4), same_step_plan(plan, serial)


def _checked(batch: RolloutBatch, dp: int, replica: int, repeats: int) -> RolloutBatch:
    """``batch`` on-policy (as ``harts train`` trains it), after the arguments' checks."""
    if not 0 <= replica < dp:
        raise ValueError(f"--replica must lie in [0, {dp}) for --dp {dp}; got {replica}")
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1; got {repeats}")
    return replace(batch, old_logprobs=None, ref_logprobs=None)


def profile_step(
    model: HybridLM,
    batch: RolloutBatch,
    profile_dir: str,
    *,
    capacity: int,
    execution: ExecutionConfig | None = None,
    dp: int = 1,
    replica: int = 0,
    planner_workers: PlannerWorkers | None = None,
) -> list[str]:
    """Profile one microbatch per side of replica ``replica``'s share of the step (at ``dp``
    replicas, capacity ``capacity``) without timing the step: the first microbatch of each side
    (the one ``bench_step``'s ``profile_dir`` profiles) runs once untimed (compile, autotune,
    allocator), then once under the torch profiler (``probes.profile_microbatch``: a Chrome trace,
    and beside it a .txt with device busy time, device time by region and the top kernels). Only
    those two microbatches are prepared. Returns the two .txt paths (baseline, harts)."""
    batch = _checked(batch, dp, replica, 1)
    device = model.embed_tokens.weight.device
    execution = replace(ExecutionConfig.of(execution), fused_logprobs=True)
    plans: list[StepPlan | TrajectoryPlan] = [
        plan_trajectory_step(batch.lengths, dp=dp, capacity=capacity),
        plan_step(batch, dp=dp, capacity=capacity, workers=planner_workers),
    ]
    paths = []
    for plan in plans:
        side = _make_side(model, batch, plan, execution, capacity=capacity, replica=replica, first_only=True)
        _run(model, side)  # untimed: compile, autotune, allocator
        model.zero_grad(set_to_none=True)
        probes.sync(device)
        path = os.path.join(profile_dir, f"{side.name}.json")
        probes.profile_microbatch(functools.partial(_run, model, side), device, path)
        model.zero_grad(set_to_none=True)
        paths.append(os.path.join(profile_dir, f"{side.name}.txt"))
    return paths


def bench_step(
    model: HybridLM,
    batch: RolloutBatch,
    *,
    capacity: int,
    step: int = 0,
    execution: ExecutionConfig | None = None,
    warmup: bool = True,
    dp: int = 1,
    replica: int = 0,
    optimizer: bool = False,
    peak_tflops: float | None = None,
    progress: Callable[[int, str], Any] | None = None,
    profile_dir: str | None = None,
    clock_origin: float | None = None,
    core_run: bool = True,
    planner_workers: PlannerWorkers | None = None,
    repeats: int = 1,
) -> StepBench:
    """Time one step (or replica ``replica``'s share of it at ``dp`` replicas) both ways on
    ``model`` (its weights are not changed) under ``execution`` (its mode is set per side, and
    both sides use the fused log-prob, as a real trainer does; its ``logprob_positions`` holds for
    both, and the logit rows counted are the ones computed). ``optimizer`` also times one AdamW step;
    ``profile_dir`` writes a Chrome trace of one microbatch per side. ``clock_origin`` (a
    ``time.perf_counter()`` value) makes each side report the seconds from it to its first timed
    microbatch (``BenchSide.seconds_to_timed``). ``core_run`` times harts a second time as
    ``harts train`` runs the step, for Core (module docstring); without it Core charges all
    planning and preparation made ahead. ``planner_workers``: the step planner's worker processes
    (``plan_step(workers=...)``); with them the planner also runs once more in this process alone,
    for ``step_plan_seconds_serial`` and a check that the plan is the same. ``repeats``: timed
    runs of each side's step (and of the Core run), one after another; the median run is reported
    and every run's seconds kept (``BenchSide.train_seconds_runs``, ``core_seconds_runs``): a
    step of a few seconds varies by a few percent from run to run."""
    batch = _checked(batch, dp, replica, repeats)
    plan, plan_seconds, serial_seconds, same_plan = _timed_plan(batch, dp, capacity, planner_workers)
    # the baseline's own microbatches: raw tokens packed at the capacity (the harness's and
    # ``harts train --mode trajectory``'s plan)
    raw_plan = plan_trajectory_step(batch.lengths, dp=dp, capacity=capacity)
    execution = replace(ExecutionConfig.of(execution), fused_logprobs=True)
    opts = _Options(warmup, FlopModel.from_model(model), progress, profile_dir, clock_origin, repeats)
    # the baseline's inputs (the LM head's host inputs too) are made ahead, as harts' are: neither
    # side's F/B/Grad clock holds its preparation
    base_side = _make_side(model, batch, raw_plan, execution, capacity=capacity, replica=replica)
    baseline = _run_side(model, base_side, opts, plan_seconds=0.0)
    del base_side
    harts_side = _make_side(model, batch, plan, execution, capacity=capacity, replica=replica)
    harts = _run_side(model, harts_side, opts, plan_seconds=plan_seconds)
    if core_run:
        # the Core run prepares its own inputs, as ``harts train`` does: these are let go first
        harts_side = replace(harts_side, prepared=[])
        harts = _with_core_run(harts, model, harts_side, plan_seconds, repeats)
    return StepBench(
        step=step,
        paths=batch.num_trajectories,
        raw_tokens=batch.num_tokens,
        baseline=baseline,
        harts=harts,
        dp=dp,
        replica=replica,
        predicted_harts=[int(x) for x in plan.work_matrix().sum(1)],
        predicted_baseline=[int(w) for w in raw_plan.replica_work()],
        optimizer_seconds=round(probes.optimizer_seconds(model), 4) if optimizer else None,
        peak_tflops=peak_tflops,
        step_plan_seconds=round(plan_seconds, 4),
        planner_workers=int(plan.info.get("workers", 0)),
        step_plan_seconds_serial=serial_seconds,
        planner_workers_same_plan=same_plan,
    )
