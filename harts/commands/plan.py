"""``harts plan``: plan microbatches x DP replicas x slots per step, harts vs a baseline."""

from __future__ import annotations

import argparse
import contextlib

from harts.commands._inputs import (
    add_option,
    add_output_arguments,
    add_planner_workers_argument,
    add_workload_preset_arguments,
    positive_float,
)

#: every user error here is a harts.errors.UserError (see harts.cli)
TYPED_ERRORS = True

HELP = "Prefix-aware step planning (paper Tables 2-3): compact work, planning time, DP imbalance."


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("files", nargs="*", help="RolloutBatch files (.jsonl or .parquet), one step each")
    add_workload_preset_arguments(p)
    add_option(p, "dp", default=4, help="data-parallel degree D")
    add_option(p, "capacity", help="microbatch capacity T in compact tokens")
    p.add_argument("--baseline", choices=["ortools"], default=None, help="also run this baseline planner")
    p.add_argument("--time-limit", type=positive_float, default=10.0, help="OR-Tools CP-SAT seconds per replica")
    add_option(p, "seed", help="workload seed (and CP-SAT seed)")
    add_planner_workers_argument(p)
    add_output_arguments(p, what="every number")
    p.add_argument(
        "--plot", default=None, metavar="FILE", help="draw compact work and imbalance here (.png, .pdf or .svg)"
    )


def run(args: argparse.Namespace) -> int:
    from harts.commands._inputs import (
        batch_sources,
        check_capacity,
        check_plannable,
        planner_workers,
    )
    from harts.commands._inputs import (
        summarize as summarize_step,
    )
    from harts.commands._progress import progress
    from harts.errors import UserError
    from harts.outputs import PLOT_FORMATS, check_output_file, write_json
    from harts.plan.bench import plan_batches, plot, summarize

    check_output_file(args.json_out, "--json", args.overwrite)
    check_output_file(args.plot, "--plot", args.overwrite, formats=PLOT_FORMATS)
    if args.baseline == "ortools":
        try:
            import ortools  # noqa: F401
        except ImportError:
            raise UserError("--baseline ortools needs OR-Tools: pip install 'harts[ortools]'") from None
    labelled = batch_sources(args.files, args.workload, args.steps, args.seed)
    # every step is read (and checked against --capacity and --dp) before any planning starts;
    # files are kept from this pass, presets are generated again when planned
    summaries, kept = [], {}
    with progress(len(labelled), "checking inputs", "step", leave=False, disable=len(labelled) < 2) as bar:
        for i, (label, make) in enumerate(labelled):
            batch = make()
            st = summarize_step(i, label, batch)
            summaries.append(st)
            if args.dp > 1 and st.longest_len <= args.capacity and st.trajectories >= args.dp:
                check_plannable(batch, st, args.capacity, args.dp)
            if args.files:
                kept[i] = batch
            bar.update()
    check_capacity(summaries, args.capacity, args.dp, dp_name="replicas of --dp")
    sources = [(i + 1, (lambda b=kept[i]: b) if i in kept else make) for i, (_, make) in enumerate(labelled)]
    base = args.baseline
    params = {"time_limit": args.time_limit, "seed": args.seed} if base else None
    from harts.plan.step.workers import PlannerWorkers

    processes = planner_workers(args.planner_workers)
    with PlannerWorkers(processes) if processes else contextlib.nullcontext() as workers:
        if workers is not None:
            workers.wait_ready()  # their start-up is not planning time
        with progress(len(sources), f"plan D={args.dp}", "step") as bar:
            steps = plan_batches(
                sources,
                dp=args.dp,
                capacity=args.capacity,
                baseline=base,
                baseline_params=params,
                progress=bar,
                workers=workers,
            )
    summary = summarize(steps, base)
    _report(args, steps, summary, processes)
    if args.json_out:
        write_json(
            args.json_out,
            {
                "dp": args.dp,
                "capacity": args.capacity,
                "workload": args.workload,
                "seed": args.seed,
                "planner_workers": processes,
                "steps": steps,
                "summary": summary,
            },
            indent=1,
        )
        print(f"wrote {args.json_out}")
    if args.plot:
        plot(steps, base, args.plot)
    return 0


def _report(args: argparse.Namespace, steps: list[dict], summary: dict, processes: int) -> None:
    """The steps' table, the DP-replica balance, and the baseline's and workers' comparisons."""
    from harts.commands._table import format_table

    base = args.baseline
    serial = all("plan_seconds_serial" in s["harts"] for s in steps)
    headers = ["step", "paths", "raw tokens", "harts compact"]
    if base:
        headers += [f"{base} compact", "compact OR/H", "time OR/H"]
    headers += [f"harts s ({processes} workers)", "harts s (serial)"] if serial else ["harts s"]
    headers += ["index s"] + ([f"{base} s"] if base else [])
    rows = []
    for s in steps:
        h = s["harts"]
        row = [s["step"], s["paths"], s["raw_tokens"], h["compact_tokens"]]
        if base:
            b = s[base]
            row += [
                b["compact_tokens"],
                f"{b['compact_tokens'] / h['compact_tokens']:.6f}x",
                f"{b['plan_seconds'] / h['plan_seconds']:.3f}x",
            ]
        row += [f"{h['plan_seconds']:.3f}"] + ([f"{h['plan_seconds_serial']:.3f}"] if serial else [])
        row += [f"{h['index_seconds']:.3f}"] + ([f"{s[base]['plan_seconds']:.3f}"] if base else [])
        rows.append(row)
    print(format_table(headers, rows))
    print(
        "compact = the compact tokens of a step's microbatches, summed: a prefix shared by trajectories in "
        "different microbatches runs once in each (harts stats compacts the whole batch once, so it counts fewer)"
    )
    print()
    keys = ["harts"] + ([base] if base else [])

    def pair(field: str, pct: bool = True) -> str:
        vals = [summary[k][field] * (100 if pct else 1) for k in keys]
        return "/".join(f"{v:.4f}" if pct else f"{v}" for v in vals)

    print(f"DP-replica balance (D={args.dp}, T={args.capacity}; {'/'.join(keys)}):")
    print(
        format_table(
            ["slots", "within-slot P50 %", "within-slot P95 %", "step-total P50 %", "step-total max %"],
            [
                [
                    pair("slots", pct=False),
                    pair("within_slot_p50"),
                    pair("within_slot_p95"),
                    pair("step_total_p50"),
                    pair("step_total_max"),
                ]
            ],
        )
    )
    if base:
        print(
            f"\ncompact tokens {summary['harts']['compact_tokens']:,} (harts) vs "
            f"{summary[base]['compact_tokens']:,} ({base}); planning {summary['harts']['plan_seconds']:.2f} s vs "
            f"{summary[base]['plan_seconds']:.2f} s"
        )
    if serial:
        differ = [s["step"] for s in steps if not s["harts"]["same_plan_serial"]]
        print(
            f"\nharts planning with {processes} worker processes {summary['harts']['plan_seconds']:.2f} s, in this "
            f"process alone {summary['harts']['plan_seconds_serial']:.2f} s: "
            + (f"DIFFERENT PLANS at steps {differ} (a bug: please report it)" if differ else "the same plans")
        )
