"""``harts bench``: training-step speed of harts against the trajectory-wise baseline.

See ``harts.experiments.step_bench``: whole steps (or one data-parallel replica's share with
``--dp D --replica R``), same weights, baseline microbatches packed by raw tokens, harts
microbatches from the prefix-aware planner, both at capacity T. Prints per step the paper's
Table 4 metrics (non-replay compact-row compression, F/B/Grad and Core speedup) beside each
side's time, tokens/s, model TFLOP/s, MFU and peak memory; a per-component time breakdown;
the warm-up time; every replica's predicted work. ``--json`` writes it all, ``--profile DIR``
writes a Chrome trace of one microbatch per side.

On a mesh (``harts.commands._bench_mesh``): ``torchrun --nproc-per-node N -m harts.cli bench
--ep E --cp C --tp P ...`` runs both sides as ``harts train`` runs its step on the same
(N / (E C P), E, C, P) mesh and reports the slowest rank's step time, MFU and every rank's peak
memory.
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

from harts.commands._config import add_config_argument
from harts.commands._inputs import (
    add_execution_arguments,
    add_logprobs_argument,
    add_lora_arguments,
    add_model_arguments,
    add_option,
    add_output_arguments,
    add_planner_workers_argument,
    add_workload_arguments,
    lora_config,
    nonneg_int,
    positive_float,
    positive_int,
    recompute_fields,
)
from harts.commands._memory import add_force_argument

TYPED_ERRORS = True
HELP = "Time training steps compactly vs trajectory-wise (F/B/Grad, Core, tokens/s, MFU, breakdown, memory)."


#: the --help text's word on benching a layout
MESH_HELP = (
    "A layout: torchrun --nproc-per-node 4 -m harts.cli bench --cp 2 --tp 2 ... times both sides on the "
    "(dp, ep, cp, tp) mesh harts train builds from the same flags (dp = ranks / (ep x cp x tp)): the "
    "slowest rank's step time, MFU over all ranks and every rank's peak memory, in the output and --json."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = MESH_HELP
    add_workload_arguments(p, default="small")
    p.add_argument(
        "--first-step",
        type=nonneg_int,
        default=0,
        help="start at this step of a preset (--first-step 5 --steps 1 times step 5 alone); default 0",
    )
    add_model_arguments(p)
    add_option(p, "capacity", help="microbatch capacity T (tokens)")
    add_execution_arguments(p)
    add_logprobs_argument(p, default="all", why="the paper-comparable figure; both sides always use the same setting")
    add_option(
        p,
        "dp",
        help="one process: data-parallel replicas the step is planned for (default 1; --replica's share is "
        "timed, nothing is launched); under torchrun: the mesh's data-parallel degree, which must be ranks / "
        "(--ep x --cp x --tp), the default",
    )
    p.add_argument(
        "--replica",
        type=nonneg_int,
        default=None,
        help="one process: which replica's share of the step to time (0 .. dp-1; default 0)",
    )
    add_option(
        p,
        "ep",
        help="under torchrun: expert-parallel degree, ranks each MoE layer's experts are split over",
    )
    add_option(
        p,
        "cp",
        help="under torchrun: Ulysses context-parallel degree, ranks that split each microbatch's compact rows "
        "(--capacity is per group of cp x tp ranks); it divides --capacity and the model's heads",
    )
    add_option(
        p,
        "tp",
        help="under torchrun: tensor-parallel degree with sequence parallelism, ranks that split the projections "
        "by heads / columns",
    )
    p.add_argument("--optimizer", action="store_true", help="also time one AdamW step (same for both sides)")
    add_lora_arguments(
        p,
        rank_help="Both sides train the same adapted model; MFU then counts only the work a frozen base needs: "
        "each frozen matmul [m rows, n in, k out] 2 m n k forward + 2 m n k input gradient (no weight gradient), "
        "each rank-r adapter 3 x 2 m r (n + k), attention and linear-attention cores 3 x forward (--json: "
        "mfu_formula)",
    )
    p.add_argument(
        "--peak-tflops",
        type=positive_float,
        default=None,
        help="device peak for MFU (TFLOP/s); default: dense bf16 peak of known GPUs (H100/H200 989.4). MFU = "
        "training FLOPs / seconds / peak, training = 3 x forward of the rows each side computes (recomputation "
        "not counted); with --lora only the work a frozen base needs (see --lora)",
    )
    p.add_argument(
        "--profile",
        default=None,
        metavar="DIR",
        help="write a Chrome trace (torch profiler) of one microbatch per side into DIR and, beside it (.txt), device busy time, device time by region (kernels attributed to the region that launched them; the top kernels outside every region) and the top-40 operator tables",
    )
    p.add_argument(
        "--profile-only",
        action="store_true",
        help="with --profile: profile the first microbatch of each side (after one untimed run of it) and stop, "
        "without timing the step (minutes less on a paper-scale step)",
    )
    p.add_argument(
        "--no-warmup",
        action="store_true",
        help="skip the untimed warm-up of each side (its first and its smallest microbatch)",
    )
    p.add_argument(
        "--no-core-run",
        action="store_true",
        help="skip harts' second timed run (the step as `harts train` runs it, each microbatch prepared on a host "
        "thread while the one before it is launched); Core then charges the step planner and every microbatch's "
        "preparation in full",
    )
    p.add_argument(
        "--repeats",
        type=positive_int,
        default=1,
        metavar="N",
        help="time each side's step (and harts' Core run) N times in a row and report the median run, "
        "with every run's seconds (a step of a few seconds varies by a few percent from run to run)",
    )
    add_planner_workers_argument(p)
    add_force_argument(p)
    add_output_arguments(p, what="every figure")
    add_config_argument(p)


def _fmt_rate(x: float) -> str:
    return f"{x / 1e3:,.1f}k"


def run(args: argparse.Namespace) -> int:
    import time

    started = time.perf_counter()  # the cold-start clock: before torch is imported

    from dataclasses import replace

    import torch

    from harts.commands._bench_mesh import mesh_asked, run_mesh, settings_record
    from harts.commands._inputs import (
        batch_vocab,
        build_model_and_attention,
        check_recompute_layers,
        execution_config,
        max_compression,
        model_spec,
        planner_workers,
        write_json,
    )
    from harts.commands._memory import check_memory
    from harts.models.flops import FlopModel, peak_tflops
    from harts.parallel.mesh import launch_world_size
    from harts.plan.step.workers import shared_workers

    world = launch_world_size()
    if mesh_asked(args, world):
        return run_mesh(args, world, _read_steps)
    args.dp, args.replica = args.dp or 1, args.replica or 0
    # the cold start's phases, seconds from ``started`` (the first step's are added below)
    cold = {"imports": time.perf_counter() - started}
    _check_flags(args)
    lora_cfg = lora_config(args)  # its flags checked before any work
    recompute = recompute_fields(args)
    sources, summaries = _read_steps(args, args.dp)
    cold["inputs_checked"] = time.perf_counter() - started
    # started now, so that spawning them overlaps building the model
    workers = shared_workers(planner_workers(args.planner_workers))
    vocab, where = batch_vocab(summaries, args.model)
    execution = execution_config(args)
    # the step's estimate (harts.models.memory), printed and written beside the measured peaks
    estimate = check_memory(
        model_spec(args),
        vocab,
        capacity=args.capacity,
        execution=replace(execution, fused_logprobs=True),
        optimizer=args.optimizer,
        force=args.force,
        where=where,
        frozen_base=lora_cfg is not None,
        compression=max_compression(summaries),
    )
    built = build_model_and_attention(args, vocab, execution, where=where)
    model, flex = built.model, built.flex
    lora = _adapt(model, lora_cfg)
    cold["model_built"] = time.perf_counter() - started
    cold_beside = {"model": round(built.model_seconds, 2), "attention_probe": round(built.attention_seconds, 2)}
    check_recompute_layers(recompute, model)
    peak = args.peak_tflops or peak_tflops(torch.device(args.device))
    print(
        f"model {args.model}: {model.config.layer_pattern}, hidden {model.config.hidden_size}, "
        f"vocabulary {model.config.vocab_size:,}, "
        f"{model.num_parameters():,} parameters, {args.dtype} on {args.device}; capacity {args.capacity:,}; "
        f"recompute {_recompute_words(recompute)}; log-probs {args.logprobs}; dp {args.dp}, replica {args.replica}; "
        f"{_lora_words(lora)}peak {'n/a' if peak is None else f'{peak:g} TFLOP/s'}",
        flush=True,
    )
    # the kernel record both sides run (FlexAttention's backend per layer kind among its choices)
    kernels = model.backends(execution)
    print(f"kernels (both sides): {kernels.describe()}", flush=True)
    if args.profile_only:
        return _profile_only(args, model, sources, execution, workers)
    results, cold_start = _bench_steps(args, model, sources, execution, workers, peak, started, cold, cold_beside)
    gdn = _gdn_kernels(model, kernels)
    if gdn is not None:
        print(f"GDN linear attention ran on: {gdn}", flush=True)
    _print_tables(results)
    _print_ratios(results)
    if estimate is not None:
        print(f"memory estimate of one step (harts.models.memory): {estimate.total / 2**30:.2f} GiB", flush=True)
    if args.json_out:
        write_json(
            args.json_out,
            {
                **settings_record(args, model, recompute),
                "flex_backend": flex,
                "la_backend": args.la_backend,
                "kernels": {**kernels.to_dict(), "gdn_kernels": gdn},
                "logprobs": args.logprobs,
                "dp": args.dp,
                "replica": args.replica,
                "peak_tflops": peak,
                "lora": lora,
                "mfu_formula": FlopModel.from_model(model).formula,
                "memory_estimate_gib": None if estimate is None else estimate.total / 2**30,
                "cold_start": cold_start if results else None,
                # the "model" phase's two halves, which ran side by side (build_model_and_attention)
                "cold_start_model_beside_attention": cold_beside,
                "steps": [r.to_dict() for r in results],
            },
        )
        print(f"wrote {args.json_out}")
    return 0


def _adapt(model: Any, lora: Any) -> dict[str, Any] | None:  # noqa: ANN401
    """``--lora``: the adapters on ``model`` (``apply_lora``: every base tensor frozen, in its
    dtype), and the record ``--json`` keeps of them; None without."""
    if lora is None:
        return None
    from dataclasses import asdict

    from harts.trainer.lora import apply_lora

    params = apply_lora(model, lora)
    return {**asdict(lora), "adapter_parameters": sum(p.numel() for p in params)}


def _lora_words(lora: dict[str, Any] | None) -> str:
    """The run header's word on ``--lora`` (nothing without it)."""
    if lora is None:
        return ""
    targets = ", ".join(k.removeprefix("train_") for k in ("train_attn", "train_mlp", "train_unembed") if lora[k])
    return (
        f"LoRA rank {lora['rank']}, alpha {lora['alpha']:g} on {targets} ({lora['adapter_parameters']:,} adapter "
        "parameters train, the base frozen); "
    )


