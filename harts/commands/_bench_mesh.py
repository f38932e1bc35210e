"""``harts bench`` on a (dp, ep, cp, tp) mesh: ``torchrun --nproc-per-node N -m harts.cli bench
--ep E --cp C --tp P ...`` (``harts.experiments.mesh_bench``).

The mesh is the one ``harts train`` builds from the same flags (``launch_mesh``): its
data-parallel degree is N / (E C P), each group of C P ranks splits every microbatch's compact
rows (T = ``--capacity`` per group), parameters are FSDP2-sharded and experts split E ways. Both
sides run ``harts train``'s step on that layout with every optimization; figures are the
slowest rank's time, MFU over all N devices, and every rank's peak memory.

On one process ``--dp`` plans replicas without launching any (``harts bench``'s one-device
timing of replica ``--replica``'s share); under torchrun it is the mesh's data-parallel degree,
so a ``--dp`` that disagrees with N / (E C P) is refused, as are the one-device-only flags.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from harts.errors import UserError

#: flags that act on the one-device timing only, and why they have nothing to act on here
ONE_DEVICE_ONLY = (
    ("--replica", "replica", "every replica runs, one per row group"),
    ("--profile", "profile", "the profiler traces one device's microbatch"),
    ("--profile-only", "profile_only", "the profiler traces one device's microbatch"),
    ("--no-core-run", "no_core_run", "each side runs once, as harts train runs it"),
    ("--optimizer", "optimizer", "the AdamW update is inside each side's step already"),
)


def mesh_asked(args: argparse.Namespace, world: int) -> bool:
    """Whether the launch (several ranks) or a flag (a degree above 1) asks for the mesh."""
    return world > 1 or args.ep > 1 or args.cp > 1 or args.tp > 1


def check_mesh_flags(args: argparse.Namespace, world: int) -> Any:  # noqa: ANN401 - a ParallelConfig
    """The mesh ``args`` ask of ``world`` ranks, or a one-line UserError naming both numbers,
    before any batch is read or model built."""
    from harts.parallel.mesh import launch_mesh

    for flag, name, why in ONE_DEVICE_ONLY:
        if getattr(args, name) not in (None, False):
            raise UserError(f"{flag} times one device; on a mesh {why} (drop {flag}, or run without torchrun)")
    if args.repeats != 1:
        raise UserError("--repeats times one device's step; on a mesh each side runs once (drop --repeats)")
    if getattr(args, "lora", None) is not None:
        raise UserError(
            "--lora is timed on one device; on a mesh the adapters would have to be added before sharding "
            "(drop --lora, or run without torchrun and without --ep / --cp / --tp)"
        )
    other = args.ep * args.cp * args.tp
    if args.dp is not None and world % other == 0 and args.dp * other != world:
        raise UserError(
            f"--dp {args.dp}: under torchrun --dp is the mesh's data-parallel degree, {world} ranks / "
            f"(--ep {args.ep} x --cp {args.cp} x --tp {args.tp}) = {world // other}; drop --dp or launch "
            f"--nproc-per-node {args.dp * other}"
        )
    return launch_mesh(world, dp=args.dp, ep=args.ep, cp=args.cp, tp=args.tp, capacity=args.capacity)


def run_mesh(args: argparse.Namespace, world: int, read_steps: Any) -> int:  # noqa: ANN401
    """``harts bench`` on the mesh (module docstring); every rank runs it, rank 0 reports.
    ``read_steps(args, replicas)``: the steps and their summaries, checked."""
    import torch
    import torch.distributed as dist

    from harts.commands._inputs import check_output_file, execution_config, model_spec, recompute_fields
    from harts.experiments.mesh_bench import shard_model
    from harts.models.flops import peak_tflops
    from harts.parallel.mesh import setup_process_group

    config = check_mesh_flags(args, world)
    check_output_file(args.json_out, "--json", args.overwrite)
    recompute = recompute_fields(args)
    sources, summaries = read_steps(args, config.replicas)
    execution = execution_config(args)
    spec = model_spec(args)
    # every check runs on the model's structure before this rank joins the process group: a
    # layout that does not fit costs one line on each rank, never a rendezvous or a model
    model = _checked_structure(args, spec, config, summaries, execution, recompute)
    device = setup_process_group(args.device)
    try:
        state = shard_model(model, config, device, spec=spec.model, seed=spec.seed)
        rank0 = state.rank == 0
        peak = args.peak_tflops or peak_tflops(torch.device(state.device))
        if rank0:
            _print_start(args, model, config, peak)
        results = _bench(args, model, state, sources, execution, peak, rank0)
        if rank0 and args.json_out:
            _write(args, model, config, peak, results)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def _checked_structure(
    args: argparse.Namespace,
    spec: Any,  # noqa: ANN401 - a ModelSpec
    config: Any,  # noqa: ANN401 - a ParallelConfig
    summaries: list,
    execution: Any,  # noqa: ANN401 - an ExecutionConfig
    recompute: dict[str, Any],
) -> Any:  # noqa: ANN401 - a meta-device HybridLM
    """The model's structure on the meta device (every check of ``build_model``, no storage),
    checked against the mesh (heads, conv channels, experts) and the memory of one rank."""
    from dataclasses import replace

    from harts.commands._inputs import batch_vocab
    from harts.commands._memory import check_memory
    from harts.experiments.mesh_bench import check_mesh_model
    from harts.parallel.mesh import launch_rank
    from harts.trainer.build import build_model
    from harts.trainer.checks import check_recompute_layers, max_compression

    # before the process group: the launch's rank says which rank prints the vocabulary's note
    vocab, where = batch_vocab(summaries, spec.model, quiet=launch_rank() != 0)
    model = build_model(spec, vocab, where=where, meta=True)
    check_mesh_model(model, config)
    check_recompute_layers(recompute, model)
    rows = config.cp * config.tp
    # a rank holds capacity / (cp tp) rows' activations and 1 / world of the sharded state
    check_memory(
        spec,
        vocab,
        capacity=max(args.capacity // rows, 1),
        execution=replace(execution, fused_logprobs=True),
        shards=config.world_size,
        force=args.force,
        where=where,
        compression=max_compression(summaries),
    )
    return model


def _print_start(args: argparse.Namespace, model: Any, config: Any, peak: float | None) -> None:  # noqa: ANN401
    cp = f" x cp {config.cp}" if config.cp > 1 else ""
    tp = f" x tp {config.tp}" if config.tp > 1 else ""
    print(
        f"model {args.model}: {model.config.layer_pattern}, hidden {model.config.hidden_size}, "
        f"vocabulary {model.config.vocab_size:,}, "
        f"{model.num_parameters():,} parameters, {args.dtype} on {args.device}; capacity {args.capacity:,} per row "
        f"group; log-probs {args.logprobs}; {config.world_size} ranks (dp {config.dp} x ep {config.ep}{cp}{tp}), "
        f"{config.replicas} replica(s); peak {'n/a' if peak is None else f'{peak:g} TFLOP/s'}",
        flush=True,
    )


def _bench(
    args: argparse.Namespace,
    model: Any,  # noqa: ANN401
    state: Any,  # noqa: ANN401
    sources: list,
    execution: Any,  # noqa: ANN401
    peak: float | None,
    rank0: bool,
) -> list:
    """Every step both ways (``bench_mesh_step``), its lines printed by rank 0 as it ends."""
    from harts.commands._inputs import planner_workers
    from harts.experiments.mesh_bench import bench_mesh_step

    results = []
    for step, (_, make) in enumerate(sources, start=args.first_step):
        began = time.perf_counter()
        r = bench_mesh_step(
            model,
            make(),
            state,
            capacity=args.capacity,
            execution=execution,
            step=step,
            warmup=not args.no_warmup,
            peak_tflops=peak,
            planner_workers=planner_workers(args.planner_workers),
        )
        results.append(r)
        if rank0:
            _print_step(r, time.perf_counter() - began)
    return results


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1%}"


def _gib(peaks: list) -> str:
    return "n/a (no CUDA)" if None in peaks else "[" + ", ".join(f"{p:.2f}" for p in peaks) + "] GiB"


def _print_step(r: Any, wall: float) -> None:  # noqa: ANN401 - a MeshBench
    b, h = r.baseline, r.harts
    print(
        f"step {r.step}: baseline {b.step_seconds:.3f} s, harts {h.step_seconds:.3f} s (slowest rank): "
        f"{r.speedup:.2f}x; MFU {_pct(b.mfu)} / {_pct(h.mfu)}, effective {_pct(b.effective_mfu)} / "
        f"{_pct(h.effective_mfu)}; loss {b.loss:+.6f} / {h.loss:+.6f}; {b.microbatches} / {h.microbatches} "
        f"microbatches ({wall:.1f} s with warm-up)",
        flush=True,
    )
    print(
        f"step {r.step}: peak memory per rank: baseline {_gib(b.peak_gib_per_rank)}, harts {_gib(h.peak_gib_per_rank)}"
    )


def settings_record(args: argparse.Namespace, model: Any, recompute: dict[str, Any]) -> dict[str, Any]:  # noqa: ANN401
    """The settings both ``--json`` records of ``harts bench`` (one device, mesh) open with."""
    return {
        "model": args.model,
        "pattern": model.config.layer_pattern,
        "vocab_size": model.config.vocab_size,
        "device": args.device,
        "dtype": args.dtype,
        "capacity": args.capacity,
        "recompute": args.recompute,
        "recompute_skip": list(recompute["recompute_skip"]),
        "recompute_layers": recompute["recompute_layers"],
        "moe_keep_gate_up": recompute["moe_keep_gate_up"],
        "attention": args.attention,
    }


def _write(args: argparse.Namespace, model: Any, config: Any, peak: float | None, results: list) -> None:  # noqa: ANN401
    from harts.commands._inputs import recompute_fields, write_json
    from harts.models.flops import FlopModel

    write_json(
        args.json_out,
        {
            **settings_record(args, model, recompute_fields(args)),
            "la_backend": args.la_backend,
            "logprobs": args.logprobs,
            "mesh": {
                "world_size": config.world_size,
                "dp": config.dp,
                "ep": config.ep,
                "cp": config.cp,
                "tp": config.tp,
                "replicas": config.replicas,
            },
            "peak_tflops": peak,
            "mfu_formula": FlopModel.from_model(model).formula,
            "steps": [r.to_dict() for r in results],
        },
    )
    print(f"wrote {args.json_out}")
