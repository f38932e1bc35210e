"""Probes a benchmark reads around the step it times: device marks (CUDA events, host time on
CPU), the CUDA allocator's synchronizing events, torch.compile's graphs and Triton's kernel
specializations (work the warm-up should have done), one microbatch under the torch profiler,
and an AdamW step. None of them synchronizes the device except ``sync`` and the profiler's run.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import torch

import harts.models.regions as regions
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

__all__ = [
    "TRITON_VARIANTS",
    "allocator_syncs",
    "between",
    "compiled_graphs",
    "mark",
    "optimizer_seconds",
    "profile_microbatch",
    "sync",
    "triton_variants",
]


def sync(device: torch.device) -> None:
    """Wait for ``device`` (CUDA) to finish its queued work; nothing elsewhere."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def allocator_syncs(device: torch.device) -> int:
    """The CUDA caching allocator's device-synchronizing events so far on ``device``: allocation
    retries (a failed cudaMalloc frees the cache and synchronizes) and blocks released to the
    driver (each ``cudaFree`` synchronizes); 0 off CUDA."""
    if device.type != "cuda":
        return 0
    stats = torch.cuda.memory_stats(device)
    return int(stats.get("num_alloc_retries", 0)) + int(stats.get("num_device_free", 0))


def mark(device: torch.device) -> object:
    """A point in the device's stream order (a CUDA event) or, on CPU, in host time."""
    if device.type == "cuda":
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev
    return time.perf_counter()


def between(a: Any, b: Any) -> float:
    """Seconds between two ``mark``s (after the device has synchronized)."""
    return a.elapsed_time(b) / 1e3 if isinstance(a, torch.cuda.Event) else b - a


#: names of the Triton kernels specialized in this process since ``triton_variants`` first ran,
#: one entry per specialization (``jit_post_compile_hook``)
TRITON_VARIANTS: list[str] = []
TRITON_HOOKED = [False]


def triton_variants() -> int:
    """How many Triton kernel specializations this process has first used (compiled, or loaded
    from Triton's disk cache) since the first call, which installs the counting hook (Triton's
    ``knobs.runtime.jit_post_compile_hook``, chained to any hook already there; it runs once per
    new specialization, never per launch). 0 without Triton's knobs (Triton < 3.4)."""
    if not TRITON_HOOKED[0]:
        try:
            from triton import knobs
        except ImportError:
            return 0
        previous = knobs.runtime.jit_post_compile_hook

        def count(*args: Any, **kwargs: Any) -> Any:
            TRITON_VARIANTS.append(str(getattr(kwargs.get("fn"), "name", "?")))
            return previous(*args, **kwargs) if previous is not None else None

        knobs.runtime.jit_post_compile_hook = count
        TRITON_HOOKED[0] = True
    return len(TRITON_VARIANTS)


def compiled_graphs() -> int:
    """Graphs Dynamo has compiled in this process so far (its ``unique_graphs`` counter)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def profile_microbatch(run: Callable[[], object], device: torch.device, path: str) -> None:
    """``run()`` (one microbatch's training step) under the torch profiler: a Chrome trace at
    ``path`` and, beside it (``.txt``), a summary line (the microbatch's wall time, how much of it
    the device was busy, kernels launched), the device time of each region and phase (kernels
    attributed to the region that launched them, ``device_time_by_region``) with the top kernels
    launched outside every region ("other"), where the device waited for the host
    (``device_idle_gaps``), the device time outside every region by the host operator (with its
    input shapes: the profiler records shapes, a little more host time per operator) that
    launched it, then the 40 operators with the most self time on the device and the 40 with the
    most host time (CPU runs: host only)."""
    import json

    from torch.profiler import ProfilerActivity, profile

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts, record_shapes=True) as prof:
        with regions.RegionTimer(device, annotate=True):
            t0 = time.perf_counter()
            run()
            sync(device)
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


def optimizer_seconds(model: HybridLM) -> float:
    """One AdamW step (lr 0: weights unchanged) over gradients of the parameters' size, after an
    untimed first step that creates the optimizer state; the same for both sides."""
    device = model.embed_tokens.weight.device
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    opt = torch.optim.AdamW(params, lr=0.0, weight_decay=0.0, fused=device.type == "cuda" or None)
    opt.step()
    sync(device)
    t0 = time.perf_counter()
    opt.step()
    sync(device)
    seconds = time.perf_counter() - t0
    del opt
    model.zero_grad(set_to_none=True)
    return seconds