def _gdn_kernels(model: Any, kernels: Any) -> str | None:  # noqa: ANN401
    """For a model with GDN layers on the tree kernel: which kernels its GDN calls ran on
    (``harts.ops.linear_attn.tree_kernel.gdn_kernels``: "gdn" fla-core's GDN kernels, "kda" the
    KDA kernels with the decay broadcast, "mixed"); None otherwise."""
    if "G" not in model.config.layer_pattern or kernels.linear_attention != "tree":
        return None
    from harts.ops.linear_attn.tree_kernel import gdn_kernels

    return gdn_kernels()


def _check_flags(args: argparse.Namespace) -> None:
    """The flags that contradict each other, and the output paths, before any work."""
    from harts.commands._inputs import check_output_dir, check_output_file
    from harts.errors import UserError

    if args.replica >= args.dp:
        raise UserError(f"--replica must lie in [0, {args.dp}) for --dp {args.dp}; got {args.replica}")
    check_output_file(args.json_out, "--json", args.overwrite)
    check_output_dir(args.profile, "--profile", args.overwrite)
    if args.profile_only:
        if not args.profile:
            raise UserError("--profile-only needs --profile DIR (where the traces go)")
        for flag, given in (
            ("--json", args.json_out),
            ("--optimizer", args.optimizer),
            ("--no-core-run", args.no_core_run),
        ):
            if given:
                raise UserError(f"--profile-only times nothing, so {flag} has nothing to act on; drop one of them")


