"""``harts compare``: one forward+backward of a GRPO loss, trajectory-wise vs compact, same weights.

Prints the batch's compression, the compact plan's calls and replay rows, the max relative
difference of log-probs, loss, MoE losses/counts and every parameter gradient, and the time
and peak memory of each mode (CUDA: ``max_memory_allocated``; CPU: the peak of live tensor
bytes from the torch profiler, measured in a second, untimed pass).
"""

from __future__ import annotations

import argparse
from typing import Any

from harts.commands._config import add_config_argument
from harts.commands._inputs import (
    add_execution_arguments,
    add_option,
    add_options,
    add_output_arguments,
    nonneg_int,
    recompute_fields,
)
from harts.commands._memory import add_force_argument

#: every user error here is a harts.errors.UserError (see harts.cli)
TYPED_ERRORS = True

HELP = "Run a batch through the model trajectory-wise and compactly; print agreement, time and memory."


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_option(p, "workload", default="tiny")
    p.add_argument("--step", type=nonneg_int, default=0, help="workload step (built-in presets)")
    add_options(p, "model", "pattern", "layers")
    add_option(p, "dtype", default="float64", choices=("float64", "float32"))
    add_execution_arguments(p)
    p.add_argument("--no-replay", action="store_true", help="the paper's no-replay ablation (compact side)")
    add_options(p, "seed", "device")
    add_option(p, "la_backend", default="reference")
    add_option(p, "threads", help="torch intra-op threads; 1 suits tiny tensors on a shared CPU, 0 lets torch choose")
    add_force_argument(p)
    add_output_arguments(p, what="the results")
    add_config_argument(p)


def run(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from harts.commands._inputs import (
        batch_vocab,
        build_model,
        check_device,
        check_output_file,
        check_recompute_layers,
        execution_config,
        model_spec,
        summarize,
    )
    from harts.commands._memory import check_memory
    from harts.commands._progress import progress
    from harts.models.execution.config import ExecutionConfig
    from harts.rl.verify import run_step

    check_output_file(args.json_out, "--json", args.overwrite)
    check_device(args.device)
    from harts.tree.workloads import load_workload

    batch, source = load_workload(args.workload, step=args.step, seed=args.seed), args.workload
    vocab, where = batch_vocab([summarize(args.step, source, batch)], args.model)
    # the trajectory-wise side is the larger one: every path's rows, the plain log-softmax head
    oracle = ExecutionConfig(mode="trajectory", **recompute_fields(args))
    spec = model_spec(args)
    check_memory(
        spec,
        vocab,
        capacity=batch.num_tokens,
        execution=oracle,
        optimizer=False,
        force=args.force,
        rows_option=None,
        where=where,
    )
    model = build_model(args, vocab, where=where, training=False)
    recompute = recompute_fields(args)
    check_recompute_layers(recompute, model)
    # phases: compaction + call plan, then per mode a warmup, the timed step and (CPU) the
    # profiled memory pass
    per_mode = 2 + (next(model.parameters()).device.type != "cuda")
    bar = progress(1 + 2 * per_mode, "compare", "phase")
    bar.set_postfix_str("prepare compact", refresh=False)
    execution = execution_config(args, no_replay=args.no_replay)
    inputs = model.prepare_compact(batch, execution)
    bar.update()

    runs = {}
    for mode in ("trajectory", "compact"):

        def on_phase(phase: str, mode: str = mode) -> None:  # a phase of run_step ended
            bar.update()

        bar.set_postfix_str(mode, refresh=False)
        runs[mode] = run_step(
            model,
            inputs,
            replace(execution, mode=mode),
            measure_memory=True,
            warmup=1,
            on_phase=on_phase,
        )
    bar.close()
    _report(args, source, model, inputs, runs)
    return 0


def _report(args: argparse.Namespace, source: str, model: Any, inputs: Any, runs: dict[str, Any]) -> None:  # noqa: ANN401
    """The batch, model and plan lines, both modes' table, their differences, and ``--json``."""
    import numpy as np

    from harts.commands._inputs import write_json
    from harts.commands._table import format_table
    from harts.rl.verify import compare_runs

    diff = compare_runs(runs["trajectory"], runs["compact"])
    cb, t, c = inputs.cb, runs["trajectory"], runs["compact"]
    batch, config = inputs.batch, model.config

    print(
        f"batch {source}: {batch.num_trajectories} trajectories, S={cb.num_semantic_tokens:,} tokens, "
        f"C={cb.num_compact_tokens:,} compact rows, compression {cb.compression:.2f}x"
    )
    print(
        f"model {args.model} ({config.layer_pattern}, {model.num_parameters():,} params, {args.dtype}), "
        f"recompute={args.recompute}, recompute_skip={','.join(args.recompute_skip) or 'none'}, "
        f"attention={args.attention}, no_replay={args.no_replay}, "
        f"la_backend={args.la_backend}, device={args.device}"
    )
    print(
        f"compact plan: {c.info['calls']} linear-attention calls, {c.info['replay_rows']:,} replay rows, "
        f"{c.info['boundary_states']} boundary states, P={c.info['rows']:,} physical rows"
    )
    print()
    print(
        format_table(
            ["mode", "rows", "calls", "loss", "time s", "peak MiB"],
            [
                [
                    m,
                    r.info["rows"],
                    r.info["calls"],
                    f"{r.loss:.10g}",
                    f"{r.seconds:.3f}",
                    f"{r.peak_bytes / 2**20:.1f}",
                ]
                for m, r in runs.items()
            ],
        )
    )
    print()
    print(format_table(["max relative difference", "value"], [[k, f"{v:.3e}"] for k, v in diff.items()]))
    speed = t.seconds / c.seconds if c.seconds > 0 else float("nan")
    print(f"\nspeedup (trajectory / compact time): {speed:.2f}x")
    if args.json_out:
        record = {
            "workload": source,
            "model": args.model,
            "config": config.to_dict(),
            "dtype": args.dtype,
            "recompute": args.recompute,
            "recompute_skip": list(args.recompute_skip),
            "moe_keep_gate_up": args.moe_keep_gate_up,
            "attention": args.attention,
            "no_replay": args.no_replay,
            "la_backend": args.la_backend,
            "device": args.device,
            "S": cb.num_semantic_tokens,
            "C": cb.num_compact_tokens,
            "compression": cb.compression,
            "modes": {
                m: {"loss": r.loss, "seconds": r.seconds, "peak_bytes": r.peak_bytes, **r.info} for m, r in runs.items()
            },
            "max_rel_diff": diff,
            "speedup": speed,
        }
        write_json(args.json_out, record, default=lambda o: o.item() if isinstance(o, np.generic) else str(o))
        print(f"wrote {args.json_out}")
