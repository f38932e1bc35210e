"""Prefix detection on flat trajectories: how fast the engine finds what a batch shares.

The trainer engine (``harts.trainer.engine``) takes one token list per trajectory and finds the
shared prefixes itself: the lists become a ``RolloutBatch`` (``trajectories_to_batch``), whose
LCP index (``harts.tree.compact.prefix_index``: a lexicographic sort and the adjacent longest
common prefixes) is all the step planner reads. This times both on a batch of about
``--tokens`` raw tokens cut from a synthetic agentic workload, given as Python lists (what a
JSON client sends) and as numpy arrays (what an in-process RL loop holds), on the calling
thread, and prints raw tokens per second for each, plus the full compaction (the trie) for
reference, as a table and JSON.

    taskset -c 0 python benchmarks/prefix_detection.py --tokens 1000000 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from harts.tree import workloads
from harts.tree.compact import compact, prefix_index


def _median_seconds(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default="medium", help="harts workload preset the batch is cut from")
    p.add_argument("--tokens", type=int, default=1_000_000, help="raw tokens in the batch (about)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default=None, help="write the figures here")
    args = p.parse_args()

    from harts.trainer.engine import trajectories_to_batch

    source = workloads.generate(args.workload, step=0)
    keep = np.flatnonzero(np.cumsum(source.lengths) <= args.tokens)
    batch = source.select(keep if keep.size else [0])
    vocab = int(batch.tokens.max()) + 1
    as_lists = [{"tokens": t.tolist()} for t in batch.trajectories()]
    as_arrays = [{"tokens": t.copy()} for t in batch.trajectories()]
    flat = trajectories_to_batch(as_lists, vocab_size=vocab)

    rows = {
        "lists -> batch": _median_seconds(lambda: trajectories_to_batch(as_lists, vocab_size=vocab), args.repeats),
        "arrays -> batch": _median_seconds(lambda: trajectories_to_batch(as_arrays, vocab_size=vocab), args.repeats),
        "prefix index (sort + LCP)": _median_seconds(lambda: prefix_index(flat), args.repeats),
        "compaction (trie, for reference)": _median_seconds(lambda: compact(flat), args.repeats),
    }
    rows["prefix detection, lists"] = rows["lists -> batch"] + rows["prefix index (sort + LCP)"]
    rows["prefix detection, arrays"] = rows["arrays -> batch"] + rows["prefix index (sort + LCP)"]
    s = batch.num_tokens
    print(f"{args.workload}: {batch.num_trajectories} trajectories, {s:,} raw tokens, compression {compact(flat).compression:.2f}x")
    print(f"{'stage':<36} {'seconds':>9} {'M raw tokens/s':>15}")
    for name, sec in rows.items():
        print(f"{name:<36} {sec:>9.4f} {s / sec / 1e6:>15.1f}")
    if args.json:
        out = {
            "workload": args.workload,
            "trajectories": batch.num_trajectories,
            "raw_tokens": s,
            "repeats": args.repeats,
            "seconds": rows,
            "raw_tokens_per_second": {k: s / v for k, v in rows.items()},
        }
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=2)


if __name__ == "__main__":
    main()