def _read_steps(args: argparse.Namespace, replicas: int) -> tuple[list, list]:
    """The steps to bench (``--first-step``, ``--steps``) and their summaries, every one read and
    checked (for a plan of ``replicas`` replicas) before the first runs."""
    from harts.commands._inputs import check_capacity, check_plannable, step_sources, summarize
    from harts.commands._progress import progress
    from harts.errors import UserError

    # every step is read and checked before the first one runs
    sources = step_sources(args.workload, None if args.steps is None else args.first_step + args.steps, args.seed)
    if args.first_step >= len(sources):
        raise UserError(
            f"--first-step {args.first_step}: workload {args.workload!r} has {len(sources)} step(s) here "
            f"(0 .. {len(sources) - 1}{'' if args.steps is None else f' with --steps {args.steps}'})"
        )
    sources = sources[args.first_step :]
    summaries = []
    with progress(len(sources), "checking inputs", "step", leave=False, disable=len(sources) < 2) as bar:
        for i, (label, make) in enumerate(sources, start=args.first_step):
            batch = make()
            st = summarize(i, label, batch)
            if replicas > 1 and st.longest_len <= args.capacity and st.trajectories >= replicas:
                check_plannable(batch, st, args.capacity, replicas, ("compact", "trajectory"))
            summaries.append(st)
            del batch  # steps are made again when they run: a paper-scale step is ~0.5 GB of ids
            bar.update()
    check_capacity(summaries, args.capacity, replicas, dp_name="replicas (--dp)")
    return sources, summaries


