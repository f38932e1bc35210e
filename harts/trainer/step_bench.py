"""Training-step speed: harts (compact) against the trajectory-wise baseline, same weights.

Both sides train on the whole step (every trajectory), as in the paper's Table 4:

* baseline: the trees are expanded into trajectories and packed, in batch order, into
  microbatches of at most T raw tokens (``harts.plan.baselines.trajectory_plan``, the plan
  ``harts train --mode trajectory`` runs); each microbatch runs ``mode="trajectory"``;
* harts: ``plan_step(dp=D, capacity=T)`` groups trajectories by compact work; each
  microbatch's slice of the step's compaction and its call plan come from the plan
  (``StepPlan.prepare_replica``), it is laid out, then runs ``mode="compact"``.

Both sides get the same kernels and options (linear-attention backend, attention
implementation, fused log-probs, log-prob positions, grouped-GEMM MoE, recomputation).

Each microbatch does forward, GRPO loss normalized by the step's denominator, MoE router
objective, backward (gradients accumulate; no optimizer update). With ``dp = D > 1`` one
replica's share is timed: harts runs the microbatches the step planner gives replica
``replica``; the baseline's microbatches are dealt to D replicas by raw tokens (largest first,
to the lightest replica with fewer than its share) and replica ``replica``'s are run. Every replica's predicted work is
reported (harts: compact tokens from the plan; baseline: raw tokens).

Reported per step and side: rows, tokens/s (harts: compact rows and raw-equivalent), model
TFLOP/s and MFU (``harts.models.flops``), a per-component time breakdown from region timers
(``harts.models.regions``: CUDA events on GPU), the untimed warm-up's time, and peak memory.
Per step:

    compression   raw rows / non-replay compact rows of the harts microbatches
    F/B/Grad      baseline time / harts time (forward + backward + gradients)
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
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
import torch

import harts.models.regions as regions
from harts.models.config import LAYER_TYPES
from harts.models.execution.config import ExecutionConfig
from harts.models.flops import FlopModel
from harts.models.hybrid_lm import HybridLM
from harts.models.region_trace import (
    OUTSIDE_REGIONS,
    device_busy_seconds,
    device_idle_gaps,
    device_time_by_region,
    idle_table,
    kernels_by_region,
    operators_by_region,
    region_table,
)
from harts.plan.baselines.trajectory_plan import plan_trajectory_step
from harts.plan.prefetch import Prefetched
from harts.plan.step import PlannerWorkers, StepPlan, plan_step
from harts.plan.step.step_plan import same_step_plan
from harts.rl.grpo import grpo_loss, grpo_normalizer
from harts.tree.batch import RolloutBatch

__all__ = [
    "BenchSide",
    "StepBench",
    "bench_step",
    "layout_chunk_steps",
    "profile_step",
    "recurrence_chunk_steps",
    "recurrence_words",
    "trajectory_chunk_steps",
    "warmup_microbatches",
]

#: breakdown components: the model's regions, plus "other layers" (the rest of forward/backward)
COMPONENTS = ("linear_attention", "attention", "moe", "lm_head", "other")


@dataclass
class BenchSide:
    microbatches: int
    #: semantic rows (baseline) or unique non-replay compact rows (harts) executed
    rows: int
    calls: int
    replay_rows: int
    plan_seconds: float
    train_seconds: float
    peak_memory_gb: float | None
    #: raw (semantic) tokens this side's microbatches stand for
    raw_tokens: int = 0
    #: rows whose logits the LM head computes (compact: unique physical rows; only those of
    #: action positions with ``logprob_positions="actions"``); visible full-attention pairs
    logit_rows: int = 0
    attention_pairs: int = 0
    #: useful training FLOPs (harts.models.flops), recomputation excluded
    flops: float = 0.0
    #: untimed first microbatch (compile, autotune, allocator), seconds
    warmup_seconds: float = 0.0
    #: graphs torch.compile (Dynamo) built during the timed step (all its runs, with
    #: ``repeats``; likewise the Core run's and the allocator's counts below): 0 when the warm-up
    #: compiled every variant the step needs (a compilation inside the timed step inflates its time)
    compiles_in_timed_step: int = 0
    #: Triton kernel specializations first used during the timed step (compiled, or loaded from
    #: Triton's disk cache: a kernel variant the warm-up did not meet), by kernel name
    triton_variants_in_timed_step: list[str] = field(default_factory=list)
    #: seconds from ``clock_origin`` (``bench_step``; ``harts bench``: the command's start) to
    #: this side's first timed microbatch: the cold start, untimed warm-up included; None
    #: without an origin
    seconds_to_timed: float | None = None
    #: seconds per component and phase: {component: {forward, backward, recompute}}; "other"
    #: is the timed step minus the regions
    breakdown: dict = field(default_factory=dict)
    #: per timed microbatch, in order: its seconds (device events on CUDA: the time from its
    #: first launch to the next one's, so host gaps count) and its rows (as ``rows``)
    microbatch_seconds: list[float] = field(default_factory=list)
    microbatch_rows: list[int] = field(default_factory=list)
    #: per timed microbatch: its visible full-attention pairs (as ``attention_pairs``)
    microbatch_pairs: list[int] = field(default_factory=list)
    #: per timed microbatch: the sequential chunk steps of its linear-attention state recurrence
    #: (``recurrence_chunk_steps``)
    microbatch_chain: list[int] = field(default_factory=list)
    #: harts only: seconds of the step as ``harts train`` runs it (the step planner, then each
    #: microbatch prepared on a host thread while the one before it is launched), wall clock to the
    #: last microbatch's end; None when not run (Core then charges ``plan_seconds +
    #: train_seconds``)
    core_seconds: float | None = None
    #: graphs torch.compile built during that run (0 when the earlier runs met every variant)
    compiles_in_core_run: int = 0
    #: Triton kernel specializations first used during that run (as ``triton_variants_in_timed_step``)
    triton_variants_in_core_run: list[str] = field(default_factory=list)
    #: CUDA caching-allocator events that synchronize the device, in the timed step and in the
    #: Core run: retries after a failed allocation (each frees cached blocks, a device sync) and
    #: blocks handed back to the driver (``cudaFree`` synchronizes); 0 on CPU
    allocator_syncs: int = 0
    allocator_syncs_in_core_run: int = 0
    #: with ``repeats`` > 1 (``bench_step``): the seconds of every timed run of the step, in
    #: order; ``train_seconds`` and everything per microbatch and per component are the median
    #: run's (the lower median for an even count). One entry otherwise
    train_seconds_runs: list[float] = field(default_factory=list)
    #: harts only, likewise: every Core run's seconds (the step planner's time included), in
    #: order; ``core_seconds`` is their median
    core_seconds_runs: list[float] = field(default_factory=list)
    #: harts only: the median Core run's seconds per microbatch (as ``microbatch_seconds``; the
    #: first includes the wait for its preparation), beside the F/B/Grad run's
    core_microbatch_seconds: list[float] = field(default_factory=list)
    #: harts only: the seconds the median Core run's host waited for microbatches' preparation
    #: (the first one's included: nothing runs before it)
    core_prepare_wait_seconds: float | None = None

    @property
    def core_time(self) -> float:
        """The seconds Core charges: ``core_seconds`` when run, else planning ahead + F/B/Grad."""
        return self.core_seconds if self.core_seconds is not None else self.plan_seconds + self.train_seconds

    @property
    def critical_plan_seconds(self) -> float:
        """Planning on the step's critical path: Core time less F/B/Grad time (two runs: a few
        ms of run-to-run noise either way)."""
        return self.core_time - self.train_seconds

    def microbatch_fit(self) -> dict[str, float] | None:
        """Least-squares ``seconds = fixed + per_row * rows`` over the timed microbatches (None with
        fewer than 3 or all of one size): what a microbatch costs beyond its rows."""
        x = np.asarray(self.microbatch_rows, dtype=float)
        y = np.asarray(self.microbatch_seconds, dtype=float)
        if x.size < 3 or x.size != y.size or np.ptp(x) == 0:
            return None
        per_row, fixed = np.polyfit(x, y, 1)
        return {"fixed_seconds": float(fixed), "seconds_per_1k_rows": float(per_row * 1e3)}

    @property
    def rows_per_second(self) -> float:
        return self.rows / max(self.train_seconds, 1e-12)

    @property
    def raw_tokens_per_second(self) -> float:
        return self.raw_tokens / max(self.train_seconds, 1e-12)

    @property
    def tflops(self) -> float:
        return self.flops / max(self.train_seconds, 1e-12) / 1e12


@dataclass
class StepBench:
    step: int
    paths: int
    raw_tokens: int
    baseline: BenchSide
    harts: BenchSide
    dp: int = 1
    replica: int = 0
    #: predicted work of every replica: harts compact tokens, baseline raw tokens
    predicted_harts: list[int] = field(default_factory=list)
    predicted_baseline: list[int] = field(default_factory=list)
    optimizer_seconds: float | None = None
    peak_tflops: float | None = None
    #: the step planner's seconds (``plan_step``, whole-step compaction included): the part of
    #: harts' planning that runs before any microbatch can start
    step_plan_seconds: float | None = None
    #: the step planner's worker processes (``PlannerWorkers``; 0: planned in this process) and,
    #: with workers, the same planning again in this process alone (seconds) and whether it made
    #: the same plan (it must: the workers only run the same tasks elsewhere)
    planner_workers: int = 0
    step_plan_seconds_serial: float | None = None
    planner_workers_same_plan: bool | None = None

    # With dp > 1 the two sides' replica shares hold different trajectories, so speedups compare
    # raw tokens per second; with dp = 1 both run the whole step and this is the time ratio.
    @property
    def compression(self) -> float:
        """Raw tokens / compact rows of the harts microbatches timed."""
        return self.harts.raw_tokens / max(self.harts.rows, 1)

    def _rate(self, side: BenchSide, seconds: float) -> float:
        return side.raw_tokens / max(seconds, 1e-12)

    @property
    def fbg_speedup(self) -> float:
        return self._rate(self.harts, self.harts.train_seconds) / max(
            self._rate(self.baseline, self.baseline.train_seconds), 1e-12
        )

    @property
    def core_speedup(self) -> float:
        harts = self._rate(self.harts, self.harts.core_time)
        return harts / max(self._rate(self.baseline, self.baseline.train_seconds), 1e-12)

    def mfu(self, side: BenchSide) -> float | None:
        return None if not self.peak_tflops else side.tflops / self.peak_tflops

    def ideal(self) -> dict | None:
        """harts at the baseline's time per unit of work, component by component: what the
        speedup would be if compaction cost nothing beyond the work it removes.

        The unit is a row for linear attention, MoE and "other" (the baseline's semantic rows,
        harts' compact rows), an LM-head row for the head, and a visible (query, key) pair for
        attention (a tree's pairs compress less than its rows). Returns {"seconds": ideal harts
        seconds per component, "ratio": measured / ideal per component, "total_seconds",
        "fbg_speedup", "of_compression"}; None without a breakdown or baseline work.
        """
        b, h = self.baseline, self.harts
        units = {
            "linear_attention": (b.rows, h.rows),
            "moe": (b.rows, h.rows),
            "other": (b.rows, h.rows),
            "lm_head": (b.logit_rows, h.logit_rows),
            "attention": (b.attention_pairs, h.attention_pairs),
        }
        if not b.breakdown or not h.breakdown or b.train_seconds <= 0 or b.raw_tokens <= 0:
            return None
        seconds, ratio = {}, {}
        for c in COMPONENTS:
            base_work, harts_work = units[c]
            base_s = b.breakdown.get(c, {}).get("total", 0.0)
            if base_s > 0 and base_work <= 0:
                return None
            seconds[c] = base_s * harts_work / base_work if base_work > 0 else 0.0
            measured = h.breakdown.get(c, {}).get("total", 0.0)
            ratio[c] = measured / seconds[c] if seconds[c] > 0 else None
        total = sum(seconds.values())
        fbg = self._rate(h, total) / max(self._rate(b, b.train_seconds), 1e-12)
        return {
            "seconds": {c: round(v, 4) for c, v in seconds.items()},
            "ratio": {c: None if v is None else round(v, 4) for c, v in ratio.items()},
            "total_seconds": round(total, 4),
            "fbg_speedup": round(fbg, 4),
            "of_compression": round(fbg / max(self.compression, 1e-12), 4),
        }

    def recurrence_fit(self) -> dict | None:
        """What the linear-attention recurrence's sequential chunk steps cost, from the timed
        microbatches of both sides together (they run the same model on the same device).

        Least squares ``seconds = fixed + per_row * rows + per_pair * pairs + per_step * chain``
        over every microbatch (``rows`` as ``BenchSide.rows``, ``pairs`` its visible attention
        pairs, ``chain`` = ``recurrence_chunk_steps``). The chain is latency, not work: each
        step waits for the one before it, so a microbatch whose longest recurrence is long pays
        for it whatever its rows. A tree microbatch runs one call per round, each as long as its
        longest sequence, so harts can run more steps per row than the baseline. Long sequences
        also bring attention pairs, hence the pairs term: without it the chain would be charged
        for attention. Returns {"fixed_seconds", "seconds_per_1k_rows", "seconds_per_g_pairs",
        "seconds_per_step", "rms_seconds", "rms_seconds_without_steps" (the same fit without
        the chain), "steps_per_1k_rows": {side: ...}, "harts_chain_seconds" (per_step * harts'
        steps), "harts_at_baseline_steps_seconds" (harts' measured time with its steps per row
        set to the baseline's)}; None with fewer than 5 microbatches, without chain or pair
        counts, or when the terms do not separate (a rank-deficient fit).
        """
        b, h = self.baseline, self.harts
        for side in (b, h):
            n = len(side.microbatch_seconds)
            if not len(side.microbatch_chain) == len(side.microbatch_rows) == len(side.microbatch_pairs) == n:
                return None
        rows = np.asarray(b.microbatch_rows + h.microbatch_rows, dtype=float) / 1e3
        pairs = np.asarray(b.microbatch_pairs + h.microbatch_pairs, dtype=float) / 1e9
        chain = np.asarray(b.microbatch_chain + h.microbatch_chain, dtype=float)
        y = np.asarray(b.microbatch_seconds + h.microbatch_seconds, dtype=float)
        if y.size < 5 or not chain.any():
            return None
        x = np.stack([np.ones_like(rows), rows, pairs, chain], axis=1)
        if np.linalg.matrix_rank(x) < 4:
            return None
        coef = np.linalg.lstsq(x, y, rcond=None)[0]
        coef_wo = np.linalg.lstsq(x[:, :3], y, rcond=None)[0]
        rms = float(np.sqrt(np.mean((x @ coef - y) ** 2)))
        rms_wo = float(np.sqrt(np.mean((x[:, :3] @ coef_wo - y) ** 2)))
        per_row = {
            name: sum(side.microbatch_chain) / max(sum(side.microbatch_rows) / 1e3, 1e-12)
            for name, side in (("baseline", b), ("harts", h))
        }
        harts_steps = float(sum(h.microbatch_chain))
        extra = harts_steps - per_row["baseline"] * sum(h.microbatch_rows) / 1e3
        return {
            "fixed_seconds": round(float(coef[0]), 5),
            "seconds_per_1k_rows": round(float(coef[1]), 6),
            "seconds_per_g_pairs": round(float(coef[2]), 5),
            "seconds_per_step": round(float(coef[3]), 7),
            "rms_seconds": round(rms, 5),
            "rms_seconds_without_steps": round(rms_wo, 5),
            "steps_per_1k_rows": {k: round(v, 3) for k, v in per_row.items()},
            "harts_chain_seconds": round(float(coef[3]) * harts_steps, 4),
            "harts_at_baseline_steps_seconds": round(h.train_seconds - float(coef[3]) * extra, 4),
        }

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(
            compression=round(self.compression, 4),
            fbg_speedup=round(self.fbg_speedup, 4),
            core_speedup=round(self.core_speedup, 4),
            critical_plan_seconds=round(self.harts.critical_plan_seconds, 4),
            ideal=self.ideal(),
            recurrence_fit=self.recurrence_fit(),
        )
        for name in ("baseline", "harts"):
            side = getattr(self, name)
            mfu = self.mfu(side)
            d[name].update(
                rows_per_second=round(side.rows_per_second, 1),
                raw_tokens_per_second=round(side.raw_tokens_per_second, 1),
                tflops=round(side.tflops, 3),
                mfu=None if mfu is None else round(mfu, 4),
                microbatch_fit=side.microbatch_fit(),
            )
        return d


def recurrence_words(fit: dict) -> str:
    """One line of ``StepBench.recurrence_fit``'s result for a report."""
    per = fit["steps_per_1k_rows"]
    return (
        f"linear-attention recurrence: {per['baseline']:.1f} (baseline) / {per['harts']:.1f} (harts) sequential "
        f"chunk steps per 1k rows; fit over both sides' microbatches: {fit['fixed_seconds']:.3f} s + "
        f"{fit['seconds_per_1k_rows'] * 1e3:.2f} ms per 1k rows + {fit['seconds_per_g_pairs']:.3f} s per G attention "
        f"pairs + {fit['seconds_per_step'] * 1e3:.3f} ms per chunk step (rms {fit['rms_seconds']:.3f} s; "
        f"{fit['rms_seconds_without_steps']:.3f} s without the steps): harts' "
        f"steps ~{fit['harts_chain_seconds']:.2f} s, at the baseline's steps per row harts would take "
        f"~{fit['harts_at_baseline_steps_seconds']:.2f} s"
    )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def microbatch_counts(
    sub: RolloutBatch,
    inputs,  # noqa: ANN001
    mode: str,
    logprob_positions: str = "all",
) -> tuple[int, int, int]:
    """(rows, logit rows, visible attention pairs) that one microbatch executes (host data only):
    ``inputs`` is what the model runs (a ``prepare_compact`` result in compact mode; unused in
    trajectory mode). Logit rows are those the LM head computes under ``logprob_positions``
    (``ExecutionConfig``): every predicting position, or those whose target is an action; in
    compact mode the unique physical rows among them. ``FlopModel.training_flops`` of these is
    the work MFU counts."""
    pred = sub.predicting_positions()
    if logprob_positions == "actions":
        pred = pred[sub.action_logprob_entries()]
    if mode == "trajectory":
        lengths = sub.lengths.astype(np.int64)
        return int(sub.num_tokens), int(len(pred)), int((lengths * (lengths + 1) // 2).sum())
    layout = inputs.layout
    own = ~np.asarray(layout.is_pad, dtype=bool)
    pairs = int((np.asarray(layout.position)[own] + 1).sum())
    logit_rows = int(np.unique(np.asarray(layout.semantic_to_phys)[pred]).size)
    return int(inputs.cb.num_compact_tokens), logit_rows, pairs


def recurrence_chunk_steps(
    sub: RolloutBatch,
    inputs,  # noqa: ANN001
    mode: str,
    chunk_size: int,
) -> int:
    """Sequential chunk steps of one microbatch's linear-attention state recurrence, per layer
    (host data only): the chunks of its longest sequence in trajectory mode (one call, every
    trajectory a sequence), and in compact mode the sum over its calls (rounds: each waits for
    the one before) of the chunks of each call's longest sequence, replayed rows included.
    ``inputs`` is a ``prepare_compact`` result in compact mode (unused in trajectory mode)."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    if mode == "trajectory":
        return trajectory_chunk_steps(sub.lengths, chunk_size)
    return layout_chunk_steps(inputs.layout, chunk_size)


def trajectory_chunk_steps(lengths: np.ndarray, chunk_size: int) -> int:
    """``recurrence_chunk_steps`` of a trajectory-wise microbatch from its trajectory lengths [N]:
    the chunks of the longest (one call, every trajectory a sequence)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    return int(-(-int(lengths.max()) // chunk_size)) if lengths.size else 0


def layout_chunk_steps(layout, chunk_size: int) -> int:  # noqa: ANN001 - a harts.plan.layout.Layout
    """``recurrence_chunk_steps`` of a compact microbatch from its layout: the sum over its
    calls of the chunks of each call's longest sequence (``cu_seqlens``, replay included)."""
    steps = 0
    for view in layout.rounds:
        seq = np.diff(np.asarray(view.cu_seqlens, dtype=np.int64))
        if seq.size:
            steps += int(-(-int(seq.max()) // chunk_size))
    return steps


def warmup_microbatches(executed_rows: list[int], rows: list[int]) -> list[int]:
    """Indices of the microbatches the untimed warm-up runs (compile, autotune, allocator), so
    that the timed step meets no first-time compilation:

    * the first;
    * the one with the fewest ``rows`` (a call below ``harts.ops.compiled.MIN_ROWS`` rows is
      padded, which compiles the glue once more);
    * the first whose executed row count (``executed_rows``: the T the kernels take, physical
      rows with replay in compact mode) is a multiple of 16 if the first's is not, or the other
      way round. Triton compiles a kernel once per divisibility class of its integer arguments
      (a multiple of 16 gets its own binary), and every fla / tree / Inductor kernel takes T:
      without this warm-up the first timed microbatch of the other class pays those
      compilations (``benchmarks/results/ling3-tiny_h200_2026-12-01_selective-recompute.md``).
    """
    if not executed_rows:
        return []
    chosen = [0, min(range(len(rows)), key=lambda i: rows[i])]
    first_class = executed_rows[0] % 16 == 0
    other = next((i for i, t in enumerate(executed_rows) if (t % 16 == 0) != first_class), None)
    if other is not None:
        chosen.append(other)
    return list(dict.fromkeys(chosen))


def _run_side(
    model: HybridLM,
    batch: RolloutBatch,
    prepare: Callable[[], list[tuple[RolloutBatch, Any]]],
    execution: ExecutionConfig,
    *,
    plan_seconds: float,
    warmup: bool,
    flop_model: FlopModel,
    progress: Callable[[int, str], Any] | None = None,
    profile_dir: str | None = None,
    clock_origin: float | None = None,
    repeats: int = 1,
) -> BenchSide:
    mode = execution.mode
    device = model.embed_tokens.weight.device
    one = _microbatch_runner(model, batch, execution)
    t0 = time.perf_counter()
    prepared = prepare()  # (microbatch, model inputs) in slot order
    prep_seconds = time.perf_counter() - t0 if mode == "compact" else 0.0
    counts = [
        microbatch_counts(sub, inputs, mode, execution.logprob_positions) for sub, inputs in prepared
    ]  # (rows, logit rows, pairs)
    # the recurrence's chain only where the model has a linear-attention layer
    linear = any(LAYER_TYPES[c][0] == "linear" for c in model.config.layer_pattern)
    chunk = model.config.chunk_size
    chains = [recurrence_chunk_steps(sub, inputs, mode, chunk) for sub, inputs in prepared] if linear else []
    raw = sum(sub.num_tokens for sub, _ in prepared)
    logit_rows = sum(c[1] for c in counts)
    pairs = sum(c[2] for c in counts)

    warm = 0.0
    if warmup and prepared:
        executed = [sub.num_tokens if mode == "trajectory" else inputs.layout.num_rows for sub, inputs in prepared]
        _sync(device)
        t0 = time.perf_counter()
        for i in warmup_microbatches(executed, [c[0] for c in counts]):
            one(*prepared[i])
        _sync(device)
        warm = time.perf_counter() - t0
    model.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    _sync(device)
    name = "baseline" if mode == "trajectory" else "harts"
    graphs_before, syncs_before, variants_before = _compiled_graphs(), _allocator_syncs(device), _triton_variants()
    to_timed = None if clock_origin is None else round(time.perf_counter() - clock_origin, 3)
    passes = []
    for r in range(repeats):
        bar = (
            progress(len(prepared), f"{name} microbatches" + (f" ({r + 1}/{repeats})" if repeats > 1 else ""))
            if progress
            else None
        )
        passes.append(_timed_pass(model, one, prepared, bar))
        if bar is not None:
            bar.close()
    runs = [p.seconds for p in passes]
    chosen = passes[_median_index(runs)]
    seconds, breakdown, mb_seconds, mb_rows = chosen.seconds, chosen.breakdown, chosen.mb_seconds, chosen.mb_rows
    rows, calls, replay = chosen.rows, chosen.calls, chosen.replay
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    model.zero_grad(set_to_none=True)
    if profile_dir and prepared:
        _profile(
            one,
            prepared[0],
            device,
            os.path.join(profile_dir, f"{name}.json"),
        )
        model.zero_grad(set_to_none=True)
    return BenchSide(
        microbatches=len(prepared),
        rows=rows,
        calls=calls,
        replay_rows=replay,
        plan_seconds=round(plan_seconds + prep_seconds, 4),
        train_seconds=round(seconds, 4),
        peak_memory_gb=None if peak is None else round(peak, 3),
        raw_tokens=raw,
        logit_rows=logit_rows,
        attention_pairs=pairs,
        flops=flop_model.training_flops(rows, logit_rows, pairs),
        warmup_seconds=round(warm, 3),
        compiles_in_timed_step=_compiled_graphs() - graphs_before,
        triton_variants_in_timed_step=TRITON_VARIANTS[variants_before:],
        allocator_syncs=_allocator_syncs(device) - syncs_before,
        seconds_to_timed=to_timed,
        train_seconds_runs=[round(x, 4) for x in runs],
        breakdown={k: {p: round(s, 4) for p, s in v.items()} for k, v in breakdown.items()},
        microbatch_seconds=[round(x, 5) for x in mb_seconds],
        microbatch_rows=mb_rows,
        microbatch_pairs=[int(c[2]) for c in counts],
        microbatch_chain=chains,
    )


def _median_index(xs: Sequence[float]) -> int:
    """The index of the median of ``xs`` (the lower median for an even count)."""
    return sorted(range(len(xs)), key=xs.__getitem__)[(len(xs) - 1) // 2]


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


def _timed_pass(model: HybridLM, one: Callable[..., dict], prepared: list[tuple[RolloutBatch, Any]], bar: Any) -> _Pass:
    """Run ``prepared`` once under the region timers, the device synchronized at both ends: wall
    seconds, seconds per component and phase ("other": the rest), per-microbatch seconds (device
    events on CUDA) and rows, and the forward's counts. Gradients are discarded."""
    device = model.embed_tokens.weight.device
    model.zero_grad(set_to_none=True)
    _sync(device)
    rows = calls = replay = 0
    marks, mb_rows = [], []
    with regions.RegionTimer(device) as timer:
        t0 = time.perf_counter()
        for sub, inputs in prepared:
            marks.append(_mark(device))
            info = one(sub, inputs)
            mb_rows.append(int(info.get("compact_rows", info["rows"])))
            rows += mb_rows[-1]
            calls += int(info["calls"])
            replay += int(info["replay_rows"])
            if bar is not None:
                bar.update(1)
        marks.append(_mark(device))
        _sync(device)
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
    return _Pass(seconds, breakdown, [_between(a, b) for a, b in zip(marks, marks[1:])], mb_rows, rows, calls, replay)


def _microbatch_runner(model: HybridLM, batch: RolloutBatch, execution: ExecutionConfig) -> Callable[..., dict]:
    """``one(sub, inputs)``: a microbatch's forward, GRPO loss (normalized by the step's
    denominator), MoE router objective and backward; returns the forward's info."""
    normalizer = grpo_normalizer(batch)
    z_coef, aux_coef = model.config.router_z_loss_coef, model.config.router_aux_loss_coef

    def one(sub: RolloutBatch, inputs) -> dict:  # noqa: ANN001
        out = model(inputs, execution)
        loss = grpo_loss(out.logprobs, sub, normalizer=normalizer).loss
        if out.moe_losses is not None:
            loss = loss + (sub.num_tokens / batch.num_tokens) * out.moe_objective(z_coef, aux_coef)
        loss.backward()
        return out.info

    return one


def _core_run_seconds(
    model: HybridLM,
    batch: RolloutBatch,
    items: Sequence[Callable[[], tuple[RolloutBatch, Any]]],
    execution: ExecutionConfig,
) -> tuple[float, list[float], float]:
    """Wall seconds of the microbatches as ``harts train`` runs them, each microbatch's seconds
    (device events on CUDA, from the start of the run for the first), and the seconds the host
    waited for the preparations (``Prefetched.waited``): each of ``items``
    (slot order) prepares its microbatch on the host, (microbatch, model inputs), on a background
    thread while the one before it is launched (``harts.plan.prefetch.Prefetched``, as ``harts
    train`` does; no device sync between them). Gradients are discarded."""
    device = model.embed_tokens.weight.device
    one = _microbatch_runner(model, batch, execution)
    model.zero_grad(set_to_none=True)
    _sync(device)
    marks = []
    # under the region timers as the F/B/Grad run (their events cost the same in both runs)
    with regions.RegionTimer(device):
        t0 = time.perf_counter()
        marks.append(_mark(device))
        ahead = Prefetched(items)
        for item in ahead:
            one(*item)
            marks.append(_mark(device))
        _sync(device)
        seconds = time.perf_counter() - t0
    model.zero_grad(set_to_none=True)
    return seconds, [_between(a, b) for a, b in zip(marks, marks[1:])], ahead.waited


def _allocator_syncs(device: torch.device) -> int:
    """The CUDA caching allocator's device-synchronizing events so far on ``device``: allocation
    retries (a failed cudaMalloc frees the cache and synchronizes) and blocks released to the
    driver (each ``cudaFree`` synchronizes); 0 off CUDA."""
    if device.type != "cuda":
        return 0
    stats = torch.cuda.memory_stats(device)
    return int(stats.get("num_alloc_retries", 0)) + int(stats.get("num_device_free", 0))


def _mark(device: torch.device) -> object:
    """A point in the device's stream order (a CUDA event) or, on CPU, in host time."""
    if device.type == "cuda":
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev
    return time.perf_counter()


def _between(a: Any, b: Any) -> float:
    """Seconds between two ``_mark``s (after the device has synchronized)."""
    return a.elapsed_time(b) / 1e3 if isinstance(a, torch.cuda.Event) else b - a


#: names of the Triton kernels specialized in this process since ``_triton_variants`` first ran,
#: one entry per specialization (``jit_post_compile_hook``)
TRITON_VARIANTS: list[str] = []
_TRITON_HOOKED = [False]


def _triton_variants() -> int:
    """How many Triton kernel specializations this process has first used (compiled, or loaded
    from Triton's disk cache) since the first call, which installs the counting hook (Triton's
    ``knobs.runtime.jit_post_compile_hook``, chained to any hook already there; it runs once per
    new specialization, never per launch). 0 without Triton's knobs (Triton < 3.4)."""
    if not _TRITON_HOOKED[0]:
        try:
            from triton import knobs
        except ImportError:
            return 0
        previous = knobs.runtime.jit_post_compile_hook

        def count(*args: Any, **kwargs: Any) -> Any:
            TRITON_VARIANTS.append(str(getattr(kwargs.get("fn"), "name", "?")))
            return previous(*args, **kwargs) if previous is not None else None

        knobs.runtime.jit_post_compile_hook = count
        _TRITON_HOOKED[0] = True
    return len(TRITON_VARIANTS)


def _compiled_graphs() -> int:
    """Graphs Dynamo has compiled in this process so far (its ``unique_graphs`` counter)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _profile(one, item, device: torch.device, path: str) -> None:  # noqa: ANN001
    """One microbatch under the torch profiler: a Chrome trace at ``path`` and, beside it
    (``.txt``), a summary line (the microbatch's wall time, how much of it the device was busy,
    kernels launched), the device time of each region and phase (kernels attributed to the
    region that launched them, ``device_time_by_region``) with the top kernels launched outside
    every region ("other"), where the device waited for the host (``device_idle_gaps``), the
    device time outside every region by the host operator (with its input shapes: the profiler
    records shapes, a little more host time per operator) that launched it, then the 40 operators with the most self time on the device and the
    40 with the most host time (CPU runs: host only)."""
    import json

    from torch.profiler import ProfilerActivity, profile

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts, record_shapes=True) as prof:
        with regions.RegionTimer(device, annotate=True):
            t0 = time.perf_counter()
            one(*item)
            _sync(device)
            wall = time.perf_counter() - t0
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f).get("traceEvents", [])
    busy, kernels = device_busy_seconds(events)
    by_region, outside = device_time_by_region(events)
    per_region = kernels_by_region(events)
    keys = (["self_cuda_time_total"] if device.type == "cuda" else []) + ["self_cpu_time_total"]
    with open(os.path.splitext(path)[0] + ".txt", "w") as f:
        f.write(
            f"microbatch wall {wall * 1e3:.1f} ms under the profiler; device busy {busy * 1e3:.1f} ms "
            f"({busy / wall:.0%}); {kernels} kernels and copies\n"
        )
        f.write(region_table(by_region, outside, wall, busy, per_region))
        f.write(idle_table(device_idle_gaps(events)))
        ops = operators_by_region(events).get(OUTSIDE_REGIONS, [])
        if ops and device.type == "cuda":
            f.write("\ndevice time outside every region by the host operator that launched it (ms, launches):\n")
            f.writelines(f"  {t * 1e3:9.2f} {n:6d}  {op[:150]}\n" for op, t, n in ops[:30])
        for key in keys:
            f.write(f"\nsorted by {key}:\n")
            f.write(prof.key_averages().table(sort_by=key, row_limit=40, max_name_column_width=70) + "\n")


def _optimizer_seconds(model: HybridLM) -> float:
    """One AdamW step (lr 0: weights unchanged) over gradients of the parameters' size, after an
    untimed first step that creates the optimizer state; the same for both sides."""
    device = model.embed_tokens.weight.device
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    opt = torch.optim.AdamW(params, lr=0.0, weight_decay=0.0, fused=device.type == "cuda" or None)
    opt.step()
    _sync(device)
    t0 = time.perf_counter()
    opt.step()
    _sync(device)
    seconds = time.perf_counter() - t0
    del opt
    model.zero_grad(set_to_none=True)
    return seconds


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
    allocator), then once under the torch profiler (``_profile``: a Chrome trace, and beside it a
    .txt with device busy time, device time by region and the top kernels). Only those two
    microbatches are prepared. Returns the two .txt paths (baseline, harts)."""
    if not 0 <= replica < dp:
        raise ValueError(f"--replica must lie in [0, {dp}) for --dp {dp}; got {replica}")
    batch = replace(batch, old_logprobs=None, ref_logprobs=None)
    device = model.embed_tokens.weight.device
    execution = replace(ExecutionConfig.of(execution), fused_logprobs=True)
    base_side, compact_side = replace(execution, mode="trajectory"), replace(execution, mode="compact")
    raw_plan = plan_trajectory_step(batch.lengths, dp=dp, capacity=capacity)
    sub = batch.select(raw_plan.microbatches[raw_plan.for_replica(replica)[0]])
    plan = plan_step(batch, dp=dp, capacity=capacity, workers=planner_workers)
    cb, call_plan = plan.prepare_microbatch(plan.for_replica(replica)[0], model.config.chunk_size)
    items = (
        ("baseline", base_side, (sub, model.prepare_trajectory(sub, base_side))),
        ("harts", compact_side, (cb.batch, model.prepare_compact(cb, compact_side, plan=call_plan))),
    )
    paths = []
    for name, side, item in items:
        one = _microbatch_runner(model, batch, side)
        one(*item)  # untimed: compile, autotune, allocator
        model.zero_grad(set_to_none=True)
        _sync(device)
        _profile(one, item, device, os.path.join(profile_dir, f"{name}.json"))
        model.zero_grad(set_to_none=True)
        paths.append(os.path.join(profile_dir, f"{name}.txt"))
    return paths


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


def _with_core_run(
    harts: BenchSide,
    model: HybridLM,
    batch: RolloutBatch,
    plan: StepPlan,
    replica: int,
    compact_side: ExecutionConfig,
    plan_seconds: float,
    repeats: int,
) -> BenchSide:
    """``harts`` with its Core figures: the step planner's time measured before plus a run that
    prepares every microbatch as ``harts train`` does (its clock holds every preparation)."""
    device = model.embed_tokens.weight.device

    def as_trained(k: int) -> tuple[RolloutBatch, Any]:
        # ``harts train``'s preparation of microbatch k: its slice and call plan, then layout
        # and LM-head plan
        cb, call_plan = plan.prepare_microbatch(k, model.config.chunk_size)
        return cb.batch, model.prepare_compact(cb, compact_side, plan=call_plan)

    items = [functools.partial(as_trained, k) for k in plan.for_replica(replica)]
    graphs_before, syncs_before, variants_before = _compiled_graphs(), _allocator_syncs(device), _triton_variants()
    core = [_core_run_seconds(model, batch, items, compact_side) for _ in range(repeats)]
    runs = [plan_seconds + seconds for seconds, _, _ in core]
    median = _median_index(runs)
    return replace(
        harts,
        core_seconds=round(runs[median], 4),
        core_seconds_runs=[round(x, 4) for x in runs],
        core_microbatch_seconds=[round(x, 5) for x in core[median][1]],
        core_prepare_wait_seconds=round(core[median][2], 4),
        compiles_in_core_run=_compiled_graphs() - graphs_before,
        triton_variants_in_core_run=TRITON_VARIANTS[variants_before:],
        allocator_syncs_in_core_run=_allocator_syncs(device) - syncs_before,
    )


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
    if not 0 <= replica < dp:
        raise ValueError(f"--replica must lie in [0, {dp}) for --dp {dp}; got {replica}")
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1; got {repeats}")
    batch = replace(batch, old_logprobs=None, ref_logprobs=None)
    plan, plan_seconds, serial_seconds, same_plan = _timed_plan(batch, dp, capacity, planner_workers)
    workers = int(plan.info.get("workers", 0))
    predicted_harts = [int(x) for x in plan.work_matrix().sum(1)]
    # the baseline's own microbatches: raw tokens packed at the capacity (the harness's and
    # ``harts train --mode trajectory``'s plan)
    raw_plan = plan_trajectory_step(batch.lengths, dp=dp, capacity=capacity)
    predicted_base = [int(w) for w in raw_plan.replica_work()]
    base_groups = [raw_plan.microbatches[k] for k in raw_plan.for_replica(replica)]
    flop_model = FlopModel.from_model(model)
    execution = replace(ExecutionConfig.of(execution), fused_logprobs=True)
    kw: dict[str, Any] = dict(
        warmup=warmup,
        flop_model=flop_model,
        progress=progress,
        profile_dir=profile_dir,
        clock_origin=clock_origin,
        repeats=repeats,
    )
    compact_side = replace(execution, mode="compact")

    def prepare_harts() -> list[tuple[RolloutBatch, Any]]:
        # slices of the step's compaction with their call plans: no microbatch is compacted twice
        return [
            (c.batch, model.prepare_compact(c, compact_side, plan=p))
            for c, p in plan.prepare_replica(replica, model.config.chunk_size)
        ]

    def prepare_baseline() -> list[tuple[RolloutBatch, Any]]:
        # the LM head's host inputs made ahead, as prepare_compact makes harts' (not timed on
        # either side's F/B/Grad clock)
        base_side = replace(execution, mode="trajectory")
        return [(sub, model.prepare_trajectory(sub, base_side)) for sub in (batch.select(g) for g in base_groups)]

    baseline = _run_side(model, batch, prepare_baseline, replace(execution, mode="trajectory"), plan_seconds=0.0, **kw)
    harts = _run_side(model, batch, prepare_harts, compact_side, plan_seconds=plan_seconds, **kw)
    if core_run:
        harts = _with_core_run(harts, model, batch, plan, replica, compact_side, plan_seconds, repeats)
    return StepBench(
        step=step,
        paths=batch.num_trajectories,
        raw_tokens=batch.num_tokens,
        baseline=baseline,
        harts=harts,
        dp=dp,
        replica=replica,
        predicted_harts=predicted_harts,
        predicted_baseline=predicted_base,
        optimizer_seconds=round(_optimizer_seconds(model), 4) if optimizer else None,
        peak_tflops=peak_tflops,
        step_plan_seconds=round(plan_seconds, 4),
        planner_workers=workers,
        step_plan_seconds_serial=serial_seconds,
        planner_workers_same_plan=same_plan,
    )
