"""Reading a torch profiler Chrome trace by harts region: device time, kernels and host
operators per ``harts/<region>/<phase>`` range, and where the device waited for the host.

The trace is recorded under ``harts.models.regions.RegionTimer(annotate=True)``, which opens a
``user_annotation`` range named ``ANNOTATION_PREFIX + "<region>/<phase>"`` around each region. A
kernel, copy or memset is matched to the host call that launched it (``args.correlation``) and
charged to the innermost such range open on that thread at the launch. ``harts bench --profile``
writes these tables beside each trace (``harts.experiments.step_bench.profile_step``).

Trace events are the dicts of the export's ``traceEvents`` (``ts`` / ``dur`` in microseconds);
every seconds figure returned is device (or host) seconds.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

import harts.models.regions as regions

__all__ = [
    "OUTSIDE_REGIONS",
    "device_busy_seconds",
    "device_idle_gaps",
    "device_time_by_region",
    "idle_table",
    "kernels_by_region",
    "operators_by_region",
    "region_table",
]


def region_table(
    by_region: dict[str, float],
    outside: list[tuple[str, float, int]],
    wall: float,
    busy: float,
    per_region: dict[str, list[tuple[str, float, int]]] | None = None,
) -> str:
    """``device_time_by_region``'s result as text: regions by device time, the idle time, then the
    25 kernels with the most time outside every region; with ``per_region``
    (``kernels_by_region``) also the 8 largest kernels of every region holding at least 2% of
    the device time. Empty without device work."""
    if not by_region:
        return ""
    lines = ["", "device time by region (each kernel in the region open on the thread that launched it):"]
    lines += [f"  {label:<36} {sec * 1e3:10.2f} ms" for label, sec in sorted(by_region.items(), key=lambda kv: -kv[1])]
    lines.append(f"  {'idle (wall - busy)':<36} {(wall - busy) * 1e3:10.2f} ms")
    lines += ["", "top kernels launched outside every region (ms, launches):"]
    lines += [f"  {sec * 1e3:9.2f} {n:6d}  {name[:110]}" for name, sec, n in outside[:25]]
    total = sum(by_region.values())
    for label, sec in sorted(by_region.items(), key=lambda kv: -kv[1]):
        if per_region is None or label == OUTSIDE_REGIONS or sec < 0.02 * total:
            continue
        lines += ["", f"top kernels of {label} ({sec * 1e3:.2f} ms; ms, launches):"]
        lines += [f"  {t * 1e3:9.2f} {n:6d}  {name[:110]}" for name, t, n in per_region.get(label, [])[:8]]
    return "\n".join(lines) + "\n"


#: trace categories of device work, and of the host calls that launch it
_DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
_LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
OUTSIDE_REGIONS = "other (outside every region)"


def device_time_by_region(trace_events: list[dict]) -> tuple[dict[str, float], list[tuple[str, float, int]]]:
    """Device seconds per region and phase, from a torch profiler Chrome trace recorded under
    ``RegionTimer(annotate=True)``.

    Each kernel, copy or memset is matched to the host call that launched it (``args.correlation``)
    and attributed to the innermost ``harts/<region>/<phase>`` range open on that thread at the
    launch (``OUTSIDE_REGIONS`` when none is). Unlike the timer's event brackets this adds
    kernel durations only: device idle time counts nowhere.

    Returns:
        ({"<region>/<phase>" or OUTSIDE_REGIONS: seconds}, [(kernel name, seconds, count)] of the
        work attributed to OUTSIDE_REGIONS, largest first). Both empty without device events.
    """
    work = _attributed_work(trace_events)
    by_region: dict[str, float] = {}
    for label, _, sec in work:
        by_region[label] = by_region.get(label, 0.0) + sec
    return by_region, _kernels_by_label(work).get(OUTSIDE_REGIONS, [])


def kernels_by_region(trace_events: list[dict]) -> dict[str, list[tuple[str, float, int]]]:
    """``{label: [(kernel name, seconds, count)], largest first}`` for every label of
    ``device_time_by_region`` (the same attribution): which kernels make up each region's time."""
    return _kernels_by_label(_attributed_work(trace_events))


def _kernels_by_label(work: list[tuple[str, str, float]]) -> dict[str, list[tuple[str, float, int]]]:
    tally: dict[str, dict[str, list]] = {}
    for label, name, sec in work:
        acc = tally.setdefault(label, {}).setdefault(name, [0.0, 0])
        acc[0] += sec
        acc[1] += 1
    return {
        label: sorted(((n, t, c) for n, (t, c) in names.items()), key=lambda x: -x[1]) for label, names in tally.items()
    }


