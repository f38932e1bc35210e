"""``harts train``: GRPO training on rollout trees, every microbatch executed compactly.

Single process by default. Several ranks: ``torchrun --nproc-per-node N -m harts.cli train ...``
(gloo on CPU, NCCL on CUDA; ``-m harts.cli`` works from any install, unlike ``$(which harts)``,
which may be a shell shim). ``--dp D --ep E --cp C --tp P`` chooses the mesh (D * E * C * P = N;
default D = N / (E C P), E = C = P = 1): every group of C * P ranks is one replica of the step
plan and splits each of its microbatches' compact rows C * P ways (Ulysses context parallelism
over C, tensor parallelism with sequence parallelism over P, which also splits the projections
by heads), parameters are FSDP2-sharded, and each MoE layer's experts are split E ways
(``harts.parallel``). ``--mode trajectory`` runs the baseline: every
trajectory whole, in microbatches of at most ``--capacity`` raw tokens
(``harts.plan.baselines.trajectory_plan``).

Checkpoints (``harts.parallel.checkpoint``): ``--run-dir DIR --save-every N`` writes a
resumable, sharded checkpoint every N steps (model, optimizer, step, data position, RNG states;
atomically), and one at the end and on interruption; ``--resume DIR`` continues such a run
(same workload, seed and model; any number of ranks) and equals the uninterrupted run; a damaged
checkpoint file is an error naming it and the checkpoint before it, and ``--run-dir DIR --resume
auto`` continues from the newest one that loads, or starts the run when DIR has none
(``harts.commands._resume``). A run directory that exists and is not empty is not written
without ``--overwrite``.

Before the first step, everything that could stop the run later is checked: the output paths
(``--save``, ``--json``: writable, not overwriting without ``--overwrite``), the device, every
step's batch (read once; each trajectory must fit ``--capacity``, and the error names the smallest
capacity that fits every step), and the vocabulary the batches need against the model. Progress
goes to stderr (steps, and microbatches within a step); stdout keeps the step lines and the table.

Interruptions: SIGINT (Ctrl-C) and SIGTERM stop the run after the last *completed* step. On one
process, a step interrupted while its gradients are being computed is discarded: only ``p.grad`` had changed, so
the weights and the optimizer state are those after the previous step. A signal arriving during
the update itself (clipping, optimizer step, expert-bias update; milliseconds) lets that step
finish first. Then the completed steps' table is printed, ``--save`` gets those weights (written
atomically, so a second Ctrl-C cannot leave half a checkpoint), ``--json`` gets the completed
steps' logs with an ``interrupted`` entry, and the exit status is 130 (SIGINT) or 143 (SIGTERM).
With ``--run-dir`` (or ``--resume``) the full resumable checkpoint of that step is written too.
If no step completed, nothing is saved. A second signal aborts at once. With several ranks the
ranks agree at each step's end (a signal only recorded until then), so they stop after the same
step and save together (every rank writes its shards; rank 0 the rest).

Failures: if a step fails before changing the weights (out of memory, a bug), the completed steps
are kept the same way (``--json`` gets a ``failed`` entry) before the error is reported. A step
whose loss or gradient norm is not finite is refused before its update with one line naming it
(exit 2) and nothing is saved (no ``--save``, ``--json`` or checkpoint; the run directory keeps
its earlier ones); ``--lr`` is limited to (0, 1] for that reason (``harts.trainer.checks.check_lr``).
An output that cannot be written on the way (a full disk, a file system gone read-only: a
checkpoint, ``--save``, ``metrics.jsonl``, ``--json``) stops the run with one line naming it and
the system's reason (exit 2); the previous checkpoint stays whole, and nothing half-written is
left under the output's name (``harts.outputs.writing``).

LoRA: ``--lora RANK`` (with ``--lora-alpha``, ``--lora-targets``: ``harts.commands._inputs.
add_lora_arguments``) trains adapters alone over the frozen base, on one process (the flags of
several ranks and FSDP's are refused by name); ``--save`` writes the adapters alone
(``harts.trainer.weights.save_adapter``: PEFT's layout for a transformers ``--model``, harts'
own otherwise), ``--export-hf`` the weights with the adapters merged, and the run directory's
checkpoints the adapters and their optimizer state (``harts.trainer.run``).

This module is argparse -> ``harts.trainer.run.RunConfig`` -> ``run_training``, plus the report
(the table, ``--save`` / ``--export-hf``, ``--json``); the runtime is ``harts.trainer.run``.
"""

