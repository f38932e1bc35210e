"""Training-step speed: harts (compact) against the trajectory-wise baseline, same weights.

Both sides train on the whole step (every trajectory), as in the paper's Table 4:

* baseline: the trees are expanded into trajectories and packed, in batch order, into
  microbatches of at most T raw tokens (a longer trajectory goes alone); each microbatch runs
  ``mode="trajectory"``;
* harts: ``plan_step(dp=1, capacity=T)`` groups trajectories by compact work; each
  microbatch is compacted, call-planned and laid out, then runs ``mode="compact"``.

Each microbatch does forward, GRPO loss normalized by the step's denominator, MoE router
objective, backward (gradients accumulate; no optimizer update). Reported per step:

    compression   raw rows / non-replay compact rows of the harts microbatches
    F/B/Grad      baseline time / harts time (forward + backward + gradients)
    Core          baseline time / (harts planning + harts time), planning = step planner +
                  per-microbatch compaction, call planning and layout
and the peak device memory of each side (CUDA ``max_memory_allocated``; not measured on CPU).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, replace

import numpy as np
import torch

from harts.models.hybrid_lm import HybridLM
from harts.plan.step import plan_step
from harts.rl.grpo import grpo_loss, grpo_normalizer
from harts.tree.batch import RolloutBatch

__all__ = ["BenchSide", "StepBench", "bench_step", "pack_raw"]


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


@dataclass
class StepBench:
    step: int
    paths: int
    raw_tokens: int
    baseline: BenchSide
    harts: BenchSide

    @property
    def compression(self) -> float:
        return self.baseline.rows / max(self.harts.rows, 1)

    @property
    def fbg_speedup(self) -> float:
        return self.baseline.train_seconds / max(self.harts.train_seconds, 1e-12)

    @property
    def core_speedup(self) -> float:
        return self.baseline.train_seconds / max(self.harts.train_seconds + self.harts.plan_seconds, 1e-12)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(compression=round(self.compression, 4), fbg_speedup=round(self.fbg_speedup, 4),
                 core_speedup=round(self.core_speedup, 4))
        return d


def pack_raw(batch: RolloutBatch, capacity: int) -> list[list[int]]:
    """Baseline microbatches: trajectories in batch order, at most ``capacity`` raw tokens each."""
    out: list[list[int]] = []
    cur: list[int] = []
    used = 0
    for j, n in enumerate(batch.lengths.tolist()):
        if cur and used + n > capacity:
            out.append(cur)
            cur, used = [], 0
        cur.append(j)
        used += n
    if cur:
        out.append(cur)
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _run_side(model: HybridLM, batch: RolloutBatch, groups: list[list[int]], mode: str, *, recompute: bool,
              attention: str, plan_seconds: float, warmup: bool, la_backend: str) -> BenchSide:
    device = model.embed_tokens.weight.device
    normalizer = grpo_normalizer(batch)
    z_coef, aux_coef = model.config.router_z_loss_coef, model.config.router_aux_loss_coef
    prepared = []
    t0 = time.perf_counter()
    for mb in groups:
        sub = batch.select(mb)
        prepared.append((sub, model.prepare_compact(sub) if mode == "compact" else sub))
    prep_seconds = time.perf_counter() - t0 if mode == "compact" else 0.0

    def one(sub: RolloutBatch, inputs) -> dict:  # noqa: ANN001
        out = model(inputs, mode=mode, recompute=recompute, attention=attention, fused_logprobs=True,
                    linear_attention_backend=la_backend)
        loss = grpo_loss(out.logprobs, sub, normalizer=normalizer).loss
        if out.moe_losses is not None:
            loss = loss + (sub.num_tokens / batch.num_tokens) * out.moe_objective(z_coef, aux_coef)
        loss.backward()
        return out.info

    if warmup:  # compile / autotune / allocator warm-up on the first microbatch, untimed
        one(*prepared[0])
    model.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    _sync(device)
    rows = calls = replay = 0
    t0 = time.perf_counter()
    for sub, inputs in prepared:
        info = one(sub, inputs)
        rows += int(info.get("compact_rows", info["rows"]))
        calls += int(info["calls"])
        replay += int(info["replay_rows"])
    _sync(device)
    seconds = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    model.zero_grad(set_to_none=True)
    return BenchSide(microbatches=len(groups), rows=rows, calls=calls, replay_rows=replay,
                     plan_seconds=round(plan_seconds + prep_seconds, 4), train_seconds=round(seconds, 4),
                     peak_memory_gb=None if peak is None else round(peak, 3))


def bench_step(model: HybridLM, batch: RolloutBatch, *, capacity: int, step: int = 0, recompute: bool = False,
               attention: str = "gather", warmup: bool = True, la_backend: str = "reference") -> StepBench:
    """Time one step both ways on ``model`` (its weights are not changed)."""
    batch = replace(batch, old_logprobs=None, ref_logprobs=None)
    t0 = time.perf_counter()
    plan = plan_step(batch, dp=1, capacity=capacity)
    plan_seconds = time.perf_counter() - t0
    groups = [plan.microbatches[k] for k in np.argsort(plan.slot, kind="stable")]
    baseline = _run_side(model, batch, pack_raw(batch, capacity), "trajectory", recompute=recompute,
                         attention=attention, plan_seconds=0.0, warmup=warmup, la_backend=la_backend)
    harts = _run_side(model, batch, groups, "compact", recompute=recompute, attention=attention,
                      plan_seconds=plan_seconds, warmup=warmup, la_backend=la_backend)
    return StepBench(step=step, paths=batch.num_trajectories, raw_tokens=batch.num_tokens,
                     baseline=baseline, harts=harts)
