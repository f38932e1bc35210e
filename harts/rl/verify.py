"""Verification harness: one measured training step of a HybridLM, and the agreement between
two such steps (compact against the trajectory-wise oracle).

``run_step`` runs forward + GRPO loss (+ MoE router losses) + backward in one mode and keeps
detached copies of everything that must agree between modes: log-probs, loss, MoE losses
and counts, every parameter gradient. ``compare_runs`` reports max relative differences:

    rel(a, b) = max|a - b| / max(max|b|, tiny)        per tensor
    gradients:  max over parameters of max|a - b| / max(max|b|, 1e-3 * the largest |gradient|)

A parameter whose gradient is a thousand times smaller than the step's largest is compared at
that floor: its few-ulp rounding differences would otherwise read as large relative errors.

Used by ``harts compare`` and the model tests. (Lives in rl/ because it needs the GRPO loss.)
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from harts.models.execution.config import ExecutionConfig
from harts.models.hybrid_lm import CompactInputs, HybridLM, TrajectoryInputs
from harts.rl.grpo import grpo_loss
from harts.tree.batch import RolloutBatch

__all__ = ["StepResult", "run_step", "compare_runs", "rel_diff"]

_TINY = 1e-300


@dataclass
class StepResult:
    logprobs: torch.Tensor
    loss: float
    z_loss: torch.Tensor | None
    aux_loss: torch.Tensor | None
    expert_counts: torch.Tensor | None
    grads: dict[str, torch.Tensor]
    seconds: float
    peak_bytes: int
    info: dict[str, Any] = field(default_factory=dict)


@contextlib.contextmanager
def _native_stderr_silenced() -> Iterator[None]:
    """Send file descriptor 2 to /dev/null for the block.

    The torch profiler's kineto backend logs ``USDT: ... profiler_start`` / ``profiler_stop``
    from C++ straight to fd 2 (no log level or environment variable turns it off), which would
    interleave with the command's progress and output. Python-level writes to ``sys.stderr``
    are flushed first; nothing of ours runs inside the block.
    """
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError, AttributeError):
        yield  # no usable fd 2 (embedded interpreters): nothing to silence
        return
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _peak_cpu_bytes(fn: Callable[[], None]) -> int:
    """Peak of live CPU tensor bytes while ``fn()`` runs, above what was live before: the
    profiler's allocation and free records, each at its own time. (An operator's self memory,
    taken at the operator's start, would count a tensor its child allocated and it freed as
    freed before it was made, and miss a peak inside a custom autograd function's loop.)"""
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with _native_stderr_silenced():
        prof.start()
    try:
        fn()
    finally:
        with _native_stderr_silenced():
            prof.stop()
    assert prof.profiler is not None and prof.profiler.kineto_results is not None
    records = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    cur = peak = 0
    for e in sorted(records, key=lambda e: e.start_ns()):
        # a memory record's signed size (torch's own profiler reads it so; its stub lacks it)
        cur += e.nbytes()  # type: ignore[attr-defined]
        peak = max(peak, cur)
    return int(peak)


def run_step(
    model: HybridLM,
    inputs: RolloutBatch | CompactInputs | TrajectoryInputs,
    config: ExecutionConfig | None = None,
    *,
    measure_memory: bool = False,
    warmup: int = 0,
    clip_eps: float = 0.2,
    kl_coef: float = 0.0,
    on_phase: Callable[[str], None] | None = None,
    **fields: Any,
) -> StepResult:
    """Forward + GRPO loss + MoE objective + backward; returns detached results and timing.

    ``config`` / ``fields``: the forward's ``ExecutionConfig`` and overrides of its fields
    (e.g. ``mode="trajectory"``), as ``HybridLM.forward`` takes them.
    ``warmup`` untimed steps run first. On CPU with ``measure_memory``, one more (profiled)
    step measures peak live tensor bytes; the gradients reported are the timed step's.
    ``on_phase(name)`` is called as each phase ends: "warmup" (after all warmup steps), "timed",
    and "memory" (the profiled CPU pass, when it runs).
    """
    run = ExecutionConfig.of(config, **fields)
    batch = inputs.batch if isinstance(inputs, (CompactInputs, TrajectoryInputs)) else inputs
    cfg = model.config
    kl = kl_coef if batch.ref_logprobs is not None else 0.0
    holder: dict[str, Any] = {}

    def step() -> None:
        out = model(inputs, run)
        loss = grpo_loss(out.logprobs, batch, clip_eps=clip_eps, kl_coef=kl).loss
        loss = loss + out.moe_objective(cfg.router_z_loss_coef, cfg.router_aux_loss_coef)
        loss.backward()
        holder["out"], holder["loss"] = out, loss

    dev = next(model.parameters()).device
    for _ in range(warmup):
        step()
        holder.clear()
    if warmup and on_phase is not None:
        on_phase("warmup")
    model.zero_grad(set_to_none=True)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    t0 = time.perf_counter()
    step()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    seconds = time.perf_counter() - t0
    if on_phase is not None:
        on_phase("timed")
    out, loss_value = holder["out"], float(holder["loss"].detach())
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    if dev.type == "cuda":
        peak = int(torch.cuda.max_memory_allocated(dev))
    elif measure_memory:
        holder.clear()
        model.zero_grad(set_to_none=True)
        peak = _peak_cpu_bytes(step)
        if on_phase is not None:
            on_phase("memory")
    else:
        peak = 0
    moe = out.moe_losses
    return StepResult(
        logprobs=out.logprobs.detach(),
        loss=loss_value,
        z_loss=None if moe is None else moe["z_loss"].detach(),
        aux_loss=None if moe is None else moe["aux_loss"].detach(),
        expert_counts=out.expert_counts,
        grads=grads,
        seconds=seconds,
        peak_bytes=peak,
        info=dict(out.info),
    )


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max|a - b| / max|b| (b is the reference)."""
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(_TINY)) if b.numel() else 0.0


def compare_runs(ref: StepResult, other: StepResult) -> dict[str, float]:
    """Max relative differences of ``other`` against ``ref`` (see the module docstring)."""
    if set(ref.grads) != set(other.grads):
        missing = sorted(set(ref.grads) ^ set(other.grads))
        raise ValueError(f"the two runs have gradients for different parameters: {missing[:5]}")
    out = {
        "logprobs": rel_diff(other.logprobs, ref.logprobs),
        "loss": abs(other.loss - ref.loss) / max(abs(ref.loss), _TINY),
    }
    if ref.z_loss is not None:
        assert other.z_loss is not None and other.aux_loss is not None and ref.aux_loss is not None
        assert other.expert_counts is not None and ref.expert_counts is not None
        out["router_z_loss"] = rel_diff(other.z_loss, ref.z_loss)
        out["router_aux_loss"] = rel_diff(other.aux_loss, ref.aux_loss)
        out["expert_counts"] = rel_diff(other.expert_counts, ref.expert_counts)
    scale = max((float(g.double().abs().max()) for g in ref.grads.values() if g.numel()), default=0.0)
    floor = max(1e-3 * scale, _TINY)
    out["gradients"] = max(
        (
            float((other.grads[n].double() - g.double()).abs().max() / max(float(g.double().abs().max()), floor))
            for n, g in ref.grads.items()
            if g.numel()
        ),
        default=0.0,
    )
    return out