class _Ranges:
    """Host ranges of a trace, per thread: ``innermost(tid, ts)`` is the name of the latest-starting
    range on thread ``tid`` that contains ``ts`` (None when none does)."""

    def __init__(self) -> None:
        self._spans: dict[Any, list[tuple[float, float, str]]] = {}
        self._starts: dict[Any, np.ndarray] = {}

    def add(self, tid: Any, ts: float, dur: float, name: str) -> None:
        self._spans.setdefault(tid, []).append((ts, ts + dur, name))

    def freeze(self) -> _Ranges:
        for tid, v in self._spans.items():
            v.sort()
            self._starts[tid] = np.array([a for a, _, _ in v])
        return self

    def innermost(self, tid: Any, ts: float) -> str | None:
        if tid not in self._spans:
            return None
        spans = self._spans[tid]
        j = int(np.searchsorted(self._starts[tid], ts, side="right")) - 1
        while j >= 0 and spans[j][1] < ts:
            j -= 1
        return spans[j][2] if j >= 0 else None


def _trace_index(trace_events: list[dict]) -> tuple[_Ranges, _Ranges, dict[Any, tuple[Any, float]]]:
    """(harts region ranges, host operator ranges, {correlation: (launching thread, launch ts)})."""
    prefix = regions.ANNOTATION_PREFIX
    region_ranges, op_ranges = _Ranges(), _Ranges()
    launches: dict[Any, tuple[Any, float]] = {}
    for e in trace_events:
        cat, args = e.get("cat"), e.get("args") or {}
        if cat == "user_annotation" and str(e.get("name", "")).startswith(prefix):
            region_ranges.add(e.get("tid"), float(e["ts"]), float(e.get("dur", 0.0)), e["name"][len(prefix) :])
        elif cat == "cpu_op":
            dims = args.get("Input Dims")  # with the profiler's record_shapes
            name = str(e.get("name", "?")) + (f" {_short_dims(dims)}" if dims else "")
            op_ranges.add(e.get("tid"), float(e["ts"]), float(e.get("dur", 0.0)), name)
        elif cat in _LAUNCH_CATS and "correlation" in args:
            launches[args["correlation"]] = (e.get("tid"), float(e["ts"]))
    return region_ranges.freeze(), op_ranges.freeze(), launches


def _short_dims(dims: Any) -> str:
    """A host operator's input shapes, compactly: ``[65486,1536] [3072,1536]`` (scalars and
    absent inputs left out)."""
    if not isinstance(dims, list):
        return ""
    return " ".join("[" + ",".join(str(d) for d in x) + "]" for x in dims if isinstance(x, list) and x)


def operators_by_region(trace_events: list[dict]) -> dict[str, list[tuple[str, float, int]]]:
    """``{label: [(host operator with its input shapes, device seconds, launches)], largest
    first}``: the device work of each region (``device_time_by_region``'s labels) by the
    innermost host operator that launched it, so a kernel family is traced to the call (and
    the shapes) behind it. Shapes appear when the trace was recorded with ``record_shapes``."""
    return _kernels_by_label(_attributed_work(trace_events, by_operator=True))


def _attributed_work(trace_events: list[dict], by_operator: bool = False) -> list[tuple[str, str, float]]:
    """[(label, kernel name, seconds)] of every kernel, copy and memset in the trace
    (``device_time_by_region`` says how a label is chosen); ``by_operator``: the innermost host
    operator that launched it ("?" outside every operator) in place of the kernel's name."""
    region_ranges, op_ranges, launches = _trace_index(trace_events)
    out = []
    for e in trace_events:
        if e.get("cat") not in _DEVICE_CATS:
            continue
        tid, ts = launches.get((e.get("args") or {}).get("correlation"), (None, 0.0))
        label = region_ranges.innermost(tid, ts) or OUTSIDE_REGIONS
        name = (op_ranges.innermost(tid, ts) or "?") if by_operator else str(e.get("name", "?"))
        out.append((label, name, float(e.get("dur", 0.0)) * 1e-6))
    return out


