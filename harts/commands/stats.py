"""``harts stats``: the shape of a rollout batch file or a built-in workload."""

from __future__ import annotations

import argparse

from harts.commands._inputs import add_option, add_output_arguments, add_workload_preset_arguments, positive_int

#: every user error here is a harts.errors.UserError (see harts.cli)
TYPED_ERRORS = True

HELP = "Print paths, raw/compact tokens, compression, forks and depth for a batch or workload."


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", nargs="?", help="a RolloutBatch file (.jsonl or .parquet)")
    add_workload_preset_arguments(p)
    add_option(p, "seed", help="workload seed")
    p.add_argument(
        "--chunk-size",
        type=positive_int,
        default=None,
        help="chunk grid B for the forks@kB+-1 counts (default: the preset's, 64 for a file)",
    )
    add_output_arguments(p)


def run(args: argparse.Namespace) -> int:
    import time

    from harts.commands._inputs import batch_sources, check_output_file, write_json
    from harts.commands._progress import progress
    from harts.commands._table import format_table
    from harts.tree.compact import compact
    from harts.tree.stats import batch_stats
    from harts.tree.workloads import PRESETS

    check_output_file(args.json_out, "--json", args.overwrite)
    sources = batch_sources([args.file] if args.file else [], args.workload, args.steps, args.seed)
    preset = PRESETS.get(args.workload or "small") if not args.file else None
    chunk = args.chunk_size if args.chunk_size is not None else (preset.chunk_size if preset else 64)

    rows, records = [], []
    bar = progress(len(sources), "stats", "step", disable=len(sources) < 2)
    for label, make in sources:
        batch = make()
        t0 = time.perf_counter()
        cb = compact(batch)
        seconds = time.perf_counter() - t0
        st = batch_stats(cb, chunk)
        records.append({"batch": label, "compact_seconds": round(seconds, 4), **st.to_dict()})
        rows.append(
            [
                label,
                st.paths,
                st.raw_tokens,
                st.compact_tokens,
                f"{st.compression:.2f}x",
                st.forks,
                st.side_branches,
                st.max_depth,
                st.max_fanout,
                st.max_path,
                st.short_segments,
                st.forks_near_chunk_boundary,
                f"{seconds:.2f}",
            ]
        )
        bar.update()
    bar.close()
    headers = [
        "batch",
        "paths",
        "raw tokens",
        "compact",
        "compress",
        "forks",
        "side br.",
        "depth",
        "fan-out",
        "max path",
        "1-15 tok seg",
        f"forks@{chunk}k+-1",
        "compact s",
    ]
    print(format_table(headers, rows))
    if args.json_out:
        write_json(args.json_out, {"chunk_size": chunk, "batches": records})
        print(f"wrote {args.json_out}")
    return 0
