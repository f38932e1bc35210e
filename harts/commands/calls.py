"""``harts calls``: minimum-call linear-attention plan of a segment tree or a rollout batch.

Input is a TREE.json segment file (see ``harts.plan.tree_file``) or a RolloutBatch file
(``.jsonl`` / ``.parquet``), which is compacted and every tree in it planned together.
"""

from __future__ import annotations

import argparse

from harts.commands._inputs import positive_int

#: every user error here is a harts.errors.UserError (see harts.cli)
TYPED_ERRORS = True

HELP = "Plan minimum-call chunkwise linear-attention rounds for a TREE.json or a rollout batch file"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", help="TREE.json segment file, or a RolloutBatch .jsonl/.parquet file")
    parser.add_argument(
        "--chunk-size",
        type=positive_int,
        default=None,
        help="linear-attention chunk size B (default: the tree file's chunk_size, else 64)",
    )
    parser.add_argument(
        "--json",
        dest="json_out",
        nargs="?",
        const="-",
        default=None,
        metavar="FILE",
        help="write the plan as JSON to FILE; a bare --json (or --json -) prints only the JSON, on stdout",
    )
    parser.add_argument(
        "--plot", metavar="FILE", default=None, help="draw the segment tree and the plan (.png, .pdf or .svg)"
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace existing output files (without it, an existing output is an error)",
    )


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from harts.errors import UserError
    from harts.outputs import PLOT_FORMATS, check_output_file, write_json
    from harts.plan.calls import plan_calls
    from harts.plan.plot import MAX_SEGMENTS

    check_output_file(args.json_out, "--json", args.overwrite)
    check_output_file(args.plot, "--plot", args.overwrite, formats=PLOT_FORMATS)
    path = Path(args.path)
    if not path.exists():
        raise UserError(f"{path}: no such file (give a TREE.json or a .jsonl/.parquet batch file)")
    if path.is_dir():
        raise UserError(f"{path}: is a directory (give a TREE.json or a .jsonl/.parquet batch file)")
    if path.suffix in (".jsonl", ".parquet"):
        from harts.tree.batch import RolloutBatch
        from harts.tree.compact import compact

        forest = compact(RolloutBatch.load(str(path))).segment_trees
        file_chunk = None
    else:
        from harts.plan.tree_file import load_tree

        forest, file_chunk = load_tree(path)
    if args.plot and forest.num_segments > MAX_SEGMENTS:
        raise UserError(
            f"--plot draws at most {MAX_SEGMENTS} segments; {path} has {forest.num_segments} (drop --plot, or plot a "
            "smaller tree)"
        )
    chunk = args.chunk_size if args.chunk_size is not None else (file_chunk or 64)
    plan = plan_calls(forest, chunk)

    quiet = args.json_out == "-"  # stdout holds only the JSON
    if quiet:
        write_json("-", plan.summary(), indent=None)
    else:
        _print_text(plan)
        if args.json_out:
            write_json(args.json_out, plan.summary())
            print(f"wrote {args.json_out}")
    if args.plot:
        from harts.plan.plot import plot_plan

        plot_plan(plan, args.plot)
        if not quiet:
            print(f"plot written to {args.plot}")
    return 0


_MAX_LINES = 40


def _print_text(plan) -> None:  # noqa: ANN001 - CallPlan, imported lazily
    f = plan.forest
    s = plan.summary()
    print(
        f"calls: {s['calls']}   replay R: {s['replay']}   sequences: {plan.num_sequences}   "
        f"segments: {f.num_segments}   trees: {f.num_trees}   chunk size: {plan.chunk_size}   "
        f"boundary states: {plan.num_requests}"
    )
    init = plan.seq_init
    q = 0
    for rnd in s["rounds"]:
        print(f"call {rnd['round']}: {len(rnd['sequences'])} sequences, replay {rnd['replay']}")
        for i, seq in enumerate(rnd["sequences"]):
            if i == _MAX_LINES:
                print(f"  ... ({len(rnd['sequences']) - i} more; use --json for all)")
                q += len(rnd["sequences"]) - i
                break
            k = int(init[q])
            src = "zero state" if k < 0 else f"state {k} (call {int(plan.seq_round[plan.req_seq[k]]) + 1})"
            chain = " -> ".join(seq["segments"])
            if len(chain) > 100:
                chain = chain[:97] + "..."
            print(f"  {chain}   (replay {seq['replay']}, from {src})")
            q += 1