from __future__ import annotations

import argparse
import functools
from typing import TYPE_CHECKING, Any

from harts.commands._config import add_config_argument
from harts.commands._inputs import (
    add_execution_arguments,
    add_lora_arguments,
    add_model_arguments,
    add_option,
    add_options,
    add_output_arguments,
    add_planner_workers_argument,
    add_workload_arguments,
)
from harts.commands._memory import add_force_argument, train_memory_check
from harts.commands._runs import Interrupted, Signals, check_run_dir

if TYPE_CHECKING:
    from harts.trainer.run import RunConfig, RunResult

#: every user error here is a harts.errors.UserError (see harts.cli)
TYPED_ERRORS = True

HELP = "GRPO training on rollout trees (compact execution; --mode trajectory for the baseline)."


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Every flag is the schema's (``harts.trainer.options.OPTIONS``: its spelling, check, default
    and help), but ``--force``; ``--config FILE`` reads them from a TOML file."""
    add_workload_arguments(p, default="tiny", data=True)
    add_model_arguments(p)
    add_options(p, "mode", "capacity", "lr", "kl_coef")
    add_lora_arguments(p)
    add_execution_arguments(p)
    add_option(p, "logprobs")
    add_options(p, "save", "export_hf", "dp", "ep", "cp", "tp", "moe_stats", "replicas")
    add_options(p, "reduce_every_microbatch", "no_prepare_ahead", "cpu_offload", "meta_init")
    # the run's directory, its checkpoints and the loggers beside its metrics
    add_options(p, "run_dir", "save_every", "resume", "tensorboard", "wandb")
    add_planner_workers_argument(p)
    add_force_argument(p)
    add_output_arguments(p, what="the step logs")
    add_config_argument(p)


def run(args: argparse.Namespace) -> int:
    import signal as signal_mod
    import sys

    from harts.commands._progress import progress
    from harts.commands._resume import check_resumed_run
    from harts.trainer.run import RunHooks, run_training

    signals = Signals()
    signals.install()
    try:
        try:
            with signals.window():
                cfg = config(args)
        except Interrupted as err:
            name = signal_mod.Signals(err.signum).name
            print(f"harts: interrupted by {name} before the first step completed", file=sys.stderr, flush=True)
            return 128 + err.signum
        resume = args.resume

        def check(path: Any, saved: dict[str, Any], identity: dict[str, Any]) -> None:  # noqa: ANN401
            _check_resumed_lora(resume, saved, identity)
            check_resumed_run(resume, path, saved, "train", identity)

        hooks = RunHooks(progress=progress, finish=functools.partial(_finish, args), check_resumed=check)
        hooks.check_memory = train_memory_check(args.force, frozen_base=cfg.lora is not None)
        return run_training(cfg, signals, hooks)
    finally:
        signals.restore()


def config(args: argparse.Namespace) -> RunConfig:
    """The run ``args`` asks for; every flag and output path is checked here, before any work."""
    from harts.commands._inputs import (
        check_output_dir,
        check_output_file,
        lora_config,
        model_spec,
        train_config,
        workload_schedule,
    )
    from harts.commands._resume import refuse_second_run, resolve_resume
    from harts.parallel.mesh import launch_rank
    from harts.trainer.run import RunConfig

    train = train_config(args)  # a bad --recompute-skip fails before any work
    lora = lora_config(args)
    if lora is not None:
        _check_lora(args)
    resolve_resume(args)  # --resume auto: a run to continue, or one to start
    refuse_second_run(args, "train", f" --run-dir {args.run_dir}")
    run_dir = args.resume or args.run_dir
    check_output_dir(args.save, "--save", args.overwrite)
    _check_export_hf(args)
    if launch_rank() == 0:
        check_output_file(args.json_out, "--json", args.overwrite)
    check_run_dir(args)
    _check_loggers(args, run_dir)
    schedule = workload_schedule(args)
    identity = {
        "workload": None if schedule.files else args.workload or "tiny",
        "data": schedule.files,
        "epochs": args.epochs,
        "seed": args.seed,
        "model": args.model,
        "layers": args.layers,
        "pattern": args.pattern,
        "dtype": args.dtype,
        "mode": args.mode,
        "capacity": args.capacity,
        "kl-coef": args.kl_coef,
        "moe-stats": args.moe_stats,
    }
    if lora is not None:  # flag names, so that a resume with other adapters names the flag (seed: --seed)
        identity.update({"lora": lora.rank, "lora-alpha": lora.alpha, "lora-targets": ",".join(lora.targets)})
    return RunConfig(
        model=model_spec(args),
        train=train,
        schedule=schedule,
        dp=args.dp,
        ep=args.ep,
        cp=args.cp,
        tp=args.tp,
        cpu_offload=args.cpu_offload,
        meta_init=args.meta_init,
        lora=lora,
        run_dir=run_dir,
        save_every=args.save_every,
        resume_fallback=getattr(args, "resume_auto", False),
        identity=identity,
        tensorboard=args.tensorboard,
        wandb=args.wandb,
        settings={k: v for k, v in vars(args).items() if not k.startswith("_")},
    )


def _check_lora(args: argparse.Namespace) -> None:
    """``--lora`` runs on one process without FSDP (``harts.parallel`` shards the base model's
    layers, not adapters): a flag or a launch that asks for more is refused by name. ``--save``
    of a transformers ``--model`` writes PEFT's layout through ``peft``, which must import."""
    import importlib.util
    import os

    from harts.errors import UserError
    from harts.integrations.loading import is_checkpoint
    from harts.integrations.native import is_native

    why = "LoRA adapters train on one process (harts.parallel shards the base model's layers, not adapters)"
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world > 1:
        raise UserError(f"--lora under torchrun ({world} ranks): {why}; launch one process")
    for flag in ("dp", "ep", "cp", "tp"):
        value = getattr(args, flag)
        if value is not None and value > 1:
            raise UserError(f"--{flag} {value} with --lora: {why}; drop --{flag}, or drop --lora to train every weight")
    for flag in ("cpu_offload", "reduce_every_microbatch"):
        if getattr(args, flag):
            raise UserError(f"--{flag.replace('_', '-')} with --lora: it is FSDP's, and {why}")
    if args.save and is_checkpoint(args.model) and not is_native(args.model):
        if importlib.util.find_spec("peft") is None:
            raise UserError(
                f"--save {args.save} with --lora of a transformers --model writes PEFT's adapter layout through "
                "the peft package, which does not import here (pip install peft)"
            )


