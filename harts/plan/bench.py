"""Step-planning benchmark: harts vs the OR-Tools baseline, per step (paper Tables 2 and 3).

For each batch: paths, raw tokens, and for each planner its compact tokens, planning
seconds (the planner's inputs excluded: harts' prefix index, whose build time is recorded
as ``index_seconds``, and the baseline's full compaction), scheduled slots, within-slot imbalance
of every slot and the step-total imbalance (Eq. 23). The summary holds the Table 3 figures:
within-slot P50/P95 over all slots of all steps, step-total P50/max over steps, and the
Table 2 ratios baseline/harts (compact tokens, planning time).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

__all__ = ["plan_batches", "summarize", "plot"]


def plan_batches(
    sources: Iterable[tuple[int, Callable[[], Any]]],
    *,
    dp: int,
    capacity: int,
    baseline: str | None,
    baseline_params: dict[str, Any] | None = None,
    progress: Any = None,
    workers: Any = None,
) -> list[dict[str, Any]]:
    """One record per batch, in the JSON layout documented by ``harts plan``. ``workers``
    (``PlannerWorkers``): harts plans with them, then once more in this process alone
    (``plan_seconds_serial``, and ``same_plan_serial``: whether the plans agree)."""
    from harts.plan.step.planner import plan_step
    from harts.plan.step.step_plan import same_step_plan
    from harts.tree.compact import compact, prefix_index

    steps = []
    for step, make in sources:
        batch = make()
        t0 = time.perf_counter()
        index = prefix_index(batch)
        index_seconds = time.perf_counter() - t0
        rec: dict[str, Any] = {"step": step, "paths": batch.num_trajectories, "raw_tokens": batch.num_tokens}
        plan = plan_step(index, dp=dp, capacity=capacity, workers=workers)
        rec["harts"] = plan.summary() | {"index_seconds": index_seconds}
        if plan.info.get("workers"):
            serial = plan_step(index, dp=dp, capacity=capacity)
            rec["harts"] |= {
                "plan_seconds_serial": serial.plan_seconds,
                "same_plan_serial": same_step_plan(plan, serial),
            }
        if baseline:
            from harts.plan.baselines.ortools_partition import ortools_step

            assert baseline == "ortools", baseline
            cb = compact(batch)  # the baseline reads the trie's first-token labels
            rec[baseline] = ortools_step(cb, dp=dp, capacity=capacity, **(baseline_params or {})).summary()
        steps.append(rec)
        if progress is not None:
            progress.update(1)
    return steps


def _scope(steps: list[dict[str, Any]], key: str) -> dict[str, Any]:
    within = np.concatenate([s[key]["within_slot_imbalance"] for s in steps])
    totals = np.array([s[key]["step_total_imbalance"] for s in steps])
    return {
        "compact_tokens": int(sum(s[key]["compact_tokens"] for s in steps)),
        "plan_seconds": float(sum(s[key]["plan_seconds"] for s in steps)),
        "max_plan_seconds": float(max(s[key]["plan_seconds"] for s in steps)),
        **({"index_seconds": float(sum(s[key]["index_seconds"] for s in steps))} if key == "harts" else {}),
        **(
            {"plan_seconds_serial": float(sum(s[key]["plan_seconds_serial"] for s in steps))}
            if all("plan_seconds_serial" in s[key] for s in steps)
            else {}
        ),
        "slots": int(sum(s[key]["slots"] for s in steps)),
        "within_slot_p50": float(np.percentile(within, 50)),
        "within_slot_p95": float(np.percentile(within, 95)),
        "step_total_p50": float(np.percentile(totals, 50)),
        "step_total_max": float(totals.max()),
    }


def summarize(steps: list[dict[str, Any]], baseline: str | None) -> dict[str, Any]:
    out: dict[str, Any] = {"harts": _scope(steps, "harts")}
    if baseline:
        out[baseline] = _scope(steps, baseline)
        compact_ratio = [s[baseline]["compact_tokens"] / s["harts"]["compact_tokens"] for s in steps]
        time_ratio = [s[baseline]["plan_seconds"] / s["harts"]["plan_seconds"] for s in steps]
        out["compact_ratio_min"] = float(min(compact_ratio))
        out["compact_ratio_max"] = float(max(compact_ratio))
        out["time_ratio_min"] = float(min(time_ratio))
        out["time_ratio_max"] = float(max(time_ratio))
        out["harts_lower_every_step"] = bool(min(compact_ratio) > 1.0)
    return out


def plot(steps: list[dict[str, Any]], baseline: str | None, path: str) -> None:
    """Compact tokens per step (bars) and within-slot imbalance distribution (box), written to
    ``path`` (PNG, PDF or SVG; atomically, ``harts.outputs.save_figure``)."""
    import matplotlib

    from harts.outputs import save_figure

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    x = np.arange(len(steps))
    keys = ["harts"] + ([baseline] if baseline else [])
    width = 0.8 / len(keys)
    for i, key in enumerate(keys):
        ax1.bar(x + i * width, [s[key]["compact_tokens"] for s in steps], width, label=key)
    ax1.set_xticks(x + width * (len(keys) - 1) / 2, [str(s["step"]) for s in steps])
    ax1.set_xlabel("step")
    ax1.set_ylabel("compact tokens")
    ax1.legend()
    data = [100 * np.concatenate([s[key]["within_slot_imbalance"] for s in steps]) for key in keys]
    ax2.boxplot(data, tick_labels=keys)
    ax2.set_ylabel("within-slot imbalance (%)")
    fig.tight_layout()
    try:
        save_figure(fig, path, option="--plot", dpi=120)
    finally:
        plt.close(fig)