def _profile_only(args: argparse.Namespace, model: Any, sources: list, execution: Any, workers: Any) -> int:  # noqa: ANN401
    """``--profile-only``: a Chrome trace of one microbatch per side and step, and its summary."""
    import os

    from harts.experiments.step_bench import profile_step

    for step, (_, make) in enumerate(sources, start=args.first_step):
        paths = profile_step(
            model,
            make(),
            os.path.join(args.profile, f"step{step}"),
            capacity=args.capacity,
            execution=execution,
            dp=args.dp,
            replica=args.replica,
            planner_workers=workers,
        )
        for path in paths:
            with open(path) as f:
                head = f.read().split("\nsorted by")[0]
            print(f"step {step}, {os.path.basename(path)[:-4]} ({path}):\n{head}", flush=True)
    return 0


def _bench_steps(
    args: argparse.Namespace,
    model: Any,  # noqa: ANN401
    sources: list,
    execution: Any,  # noqa: ANN401
    workers: Any,  # noqa: ANN401
    peak: float | None,
    started: float,
    cold: dict[str, float],
    cold_beside: dict[str, float],
) -> tuple[list, dict[str, float] | None]:
    """Every step timed both ways (``bench_step``), with its lines as it ends; returns the
    results and the cold start's phases (from the first step)."""
    import os
    import time

    from harts.commands._progress import progress
    from harts.experiments.step_bench import bench_step

    cold_start = None
    results: list = []
    steps_bar = progress(len(sources), "bench", "step", disable=len(sources) < 2)
    with steps_bar:
        for step, (_, make) in enumerate(sources, start=args.first_step):
            batch = make()
            if not results:
                cold["step_made"] = time.perf_counter() - started
            r = bench_step(
                model,
                batch,
                capacity=args.capacity,
                step=step,
                execution=execution,
                warmup=not args.no_warmup,
                dp=args.dp,
                replica=args.replica,
                optimizer=args.optimizer,
                peak_tflops=peak,
                progress=lambda total, desc: progress(total, desc, "mb", leave=False, position=1),
                profile_dir=os.path.join(args.profile, f"step{step}") if args.profile else None,
                clock_origin=started,
                core_run=not args.no_core_run,
                planner_workers=workers,
                repeats=args.repeats,
            )
            results.append(r)
            _print_step_times(args, step, r)
            if len(results) == 1:
                cold_start = cold_start_phases(cold, r.baseline.seconds_to_timed, r.baseline.warmup_seconds)
                print(
                    f"cold start: the first timed microbatch began {r.baseline.seconds_to_timed:.1f} s (baseline) and "
                    f"{r.harts.seconds_to_timed:.1f} s (harts) after the command started; the baseline's "
                    f"{r.baseline.seconds_to_timed:.1f} s: {_phase_words(cold_start, cold_beside)}",
                    flush=True,
                )
            _print_step_notes(step, r)
            steps_bar.update()
    return results, cold_start