def _check_resumed_lora(resume: str, saved: dict[str, Any], identity: dict[str, Any]) -> None:
    """A run of LoRA adapters resumes with ``--lora``, a run of every weight without it (said in
    one line, before the flags are compared one by one)."""
    from harts.errors import UserError

    had, want = saved.get("lora"), identity.get("lora")
    if (had is None) == (want is None):
        return
    if had is None:
        raise UserError(f"--resume {resume}: the run trained every weight, this command --lora {want}; drop --lora")
    raise UserError(
        f"--resume {resume}: the run trained LoRA adapters (--lora {had}); pass --lora {had} to continue it"
    )


def _check_export_hf(args: argparse.Namespace) -> None:
    """``--export-hf DIR`` is writable and ``--model`` has a transformers class to export to."""
    from harts.commands._inputs import check_output_dir
    from harts.errors import UserError
    from harts.integrations.loading import is_checkpoint
    from harts.integrations.native import is_native

    if not args.export_hf:
        return
    check_output_dir(args.export_hf, "--export-hf", args.overwrite)
    if not is_checkpoint(args.model) or is_native(args.model):
        what = "harts' own weights directory" if is_checkpoint(args.model) else "a preset"
        raise UserError(
            f"--export-hf {args.export_hf}: --model {args.model} is {what}, which has no transformers config to "
            "write; --save writes weights that --model DIR loads"
        )


def _check_loggers(args: argparse.Namespace, run_dir: str | None) -> None:
    """``--tensorboard`` and ``--wandb`` have a run directory and their package."""
    from harts.errors import UserError
    from harts.rl.metrics import tensorboard_available, wandb_available

    for flag, wanted, available, package in (
        ("--tensorboard", args.tensorboard, tensorboard_available, "tensorboard"),
        ("--wandb", args.wandb, wandb_available, "wandb"),
    ):
        if not wanted:
            continue
        if run_dir is None:
            raise UserError(f"{flag} logs beside RUN_DIR/metrics.jsonl: give --run-dir DIR (or --resume DIR)")
        if not available():
            raise UserError(f"{flag}: the {package} package does not import here (pip install {package})")


