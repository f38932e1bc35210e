"""What ``harts bench`` reports for one step: each side's figures (``BenchSide``) and the step's
comparison of the two (``StepBench``: compression, F/B/Grad and Core speedups, MFU, the ideal
at the baseline's cost per unit of work, the recurrence fit), as ``harts.experiments.step_bench``
measures them (its module docstring defines every figure).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

__all__ = ["COMPONENTS", "BenchSide", "StepBench", "recurrence_words"]

#: breakdown components: the model's regions, plus "other layers" (the rest of forward/backward)
COMPONENTS = ("linear_attention", "attention", "moe", "lm_head", "other")


@dataclass
class BenchSide:
    """One side's timed step (baseline or harts): what it ran, how long it took, where the time went."""

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
    """One step timed both ways, and what the two sides' figures say together."""

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