def _print_step_times(args: argparse.Namespace, step: int, r: Any) -> None:  # noqa: ANN401
    """A step's times: F/B/Grad, Core, per microbatch, the repeats, the planner's workers."""
    print(
        f"step {step}: baseline {r.baseline.train_seconds:.3f} s, harts {r.harts.train_seconds:.3f} s "
        f"(+{r.harts.plan_seconds:.3f} s planning, all made ahead): F/B/Grad {r.fbg_speedup:.2f}x "
        f"(warm-up {r.baseline.warmup_seconds:.1f} / {r.harts.warmup_seconds:.1f} s, untimed)",
        flush=True,
    )
    if r.harts.core_seconds is not None:
        print(
            f"step {step}: harts as `harts train` runs it (step planner, then each microbatch prepared "
            f"on a host thread while the one before it is launched): {r.harts.core_seconds:.3f} s, planning on the critical path "
            f"{r.harts.critical_plan_seconds:.3f} s (of which the step planner {r.step_plan_seconds:.3f} s): "
            f"Core {r.core_speedup:.2f}x",
            flush=True,
        )
    core_mb, fbg_mb = r.harts.core_microbatch_seconds, r.harts.microbatch_seconds
    if core_mb and len(core_mb) == len(fbg_mb):
        diff = [1e3 * (c - f) for c, f in zip(core_mb, fbg_mb)]
        worst = max(range(len(diff)), key=lambda i: abs(diff[i]))
        print(
            f"step {step}: harts' Core run against its F/B/Grad run, ms per microbatch: "
            f"min {min(diff):+.1f} / median {float(np.median(diff)):+.1f} / max {max(diff):+.1f}, "
            f"largest at #{worst} ({diff[worst]:+.1f}; #0 includes waiting for its preparation); the host "
            f"waited {r.harts.core_prepare_wait_seconds or 0.0:.3f} s for preparations in all",
            flush=True,
        )
    if args.repeats > 1:
        runs = [("baseline", r.baseline.train_seconds_runs), ("harts", r.harts.train_seconds_runs)]
        if r.harts.core_seconds_runs:
            runs.append(("harts' Core", r.harts.core_seconds_runs))
        words = "; ".join(f"{name} {' / '.join(f'{x:.3f}' for x in xs)}" for name, xs in runs)
        print(
            f"step {step}: {args.repeats} timed runs each, in order (the median reported): {words} s",
            flush=True,
        )
    if r.planner_workers:
        same = "the same plan" if r.planner_workers_same_plan else "A DIFFERENT PLAN (a bug: please report it)"
        print(
            f"step {step}: step planner with {r.planner_workers} worker processes {r.step_plan_seconds:.3f} s, "
            f"in this process alone {r.step_plan_seconds_serial:.3f} s: {same}",
            flush=True,
        )


def _print_step_notes(step: int, r: Any) -> None:  # noqa: ANN401
    """What a step's timed runs included that a warm run would not: compiles, new Triton
    variants, the CUDA allocator's synchronizations."""
    for name, side in (("baseline", r.baseline), ("harts", r.harts)):
        if side.compiles_in_timed_step:
            print(
                f"step {step}: note: torch.compile built {side.compiles_in_timed_step} graph(s) inside "
                f"{name}'s timed step (a shape or variant the warm-up did not meet); its time includes them",
                flush=True,
            )
        if side.triton_variants_in_timed_step:
            print(
                f"step {step}: note: {len(side.triton_variants_in_timed_step)} Triton kernel variant(s) were "
                f"first used inside {name}'s timed step (compiled or loaded; the warm-up did not meet them): "
                f"{_variant_words(side.triton_variants_in_timed_step)}; its time includes them",
                flush=True,
            )
    for name, syncs in (
        ("baseline's timed step", r.baseline.allocator_syncs),
        ("harts' timed step", r.harts.allocator_syncs),
        ("harts' Core run", r.harts.allocator_syncs_in_core_run),
    ):
        if syncs:
            print(
                f"step {step}: note: the CUDA caching allocator synchronized the device {syncs} time(s) in "
                f"{name} (allocation retries and blocks freed to the driver; memory near the limit or "
                "fragmented)",
                flush=True,
            )
    if r.harts.compiles_in_core_run:
        print(
            f"step {step}: note: torch.compile built {r.harts.compiles_in_core_run} graph(s) inside harts' "
            "Core run; Core includes them",
            flush=True,
        )
    if r.harts.triton_variants_in_core_run:
        print(
            f"step {step}: note: {len(r.harts.triton_variants_in_core_run)} Triton kernel variant(s) were "
            f"first used inside harts' Core run: {_variant_words(r.harts.triton_variants_in_core_run)}; "
            "Core includes them",
            flush=True,
        )


