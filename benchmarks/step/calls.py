"""Call-planner benchmark (paper §3.3): Algorithm 1 on 1 M-segment forests and on a workload step.

    python -m benchmarks.step.calls [--segments 1000000] [--json out.json]
    python -m benchmarks.step.calls --sweep [--sweep-sizes 64,256,...] [--json out.json]

Part 1 plans forests of ``--segments`` segments of three shapes with ``plan_calls`` (best of
``--repeat`` runs). Algorithm 1 transcribed line by line is the tests' oracle
(``tests/plan/oracle.py``), not timed here:
  * ``swe-tiled``: copies of one ``swe`` step's segment forest (real fork shapes);
  * ``random``: random recursive trees, heavy-tailed lengths, forks at kB-1, kB, kB+1;
  * ``deep``: Figure-8-like caterpillars (a long chain, one side leaf per fork).
``--deep-chain`` adds one single caterpillar of ``--segments`` segments (depth V/2): one unit
for the planner's spine closed forms, the worst case for any level-by-level processing.

Part 2 splits one ``swe`` step into microbatches with the step planner (``plan_step``,
``--dp``, ``--capacity``), compacts each microbatch (setup, not timed), then times planning
every microbatch and building every microbatch's physical layout (``build_layout``), and
compares both with the time to compact the whole step (each timing the best of ``--repeat``).

``--sweep`` instead times random forests and caterpillars of ``--sweep-sizes`` segments through
each path of ``plan_calls`` (the lean list walk, the units engine, and ``auto``, which picks one
by ``takes_lean_path``), alternating the three in every round and keeping each one's best: the
data behind ``LEAN_BASE`` / ``LEAN_PER_GENERAL_FORK`` / ``LEAN_MAX_SEGMENTS``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import TypeVar

import numpy as np

from benchmarks._runner import add_json_argument, parse, parser, run, write_json
from harts.plan.calls import general_forks, plan_calls, plan_calls_many, takes_lean_path
from harts.plan.step import plan_step
from harts.tree.compact import compact
from harts.tree.segments import SegmentForest, parent_depth, preorder_from_parents

T = TypeVar("T")


def _best_of(fn: Callable[[], T], repeat: int) -> tuple[T, float]:
    """``fn()``'s last result and its best time over ``repeat`` runs (at least one)."""
    t0 = time.perf_counter()
    out = fn()
    best = time.perf_counter() - t0
    for _ in range(repeat - 1):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return out, best


def _from_arrays(start: np.ndarray, end: np.ndarray, parent: np.ndarray) -> SegmentForest:
    """A SegmentForest from preorder arrays (parent[v] < v), built with numpy only."""
    from harts.tree.segments import _assemble

    length = end - start
    row = np.cumsum(length) - length
    return _assemble(start, end, parent, row)


def tile_forest(forest: SegmentForest, copies: int) -> SegmentForest:
    """``copies`` independent copies of a forest, each keeping its preorder numbering."""
    v = forest.num_segments
    off = np.repeat(np.arange(copies, dtype=np.int64) * v, v)
    parent = np.tile(forest.parent, copies)
    parent = np.where(parent >= 0, parent + off, -1)
    return _from_arrays(np.tile(forest.start, copies), np.tile(forest.end, copies), parent)


