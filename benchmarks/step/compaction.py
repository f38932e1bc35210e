"""Compaction benchmark: one workload step compacted by the tree path and the sort path.

    python -m benchmarks.step.compaction --workload swe --step 0 [--json out.json]

Prints the batch shape, then for each path the wall time and the peak memory that
compaction itself allocates (tracemalloc sees numpy buffers), plus the process max RSS.
The sort path is the general one (token lists / files); the tree path is taken by
batches built from explicit rollout trees. Both must produce identical structures.
"""

from __future__ import annotations

import resource
import time
import tracemalloc

import numpy as np

from benchmarks._runner import add_json_argument, parse, parser, run, write_json


def _measure(fn, *args):
    """Wall time of a plain run, then peak allocation of a second run under tracemalloc
    (tracing slows numpy-heavy code several-fold, so it never overlaps the timing)."""
    t0 = time.perf_counter()
    out = fn(*args)
    seconds = time.perf_counter() - t0
    tracemalloc.start()
    fn(*args)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return out, seconds, peak


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__, __file__)
    p.add_argument("--workload", default="swe")
    p.add_argument("--step", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    add_json_argument(p)
    args = parse(p, argv)

    from harts.tree.compact import _compact_from_tree, _compact_sorted
    from harts.tree.workloads import generate

    batch = generate(args.workload, step=args.step, seed=args.seed)
    batch_mb = sum(a.nbytes for a in (batch.tokens, batch.action_mask, batch.advantages)) / 2**20
    results = {}
    structures = {}
    for label, fn in (("sort path", _compact_sorted), ("tree path", _compact_from_tree)):
        cb, seconds, peak = _measure(fn, batch)
        structures[label] = cb
        results[label] = {"seconds": round(seconds, 3), "peak_alloc_gb": round(peak / 2**30, 3)}
    a, b = structures.values()
    same = all(
        np.array_equal(getattr(a, k), getattr(b, k))
        for k in ("tokens", "semantic_to_compact", "multiplicity", "parent", "position")
    )
    rss_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(
        f"{args.workload}[{args.step}]: paths={batch.num_trajectories:,} raw={batch.num_tokens:,} "
        f"compact={a.num_compact_tokens:,} ({a.compression:.2f}x), batch arrays {batch_mb:,.0f} MiB"
    )
    for label, r in results.items():
        print(f"  {label:9s}  {r['seconds']:7.3f} s   peak allocated by compaction {r['peak_alloc_gb']:.3f} GiB")
    print(f"  identical structures: {same}; process max RSS {rss_gb:.2f} GiB")
    write_json(
        args,
        {
            "workload": args.workload,
            "step": args.step,
            "paths": batch.num_trajectories,
            "raw_tokens": batch.num_tokens,
            "compact_tokens": a.num_compact_tokens,
            "results": results,
            "identical": same,
            "max_rss_gb": round(rss_gb, 3),
        },
    )
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(run(main))