def _print_tables(results: list) -> None:
    """The steps' table, the rows and rates by side, and the time by component."""
    from harts.commands._table import format_table
    from harts.experiments.bench_result import COMPONENTS

    def mem(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.2f}"

    def mfu(r, side) -> str:  # noqa: ANN001
        m = r.mfu(side)
        return "n/a" if m is None else f"{100 * m:.1f}%"

    rows = [
        [
            r.step,
            r.paths,
            r.harts.raw_tokens,
            f"{r.compression:.2f}x",
            f"{r.baseline.microbatches}/{r.harts.microbatches}",
            r.harts.calls,
            r.harts.replay_rows,
            f"{r.baseline.train_seconds:.3f}",
            f"{r.harts.train_seconds:.3f}",
            f"{r.harts.critical_plan_seconds:.3f}",
            f"{r.fbg_speedup:.2f}x",
            f"{r.core_speedup:.2f}x",
            f"{mem(r.baseline.peak_memory_gb)}/{mem(r.harts.peak_memory_gb)}",
        ]
        for r in results
    ]
    print(
        format_table(
            [
                "step",
                "paths",
                "raw tok",
                "compress",
                "mbs base/harts",
                "calls",
                "replay",
                "base s",
                "harts s",
                "crit. plan s",
                "F/B/Grad",
                "Core",
                "peak GiB base/harts",
            ],
            rows,
        )
    )
    print()
    rows = []
    for r in results:
        for name, side in (("baseline", r.baseline), ("harts", r.harts)):
            rows.append(
                [
                    r.step,
                    name,
                    f"{side.rows:,}",
                    _fmt_rate(side.rows_per_second),
                    _fmt_rate(side.raw_tokens_per_second),
                    f"{side.flops / 1e12:.4g}",
                    f"{side.tflops:.4g}",
                    mfu(r, side),
                ]
            )
    print(format_table(["step", "side", "rows", "rows/s", "raw tok/s", "model TFLOP", "TFLOP/s", "MFU"], rows))
    print()
    rows = []
    for r in results:
        for name, side in (("baseline", r.baseline), ("harts", r.harts)):
            b = side.breakdown
            cells = [f"{b.get(c, {}).get('total', 0.0):.3f}" for c in COMPONENTS]
            rec = sum(v.get("recompute", 0.0) for v in b.values())
            rows.append([r.step, name, *cells, f"{rec:.3f}", f"{side.plan_seconds:.3f}"])
    print(
        "time by component, seconds (forward + backward + recompute; 'other' = norms, projections outside "
        "the regions, embedding, loss, glue):"
    )
    print(
        format_table(
            [
                "step",
                "side",
                "lin. attn",
                "attention",
                "MoE",
                "LM head+logp",
                "other",
                "of which recompute",
                "prep/plan",
            ],
            rows,
        )
    )


def _print_ratios(results: list) -> None:
    """Against the baseline's time per unit of work, the recurrence fit, the microbatches, the
    optimizer, the predicted work per replica, and all steps together."""
    from harts.experiments.bench_result import recurrence_words

    labels = {
        "linear_attention": "lin. attn",
        "attention": "attention",
        "moe": "MoE",
        "lm_head": "LM head",
        "other": "other",
    }
    for r in results:
        ideal = r.ideal()
        if ideal is not None:
            ratios = ", ".join(f"{labels[c]} {v:.2f}" for c, v in ideal["ratio"].items() if v is not None)
            print(
                f"step {r.step}: at the baseline's time per unit of work (a row; an LM-head row; an attention "
                f"pair) harts would take {ideal['total_seconds']:.3f} s: F/B/Grad {ideal['fbg_speedup']:.2f}x = "
                f"{ideal['of_compression']:.2f}x of compression; measured / that: {ratios}"
            )
    for r in results:
        fit = r.recurrence_fit()
        if fit is not None:
            print(f"step {r.step}: {recurrence_words(fit)}")
    for r in results:
        for name in ("baseline", "harts"):
            side = getattr(r, name)
            print(f"step {r.step}: {name} {_microbatch_words(side)}")
        if r.optimizer_seconds is not None:
            print(f"step {r.step}: optimizer (AdamW, one step) {r.optimizer_seconds:.3f} s")
        if r.dp > 1:
            print(
                f"step {r.step}: predicted work per replica (timed: {r.replica}): harts compact "
                f"{r.predicted_harts}, baseline raw {r.predicted_baseline}"
            )
    if len(results) > 1:
        tb = sum(r.baseline.train_seconds for r in results)
        th = sum(r.harts.train_seconds for r in results)
        tc = sum(r.harts.core_time for r in results)
        rb = sum(r.baseline.raw_tokens for r in results) / max(tb, 1e-12)
        print(
            f"all steps: F/B/Grad {sum(r.harts.raw_tokens for r in results) / max(th, 1e-12) / max(rb, 1e-12):.2f}x, "
            f"Core {sum(r.harts.raw_tokens for r in results) / max(tc, 1e-12) / max(rb, 1e-12):.2f}x"
        )