#: host runtime calls that wait for the device
_SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def device_idle_gaps(trace_events: list[dict], min_gap: float = 1e-4) -> dict[str, Any]:
    """Where the device waited for the host, from a torch profiler Chrome trace recorded under
    ``RegionTimer(annotate=True)``.

    A gap is a stretch of at least ``min_gap`` seconds with no kernel, copy or memset running
    between the first and the last device work. Each gap is charged to the work that ended it:
    the harts region open when that work was launched, and the host operator (innermost
    ``cpu_op``) that launched it. Host calls that wait for the device (``_SYNC_CALLS``; a
    synchronous ``cudaMemcpy`` too) are counted by the host operator that made them.

    Returns:
        {"gaps": count, "gap_seconds": total, "by_region": {label: seconds}, "largest":
        [(seconds, label, host operator, kernel)] (10, largest first), "syncs": count,
        "sync_seconds": host seconds in them, "sync_by_op": {operator: [count, seconds]}}.
    """
    region_ranges, op_ranges, launches = _trace_index(trace_events)
    work = sorted(
        (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), e)
        for e in trace_events
        if e.get("cat") in _DEVICE_CATS and "ts" in e
    )
    gaps: list[tuple[float, str, str, str]] = []
    end = math.inf
    for lo, hi, e in work:
        if lo - end >= min_gap * 1e6:
            tid, ts = launches.get((e.get("args") or {}).get("correlation"), (None, 0.0))
            label = region_ranges.innermost(tid, ts) or OUTSIDE_REGIONS
            op = op_ranges.innermost(tid, ts) or "?"
            gaps.append(((lo - end) * 1e-6, label, op, str(e.get("name", "?"))))
        end = hi if end == math.inf else max(end, hi)
    by_region: dict[str, float] = {}
    for sec, label, _, _ in gaps:
        by_region[label] = by_region.get(label, 0.0) + sec
    sync_by_op: dict[str, list] = {}
    for e in trace_events:
        name = str(e.get("name", ""))
        if e.get("cat") in _LAUNCH_CATS and name in _SYNC_CALLS:
            op = op_ranges.innermost(e.get("tid"), float(e["ts"])) or "?"
            acc = sync_by_op.setdefault(op, [0, 0.0])
            acc[0] += 1
            acc[1] += float(e.get("dur", 0.0)) * 1e-6
    return {
        "gaps": len(gaps),
        "gap_seconds": sum(g[0] for g in gaps),
        "by_region": dict(sorted(by_region.items(), key=lambda kv: -kv[1])),
        "largest": sorted(gaps, key=lambda g: -g[0])[:10],
        "syncs": sum(v[0] for v in sync_by_op.values()),
        "sync_seconds": sum(v[1] for v in sync_by_op.values()),
        "sync_by_op": dict(sorted(sync_by_op.items(), key=lambda kv: -kv[1][1])),
    }


def idle_table(idle: dict[str, Any], min_gap: float = 1e-4) -> str:
    """``device_idle_gaps``' result as text (empty without device work)."""
    if not idle["gaps"] and not idle["syncs"]:
        return ""
    lines = [
        "",
        f"device idle gaps of at least {min_gap * 1e3:g} ms: {idle['gaps']}, {idle['gap_seconds'] * 1e3:.2f} ms in all; "
        "by the region of the work launched after the gap:",
    ]
    lines += [f"  {label:<36} {sec * 1e3:10.2f} ms" for label, sec in idle["by_region"].items()]
    if idle["largest"]:
        lines.append("largest gaps (ms, region, host operator that launched the next work, that work):")
        lines += [f"  {sec * 1e3:9.2f}  {label}  {op[:50]}  {name[:60]}" for sec, label, op, name in idle["largest"]]
    lines.append(
        f"host calls that waited for the device: {idle['syncs']}, {idle['sync_seconds'] * 1e3:.2f} ms; by host operator:"
    )
    lines += [f"  {n:6d} {sec * 1e3:9.2f} ms  {op[:80]}" for op, (n, sec) in list(idle["sync_by_op"].items())[:12]]
    return "\n".join(lines) + "\n"


def device_busy_seconds(trace_events: list[dict]) -> tuple[float, int]:
    """(seconds during which at least one kernel, copy or memset ran; how many ran) from a
    Chrome trace's ``traceEvents`` (torch profiler export: ``ts`` / ``dur`` in microseconds,
    device work under the categories "kernel", "gpu_memcpy", "gpu_memset")."""
    spans = sorted(
        (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)))
        for e in trace_events
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "ts" in e
    )
    busy, end = 0.0, -math.inf
    for lo, hi in spans:
        if hi > end:
            busy += hi - max(lo, end)
            end = hi
    return busy * 1e-6, len(spans)