#: the table's columns: header, and the cell of a step's log
_COLUMNS: tuple[tuple[str, Any], ...] = (
    ("step", lambda l: l.step),
    ("paths", lambda l: l.paths),
    ("raw tok", lambda l: l.raw_tokens),
    ("mbs", lambda l: l.microbatches),
    ("rows", lambda l: l.rank_rows),
    ("calls", lambda l: l.rank_calls),
    ("replay", lambda l: l.rank_replay_rows),
    ("loss", lambda l: f"{l.loss:+.5f}"),
    ("|g|", lambda l: f"{l.grad_norm:.4f}"),
    ("reward", lambda l: "-" if l.reward_mean is None else f"{l.reward_mean:+.3f}"),
    ("reward std", lambda l: "-" if l.reward_std is None else f"{l.reward_std:.3f}"),
    ("adv mean", lambda l: f"{l.adv_mean:+.3f}"),
    ("adv std", lambda l: f"{l.adv_std:.3f}"),
    ("adv!=0", lambda l: f"{l.adv_nonzero:.0%}"),
    ("clip", lambda l: f"{l.clip_frac:.3f}"),
    ("kl-sampler", lambda l: "-" if l.kl_sampler is None else f"{l.kl_sampler:.4f}"),
    ("entropy", lambda l: f"{l.entropy:.3f}"),
    ("plan s", lambda l: f"{l.plan_seconds:.3f}"),
    ("prepare s", lambda l: f"{l.prepare_seconds:.3f}"),
    ("train s", lambda l: f"{l.train_seconds:.3f}"),
)


def _finish(args: argparse.Namespace, result: RunResult) -> None:
    """Table, then the weights, then the JSON (a JSON failure cannot lose the weights). Every rank
    calls this (a sharded model is gathered for ``--save``); rank 0 prints and writes."""
    import sys

    from harts.commands._inputs import write_json
    from harts.commands._table import format_table
    from harts.errors import OutputPathError
    from harts.trainer.weights import export_hf, save_adapter, save_weights

    logs, rank = result.logs, result.rank
    if logs and rank == 0:
        rows = [[cell(l) for _, cell in _COLUMNS] for l in logs]
        print(format_table([name for name, _ in _COLUMNS], rows), flush=True)
    save_error = None
    lora = result.lora is not None
    savers = (
        ("--save", args.save, save_adapter if lora else save_weights),
        ("--export-hf", args.export_hf, _export_merged if lora else export_hf),
    )
    for option, out, save in savers:
        if not out:
            continue
        if result.model is None:
            if rank == 0:
                print(f"nothing saved to {out}: no step completed", file=sys.stderr)
            continue
        try:
            save(result.model, out)
            partial = result.interrupted or result.failed
            if rank == 0:
                print(f"saved to {out}" + (f" (weights after step {logs[-1].step})" if partial else ""))
        except OutputPathError as err:  # its text names the directory (harts.outputs.writing)
            save_error = OutputPathError(f"{option} {err}")
    if args.json_out and rank == 0:
        record: dict[str, Any] = {
            "mode": args.mode,
            "model": args.model,
            "world_size": result.world,
            "logprobs": args.logprobs,
            "steps": [l.to_dict() for l in logs],
        }
        if result.lora is not None:
            record["lora"] = result.lora
        if result.interrupted:
            record["interrupted"] = {"signal": result.interrupted, "completed_steps": len(logs)}
        if result.failed:
            record["failed"] = {**result.failed, "completed_steps": len(logs)}
        write_json(args.json_out, record)
        print(f"wrote {args.json_out}")
    if save_error is not None:
        raise save_error


def _export_merged(model: Any, out: str) -> None:  # noqa: ANN401 - a HybridLM with adapters
    """``--export-hf`` of a LoRA run: the adapters merged into the weights (``merged_model``, as
    ``Engine.save_weights_for_sampler`` does), merged on the host one tensor at a time, so the
    device needs no room for a second copy of the model."""
    from harts.trainer.lora import merged_model
    from harts.trainer.weights import export_hf

    export_hf(merged_model(model, device="cpu"), out)