#: the cold start's phases in order, with the words the report uses
COLD_START_PHASES = {
    "imports": "imports",
    "inputs": "reading and checking the steps",
    "model": "building the model beside choosing the FlexAttention backend",
    "step": "making the first step",
    "planning": "planning and the baseline's preparation",
    "warmup": "the baseline's untimed warm-up",
}


def cold_start_phases(marks: dict[str, float], to_timed: float | None, warmup: float) -> dict[str, float] | None:
    """Seconds of each cold-start phase (``COLD_START_PHASES``) from the command's marks (seconds
    since it started: ``imports``, ``inputs_checked``, ``model_built`` (the model made and the
    FlexAttention backend chosen, side by side), ``step_made``) and the baseline's seconds to its
    first timed microbatch and warm-up; None without ``to_timed``.
    "planning" is what lies between the step being made and the baseline's warm-up: the step
    planner (twice with worker processes: once alone, for the check), the baseline's raw-token
    plan and its preparation of its microbatches."""
    if to_timed is None:
        return None
    ends = [
        marks["imports"],
        marks["inputs_checked"],
        marks["model_built"],
        marks["step_made"],
        to_timed - warmup,
    ]
    phases = dict(zip(COLD_START_PHASES, [ends[0], *(b - a for a, b in zip(ends, ends[1:]))], strict=False))
    phases["warmup"] = warmup
    return {k: round(max(v, 0.0), 2) for k, v in phases.items()}


def _variant_words(names: list[str]) -> str:
    """Kernel names with their counts, most frequent first (at most five named)."""
    from collections import Counter

    common = Counter(names).most_common()
    words = ", ".join(f"{n} x{c}" if c > 1 else n for n, c in common[:5])
    return words + (f" and {len(common) - 5} more kernels" if len(common) > 5 else "")


def _phase_words(phases: dict[str, float] | None, beside: dict[str, float]) -> str:
    """The phases in words; the model phase with its two halves (``beside``: "model" and
    "attention_probe" seconds, run side by side)."""
    if phases is None:
        return "n/a"
    halves = f" (the model {beside['model']:.1f} s, the backend {beside['attention_probe']:.1f} s)"
    return ", ".join(f"{COLD_START_PHASES[k]} {v:.1f} s{halves if k == 'model' else ''}" for k, v in phases.items())


def _recompute_words(fields: dict) -> str:
    """The run header's recompute setting: off, on, or on with the kept cores named."""
    if not fields["recompute"]:
        return "off"
    skip, layers = fields["recompute_skip"], fields.get("recompute_layers")
    keep = fields.get("moe_keep_gate_up", 0)
    parts = (
        ([f"{', '.join(skip)} kept"] if skip else [])
        + ([f"first {layers} layers only"] if layers is not None else [])
        + ([f"gate/up output kept in the first {keep} MoE layers"] if keep else [])
    )
    return f"on ({'; '.join(parts)})" if parts else "on"


def _microbatch_words(side) -> str:  # noqa: ANN001 - a harts.experiments.bench_result.BenchSide
    """Spread of the timed microbatches' seconds and rows, and the fixed / per-row cost fit."""
    import numpy as np

    sec, rows = np.asarray(side.microbatch_seconds), np.asarray(side.microbatch_rows)
    if sec.size == 0:
        return "no timed microbatches"
    text = (
        f"{sec.size} microbatches, seconds min / median / max {sec.min():.3f} / {np.median(sec):.3f} / {sec.max():.3f}, "
        f"rows {rows.min():,} / {int(np.median(rows)):,} / {rows.max():,}"
    )
    slow = int(sec.argmax())
    if side.microbatch_pairs:
        text += f"; slowest #{slow}: {rows[slow]:,} rows, {side.microbatch_pairs[slow] / 1e9:.2f} G attention pairs"
    fit = side.microbatch_fit()
    if fit is not None:
        text += f"; fit: {fit['fixed_seconds']:.3f} s + {fit['seconds_per_1k_rows'] * 1e3:.2f} ms per 1k rows"
    return text
