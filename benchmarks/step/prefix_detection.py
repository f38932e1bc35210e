"""Prefix detection on flat trajectories: how fast the engine finds what a batch shares.

The trainer engine (``harts.trainer.engine``) takes one token list per trajectory and finds the
shared prefixes itself: the lists become a ``RolloutBatch`` (``trajectories_to_batch``), whose
LCP index (``harts.tree.compact.prefix_index``: a lexicographic sort and the adjacent longest
common prefixes) is all the step planner reads. This times both on a batch of about
``--tokens`` raw tokens cut from a synthetic agentic workload, given as Python lists (what a
JSON client sends) and as numpy arrays (what an in-process RL loop holds), on the calling
thread, and prints raw tokens per second for each, plus the full compaction (the trie) for
reference, as a table and JSON.

    taskset -c 0 python -m benchmarks.step.prefix_detection --tokens 1000000 --json out.json
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from benchmarks._runner import add_json_argument, median_seconds, parse, parser, run, write_json
from harts.tree import workloads
from harts.tree.compact import compact, prefix_index


def _median_seconds(fn: Callable[[], Any], repeats: int) -> float:
    """Host seconds, median of ``repeats`` runs without a warm-up (the first run counts too)."""
    return median_seconds(fn, None, repeats, warmup=False)


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__, __file__)
    p.add_argument("--workload", default="medium", help="harts workload preset the batch is cut from")
    p.add_argument("--tokens", type=int, default=1_000_000, help="raw tokens in the batch (about)")
    p.add_argument("--repeats", type=int, default=5)
    add_json_argument(p)
    args = parse(p, argv)

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
    print(
        f"{args.workload}: {batch.num_trajectories} trajectories, {s:,} raw tokens, compression {compact(flat).compression:.2f}x"
    )
    print(f"{'stage':<36} {'seconds':>9} {'M raw tokens/s':>15}")
    for name, sec in rows.items():
        print(f"{name:<36} {sec:>9.4f} {s / sec / 1e6:>15.1f}")
    out = {
        "workload": args.workload,
        "trajectories": batch.num_trajectories,
        "raw_tokens": s,
        "repeats": args.repeats,
        "seconds": rows,
        "raw_tokens_per_second": {k: s / v for k, v in rows.items()},
    }
    write_json(args, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(run(main))
