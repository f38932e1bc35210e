"""FlexAttention block masks built on the host: block counts and host time per microbatch.

    python -m benchmarks.ops.block_mask --workload medium --step 0 --capacity 65536 --json out.json
    python -m benchmarks.ops.block_mask --workload swe --step 5 --dp 8 --replica 0 --repeat 1

For every microbatch of each side of ``--workload``'s step (``harts bench``'s plans, as in
``benchmarks.ops.attention``: the baseline's document-causal rows, harts' compact layouts),
it classifies the 128 x 128 blocks of the tree mask on the host
(``harts.ops.attention.host_block_mask``) twice: exactly, and with the conservative block-bounds
EMPTY test. Printed per side: microbatches, rows, partial and full blocks of each, how many
more blocks (partial + full) the bounds leave to the kernel, the kernel's block efficiency
(pairs in exact partial + full blocks over the visible (query, key) pairs: FlexAttention computes
every pair of a kept block), and the host time of
``host_block_mask`` (classification, block lists, BlockMask) per microbatch: the median over
microbatches of each one's median of ``--repeat`` runs, and the largest microbatch's. CPU only.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator

import numpy as np
import torch

from benchmarks._runner import add_json_argument, median_seconds, parse, parser, run, write_json

__all__ = ["main", "step_masks", "visible_pairs"]


def step_masks(
    workload: str, step: int, capacity: int, chunk_size: int, dp: int = 1, replica: int = 0
) -> Iterator[tuple[str, np.ndarray, np.ndarray]]:
    """(side, pre int64 [P], end int64 [P]) of every microbatch of data-parallel replica
    ``replica`` of ``dp``: "baseline" then "harts"."""
    from harts.plan.baselines.trajectory_plan import plan_trajectory_step
    from harts.plan.layout import build_layout
    from harts.plan.step import plan_step
    from harts.tree.workloads import workload_steps

    batch = workload_steps(workload, step + 1)[step][1]()
    lengths = np.asarray(batch.lengths)
    baseline = plan_trajectory_step(batch.lengths, dp=dp, capacity=capacity)
    for i in baseline.slots[replica]:
        lens = lengths[baseline.microbatches[i]]
        ends = np.cumsum(lens)
        yield "baseline", np.arange(int(ends[-1]), dtype=np.int64), np.repeat(ends, lens).astype(np.int64)
    for cb, call_plan in plan_step(batch, dp=dp, capacity=capacity).prepare_replica(replica, chunk_size):
        layout = build_layout(cb, call_plan)
        yield "harts", np.asarray(layout.tree_pre, dtype=np.int64), np.asarray(layout.tree_end, dtype=np.int64)


def visible_pairs(pre: np.ndarray, end: np.ndarray) -> int:
    """Useful (query, key) pairs of the tree mask: each valid row sees its ancestors and itself,
    the rows j with pre[j] <= pre[i] < end[j]. Padding rows (pre -1) count nothing (the mask lets
    each see itself, which only keeps its softmax finite)."""
    pre, end = np.asarray(pre, dtype=np.int64), np.asarray(end, dtype=np.int64)
    valid = pre >= 0
    p, e = pre[valid], end[valid]
    n = int(max(int(e.max()), int(p.max()) + 1)) if p.size else 0
    depth = np.zeros(n + 1, dtype=np.int64)  # +1 where a row's subtree starts, -1 where it ends
    np.add.at(depth, p, 1)
    np.add.at(depth, e, -1)
    return int(np.cumsum(depth)[:n][p].sum())


def _host_seconds(pre: np.ndarray, end: np.ndarray, repeat: int) -> float:
    from harts.ops.attention.host_block_mask import host_block_mask
    from harts.ops.attention.tree_mask import tree_mask_mod

    mask_mod = tree_mask_mod(torch.from_numpy(pre), torch.from_numpy(end))
    cpu = torch.device("cpu")
    return median_seconds(lambda: host_block_mask(pre, end, mask_mod, cpu), cpu, repeat, warmup=False)


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__, __file__)
    p.add_argument("--workload", default="medium")
    p.add_argument("--step", type=int, default=0)
    p.add_argument("--capacity", type=int, default=65536)
    p.add_argument("--chunk-size", type=int, default=64, help="linear-attention chunk of the compact layouts")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--dp", type=int, default=1, help="data-parallel replicas the step is planned for")
    p.add_argument("--replica", type=int, default=0, help="the replica whose microbatches are counted")
    add_json_argument(p)
    args = parse(p, argv)
    from harts.ops.attention.host_block_mask import tree_block_classes

    sides: dict[str, dict] = {}
    if not 0 <= args.replica < args.dp:
        p.error(f"--replica must lie in [0, --dp={args.dp}); got {args.replica}")
    for side, pre, end in step_masks(args.workload, args.step, args.capacity, args.chunk_size, args.dp, args.replica):
        s = sides.setdefault(side, {"rows": [], "exact": [0, 0], "bounds": [0, 0], "ms": [], "visible": 0})
        s["visible"] += visible_pairs(pre, end)
        for key, exact in (("exact", True), ("bounds", False)):
            partial, full = tree_block_classes(pre, end, exact=exact)
            s[key][0] += int(partial.sum())
            s[key][1] += int(full.sum())
        s["rows"].append(len(pre))
        s["ms"].append(1e3 * _host_seconds(pre, end, args.repeat))
    print(
        f"{args.workload}[{args.step}] T={args.capacity}, replica {args.replica} of {args.dp}: 128 x 128 blocks, "
        "summed over microbatches"
    )
    print(
        f"{'side':9} {'mbs':>4} {'max rows':>8} {'exact partial':>13} {'exact full':>10} {'bounds partial':>14} "
        f"{'bounds full':>11} {'+blocks':>8} {'visible pairs':>15} {'efficiency':>10} {'host ms med':>11} "
        f"{'host ms max-row mb':>18}"
    )
    report = {
        "workload": args.workload,
        "step": args.step,
        "capacity": args.capacity,
        "dp": args.dp,
        "replica": args.replica,
        "sides": {},
    }
    for side, s in sides.items():
        ex, bd = sum(s["exact"]), sum(s["bounds"])
        big = int(np.argmax(s["rows"]))
        row = {
            "microbatches": len(s["rows"]),
            "max_rows": max(s["rows"]),
            "exact_partial": s["exact"][0],
            "exact_full": s["exact"][1],
            "bounds_partial": s["bounds"][0],
            "bounds_full": s["bounds"][1],
            "bounds_extra_pct": 100.0 * (bd - ex) / ex,
            "visible_pairs": s["visible"],
            "block_efficiency": s["visible"] / (ex * 128 * 128),
            "host_ms_median": statistics.median(s["ms"]),
            "host_ms_largest": s["ms"][big],
        }
        report["sides"][side] = row
        print(
            f"{side:9} {row['microbatches']:>4} {row['max_rows']:>8} {row['exact_partial']:>13} {row['exact_full']:>10} "
            f"{row['bounds_partial']:>14} {row['bounds_full']:>11} {row['bounds_extra_pct']:>7.2f}% "
            f"{row['visible_pairs']:>15,} {row['block_efficiency']:>10.3f} "
            f"{row['host_ms_median']:>11.1f} {row['host_ms_largest']:>18.1f}"
        )
    write_json(args, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(run(main))
