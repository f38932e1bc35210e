"""``harts stats``: the shape of a rollout batch file or a built-in workload."""

from __future__ import annotations

import argparse

HELP = "Print paths, raw/compact tokens, compression, forks and depth for a batch or workload."


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", nargs="?", help="a RolloutBatch file (.jsonl or .parquet)")
    p.add_argument("--workload", default=None, help="built-in workload preset (tiny, small, medium, swe)")
    p.add_argument("--steps", type=int, default=None, help="steps of the workload (default: all of the preset)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chunk-size", type=int, default=None, help="chunk grid for fork alignment counts")
    p.add_argument("--json", dest="json_out", default=None, help="also write the figures as JSON here")


def run(args: argparse.Namespace) -> int:
    import json
    import time

    from tqdm import tqdm

    from harts.commands._format import format_table
    from harts.commands._inputs import batch_sources
    from harts.tree.compact import compact
    from harts.tree.stats import batch_stats
    from harts.tree.workloads import PRESETS

    sources = batch_sources([args.file] if args.file else [], args.workload, args.steps, args.seed)
    preset = PRESETS.get(args.workload or "small") if not args.file else None
    chunk = args.chunk_size or (preset.chunk_size if preset else 64)

    rows, records = [], []
    for label, make in tqdm(sources, desc="stats", unit="step", disable=len(sources) < 2):
        batch = make()
        t0 = time.perf_counter()
        cb = compact(batch)
        seconds = time.perf_counter() - t0
        st = batch_stats(cb, chunk)
        records.append({"batch": label, "compact_seconds": round(seconds, 4), **st.to_dict()})
        rows.append([label, st.paths, st.raw_tokens, st.compact_tokens, f"{st.compression:.2f}x",
                     st.forks, st.side_branches, st.max_depth, st.max_fanout, st.max_path,
                     st.short_segments, st.forks_near_chunk_boundary, f"{seconds:.2f}"])
    headers = ["batch", "paths", "raw tokens", "compact", "compress", "forks", "side br.", "depth",
               "fan-out", "max path", "1-15 tok seg", f"forks@{chunk}k+-1", "compact s"]
    print(format_table(headers, rows))
    if args.json_out:
        with open(args.json_out, "w") as fh:
            json.dump({"chunk_size": chunk, "batches": records}, fh, indent=2)
        print(f"wrote {args.json_out}")
    return 0