def _lengths_near_grid(rng: np.random.Generator, start: np.ndarray, b: int) -> np.ndarray:
    """Heavy-tailed segment lengths; a third of the forks snapped to kB-1, kB or kB+1."""
    raw = np.maximum(1, rng.lognormal(np.log(40.0), 1.6, start.size).astype(np.int64))
    raw = np.minimum(raw, 40_000)
    end = start + raw
    snap = rng.random(start.size) < 0.33
    target = (end // b) * b + rng.integers(-1, 2, start.size)
    end = np.where(snap & (target > start), target, end)
    return end - start


def random_forest(rng: np.random.Generator, v: int, b: int, tree_size: int = 2000) -> SegmentForest:
    """Random recursive trees (a node's parent is uniform among earlier nodes of its tree)."""
    tree = np.arange(v) // tree_size
    base = tree * tree_size
    idx = np.arange(v)
    par = np.where(idx > base, base + (rng.random(v) * (idx - base)).astype(np.int64), -1)
    order = preorder_from_parents(par)
    new = np.empty(v, dtype=np.int64)
    new[order] = np.arange(v)
    parent = np.where(par[order] >= 0, new[np.maximum(par[order], 0)], -1)
    start = np.zeros(v, dtype=np.int64)
    end = np.zeros(v, dtype=np.int64)
    depth = parent_depth(parent)
    for d in range(int(depth.max()) + 1):
        nodes = np.flatnonzero(depth == d)
        start[nodes] = np.where(parent[nodes] >= 0, end[np.maximum(parent[nodes], 0)], 0)
        end[nodes] = start[nodes] + _lengths_near_grid(rng, start[nodes], b)
    return _from_arrays(start, end, parent)


def caterpillars(rng: np.random.Generator, v: int, b: int, spine: int) -> SegmentForest:
    """Trees of ``spine`` forks: chain node i has children (chain node i+1, side leaf)."""
    per = 2 * spine + 1
    trees = max(1, v // per)
    # preorder within a tree: c0, c1, ..., c_spine (chain), then side leaves bottom-up
    # (a side leaf is the last child of its fork, so it follows the fork's whole subtree)
    parent_t = np.empty(per, dtype=np.int64)
    parent_t[0] = -1
    parent_t[1 : spine + 1] = np.arange(spine)
    parent_t[spine + 1 :] = np.arange(spine - 1, -1, -1)
    lens = _lengths_near_grid(rng, rng.integers(0, 10_000, trees * per), b).reshape(trees, per)
    start = np.zeros((trees, per), dtype=np.int64)
    end = np.zeros((trees, per), dtype=np.int64)
    end[:, 0] = lens[:, 0]
    for i in range(1, spine + 1):  # chain positions (vectorized over trees)
        start[:, i] = end[:, i - 1]
        end[:, i] = start[:, i] + lens[:, i]
    start[:, spine + 1 :] = end[:, parent_t[spine + 1 :]]
    end[:, spine + 1 :] = start[:, spine + 1 :] + lens[:, spine + 1 :]
    off = (np.arange(trees) * per)[:, None]
    parent = np.where(parent_t[None, :] >= 0, parent_t[None, :] + off, -1)
    return _from_arrays(start.ravel(), end.ravel(), parent.ravel())


def bench_forests(args: argparse.Namespace, swe_forest: SegmentForest | None) -> list[dict]:
    rng = np.random.default_rng(args.seed)
    b = args.chunk_size
    shapes: list[tuple[str, SegmentForest]] = []
    if swe_forest is not None:
        shapes.append(("swe-tiled", tile_forest(swe_forest, -(-args.segments // swe_forest.num_segments))))
    shapes.append(("random", random_forest(rng, args.segments, b)))
    shapes.append(("deep", caterpillars(rng, args.segments, b, spine=2_000)))
    if args.deep_chain:
        shapes.append(("deep-chain", caterpillars(rng, args.segments, b, spine=args.segments // 2)))
    rows = []
    for name, forest in shapes:
        depth = int(forest.depth().max())
        p, sec = _best_of(lambda: plan_calls(forest, b), args.repeat)
        row = {"shape": name, "segments": forest.num_segments, "trees": forest.num_trees, "plan_s": round(sec, 4)}
        row.update(calls=p.num_calls, sequences=p.num_sequences, replay=p.total_replay, depth=depth)
        rows.append(row)
        print(
            f"{name:>11}  V={row['segments']:>9,}  trees={row['trees']:>6,}  depth={depth:>7,}  "
            f"calls={p.num_calls}  plan_calls {sec:.3f} s"
        )
    return rows


def _sizes(text: str) -> list[int]:
    """``--sweep-sizes``: comma-separated segment counts, each at least 2."""
    try:
        sizes = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not sizes or min(sizes) < 2:
        raise argparse.ArgumentTypeError(f"sizes must be at least 2, got {text!r}")
    return sizes


def bench_sweep(args: argparse.Namespace) -> list[dict]:
    """Each path of ``plan_calls`` on random forests and caterpillars of every sweep size."""
    rng = np.random.default_rng(args.seed)
    b = args.chunk_size
    sizes = args.sweep_sizes
    rows = []
    print(f"{'shape':>7} {'V':>8} {'V/G':>6}  {'lean ms':>9} {'units ms':>9}  auto")
    for shape in ("random", "deep"):
        for v in sizes:
            if shape == "random":
                forest = random_forest(rng, v, b)
            else:
                forest = caterpillars(rng, v, b, spine=max(1, min(2_000, v // 2 - 1)))
            best = {"lean": np.inf, "units": np.inf, "auto": np.inf}
            # every round runs the three paths once each, so load on the machine hits all alike
            for _ in range(max(args.repeat, 20_000 // forest.num_segments)):
                for path in best:
                    t0 = time.perf_counter()
                    plan_calls(forest, b, path=path)
                    best[path] = min(best[path], time.perf_counter() - t0)
            g = general_forks(forest)
            auto = "lean" if takes_lean_path(forest) else "units"
            row: dict[str, object] = {
                "shape": shape,
                "segments": forest.num_segments,
                "general_forks": g,
                "auto_path": auto,
            }
            row.update({f"{k}_ms": round(x * 1e3, 4) for k, x in best.items()})
            rows.append(row)
            ratio = f"{forest.num_segments / g:6.1f}" if g else f"{'-':>6}"
            print(
                f"{shape:>7} {forest.num_segments:>8,} {ratio}  {best['lean'] * 1e3:9.3f} "
                f"{best['units'] * 1e3:9.3f}  {auto} {best['auto'] * 1e3:.3f} ms"
            )
    return rows


def bench_swe(args: argparse.Namespace) -> tuple[dict, SegmentForest]:
    import harts

    t0 = time.perf_counter()
    batch = harts.workloads.generate(args.workload, step=args.step, seed=args.seed)
    gen_s = time.perf_counter() - t0
    cb, compact_s = _best_of(lambda: compact(batch), args.repeat)
    whole, whole_s = _best_of(lambda: plan_calls(cb.segment_trees, args.chunk_size), args.repeat)
    sp = plan_step(cb, dp=args.dp, capacity=args.capacity)
    mbs = [sp.compact_microbatch(k) for k in range(sp.num_microbatches)]  # setup, not timed

    def plan_one_by_one():
        return [plan_calls(c.segment_trees, args.chunk_size) for c in mbs]

    _, one_by_one_s = _best_of(plan_one_by_one, args.repeat)
    plans, mb_s = _best_of(lambda: plan_calls_many([c.segment_trees for c in mbs], args.chunk_size), args.repeat)
    from harts.plan.layout import build_layout

    def layout_all():
        for c, p in zip(mbs, plans):
            build_layout(c, p)

    _, layout_s = _best_of(layout_all, args.repeat)
    calls = np.bincount([p.num_calls for p in plans])
    res = {
        "workload": args.workload,
        "step": args.step,
        "trajectories": batch.num_trajectories,
        "semantic_tokens": cb.num_semantic_tokens,
        "compact_tokens": cb.num_compact_tokens,
        "generate_s": round(gen_s, 3),
        "compact_s": round(compact_s, 3),
        "whole_step_segments": cb.segment_trees.num_segments,
        "whole_step_plan_s": round(whole_s, 5),
        "whole_step_calls": whole.num_calls,
        "dp": args.dp,
        "capacity": args.capacity,
        "microbatches": len(mbs),
        "microbatch_segments": int(sum(c.segment_trees.num_segments for c in mbs)),
        "microbatch_plan_s": round(mb_s, 5),
        "microbatch_plan_one_by_one_s": round(one_by_one_s, 5),
        "plan_over_compact_pct": round(100 * mb_s / compact_s, 3),
        "microbatch_layout_s": round(layout_s, 4),
        "layout_over_compact_pct": round(100 * layout_s / compact_s, 3),
        "calls_histogram": {int(k): int(n) for k, n in enumerate(calls) if n},
    }
    print(
        f"{args.workload} step {args.step}: {batch.num_trajectories} paths, S={cb.num_semantic_tokens:,}, "
        f"C={cb.num_compact_tokens:,}; compaction {compact_s:.3f} s"
    )
    print(
        f"  plan every microbatch ({len(mbs)} microbatches, dp={args.dp}, T={args.capacity}): "
        f"{mb_s * 1e3:.1f} ms = {res['plan_over_compact_pct']:.2f}% of compaction with plan_calls_many "
        f"({one_by_one_s * 1e3:.1f} ms one plan_calls at a time; whole step as one forest: "
        f"{whole_s * 1e3:.1f} ms, {whole.num_calls} calls)"
    )
    print(
        f"  build_layout for every microbatch: {layout_s * 1e3:.1f} ms = "
        f"{res['layout_over_compact_pct']:.2f}% of compaction"
    )
    print(f"  calls per microbatch: {res['calls_histogram']}")
    return res, cb.segment_trees


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__, __file__)
    p.add_argument("--segments", type=int, default=1_000_000)
    p.add_argument("--chunk-size", type=int, default=64)
    p.add_argument("--repeat", type=int, default=3, help="best of N runs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workload", default="swe")
    p.add_argument("--step", type=int, default=0)
    p.add_argument("--dp", type=int, default=8)
    p.add_argument("--capacity", type=int, default=65_536)
    p.add_argument("--no-swe", action="store_true", help="skip the workload part (and the swe-tiled shape)")
    p.add_argument("--deep-chain", action="store_true", help="add the single deep caterpillar worst case")
    p.add_argument("--sweep", action="store_true", help="time each planner path over forest sizes (only that)")
    p.add_argument(
        "--sweep-sizes", type=_sizes, default=_sizes("64,256,512,1024,2048,4096,8192,32768,262144"), help="N,N,..."
    )
    add_json_argument(p)
    args = parse(p, argv)
    out: dict = {"chunk_size": args.chunk_size}
    if args.sweep:
        out["sweep"] = bench_sweep(args)
        write_json(args, out)
        return 0
    swe_forest = None
    if not args.no_swe:
        out["swe"], swe_forest = bench_swe(args)
    out["forests"] = bench_forests(args, swe_forest)
    write_json(args, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(run(main))
