"""``harts train``: GRPO training on rollout trees, every microbatch executed compactly.

Single process by default. Several ranks: ``torchrun --nproc-per-node N -m harts.cli train ...``
(gloo on CPU, NCCL on CUDA; ``-m harts.cli`` works from any install, unlike ``$(which harts)``,
which may be a shell shim). ``--dp D --ep E`` chooses the mesh (D * E = N; default D = N, E = 1):
every rank is one replica of the step plan, parameters are FSDP2-sharded, and each MoE layer's
experts are split E ways (``harts.parallel``). ``--mode trajectory`` runs the baseline: every
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
are kept the same way (``--json`` gets a ``failed`` entry) before the error is reported.
"""

from __future__ import annotations

import argparse
import contextlib
import functools

from harts.commands._inputs import (
    add_execution_arguments,
    add_logprobs_argument,
    add_model_arguments,
    add_output_arguments,
    add_planner_workers_argument,
    add_workload_arguments,
    check_recompute_layers,
    nonneg_float,
    positive_float,
    positive_int,
    recompute_fields,
)
from harts.commands._runs import Interrupted, Signals, check_run_dir

#: every user error here is a harts.errors.UserError (see harts.cli)
TYPED_ERRORS = True

HELP = "GRPO training on rollout trees (compact execution; --mode trajectory for the baseline)."

#: batches read by the checks before step 0 are kept for training up to this many tokens in all
#: (above it, preset steps are generated again when they run; a file is read once either way)
KEEP_TOKENS = 20_000_000


#: what a too-long trajectory's error adds (a trajectory is never split: no context parallelism)
CAPACITY_ADVICE = (
    "A larger capacity needs more device memory per rank: if it does not fit, add --recompute, and "
    "spread the model over more ranks (torchrun --nproc-per-node N: FSDP shards parameters, gradients "
    "and optimizer state N ways; --ep E splits the MoE experts; --cpu-offload moves the shards to the "
    "host). One trajectory is not split across ranks (no context parallelism)"
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_workload_arguments(p, default="tiny", data=True)
    add_model_arguments(p)
    p.add_argument(
        "--mode",
        default="compact",
        choices=["compact", "trajectory"],
        help="compact (harts) or trajectory (the baseline: raw-token microbatches)",
    )
    p.add_argument(
        "--capacity",
        type=positive_int,
        default=65_536,
        help="microbatch capacity T (compact tokens; raw tokens with --mode trajectory)",
    )
    p.add_argument("--lr", type=positive_float, default=1e-4, help="AdamW learning rate")
    p.add_argument("--kl-coef", type=nonneg_float, default=0.0, help="KL penalty coefficient (needs ref_logprobs)")
    add_execution_arguments(p)
    add_logprobs_argument(p, default="actions", why="the GRPO loss and the step logs read no other log-prob")
    p.add_argument(
        "--save",
        default=None,
        metavar="DIR",
        help="save the trained weights here, in a directory --model DIR loads (a transformers checkpoint when "
        "--model was one, else harts' own: config.json + model.safetensors); also on Ctrl-C / SIGTERM, after the "
        "last completed step",
    )
    p.add_argument(
        "--export-hf",
        default=None,
        metavar="DIR",
        help="also save the trained weights as a transformers checkpoint (config.json + safetensors) here, "
        "whenever --save would; for a --model that is a transformers checkpoint",
    )
    p.add_argument(
        "--dp", type=positive_int, default=None, help="ranks that hold the same experts (default: ranks / --ep)"
    )
    p.add_argument(
        "--ep", type=positive_int, default=1, help="expert-parallel degree: ranks each MoE layer is split over"
    )
    p.add_argument(
        "--moe-stats",
        default="microbatch",
        choices=["microbatch", "step"],
        help="MoE z/aux-loss statistics: per microbatch (the paper's) or over the whole step "
        "(independent of microbatching and ranks; one extra no-grad forward per microbatch)",
    )
    p.add_argument(
        "--replicas",
        type=positive_int,
        default=None,
        help="replicas of the step plan, a multiple of the ranks (default: the ranks); the same value "
        "keeps the plan, and so the step's MoE objective, when a run resumes on another number of ranks",
    )
    p.add_argument(
        "--reduce-every-microbatch",
        action="store_true",
        help="reduce-scatter FSDP gradients after each microbatch (less memory, more communication) "
        "instead of once per step",
    )
    p.add_argument(
        "--no-prepare-ahead",
        action="store_true",
        help="prepare each microbatch's host inputs in the training thread right before it runs, not on a "
        "background thread while the one before it is launched (the same inputs; for debugging)",
    )
    p.add_argument("--cpu-offload", action="store_true", help="FSDP2 CPU offload of parameters, gradients, optimizer")
    p.add_argument(
        "--meta-init",
        action="store_true",
        help="build the model on the meta device and initialise it after sharding, also on one process "
        "(always so on several ranks: no rank holds the whole model)",
    )
    p.add_argument(
        "--run-dir",
        default=None,
        metavar="DIR",
        help="the run's directory: DIR/metrics.jsonl gets every step's metrics (harts plot DIR draws them), "
        "DIR/checkpoints resumable checkpoints (at the end, on interrupt, and every --save-every steps)",
    )
    p.add_argument("--save-every", type=positive_int, default=None, metavar="N", help="checkpoint every N steps")
    p.add_argument(
        "--resume",
        default=None,
        metavar="RUN_DIR|auto",
        help="continue the run in RUN_DIR from its latest checkpoint (and keep checkpointing there); auto: "
        "continue --run-dir from its newest checkpoint that loads, or start it there when it has none",
    )
    p.add_argument(
        "--tensorboard", action="store_true", help="also log the metrics to RUN_DIR/tensorboard (needs tensorboard)"
    )
    p.add_argument(
        "--wandb",
        default=None,
        metavar="PROJECT",
        help="also log the metrics to this Weights & Biases project (needs wandb and a run directory)",
    )
    add_planner_workers_argument(p)
    add_output_arguments(p, what="the step logs")


def run(args: argparse.Namespace) -> int:
    signals = Signals()
    signals.install()
    try:
        return _run(args, signals)
    finally:
        signals.restore()


def _run(args: argparse.Namespace, signals: Signals) -> int:
    import signal as signal_mod
    import sys
    import time

    import torch
    import torch.distributed as dist
    from tqdm import tqdm

    from harts.commands._inputs import (
        build_model,
        build_model_and_attention,
        check_capacity,
        check_device,
        check_output_dir,
        check_output_file,
        check_plannable,
        needed_vocab,
        planner_workers,
        summarize,
        workload_schedule,
    )
    from harts.commands._progress import progress
    from harts.commands._resume import resolve_resume
    from harts.errors import CapacityError, UserError
    from harts.models.execution.config import ExecutionConfig
    from harts.parallel.build import materialize, moe_experts
    from harts.parallel.mesh import ParallelConfig, init_parallel, setup_process_group
    from harts.parallel.parallelize import parallelize
    from harts.plan.step.workers import shared_workers
    from harts.trainer.step import StepPrefetcher, TrainConfig, train_step

    recompute = recompute_fields(args)  # a bad --recompute-skip fails before any work
    args.device = setup_process_group(args.device)
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    resolve_resume(args)  # --resume auto: a run to continue, or one to start
    run_dir = args.resume or args.run_dir
    logs: list = []
    model = None
    ckpt = _Checkpointer(args, run_dir)
    # True from the moment a step starts changing the weights until it has returned its log
    state = {"in_update": False}

    def on_update() -> None:
        signals.defer()
        state["in_update"] = True

    try:
        # ---------------------------------------------------------- checks before step 0
        with signals.window():
            check_output_dir(args.save, "--save", args.overwrite)
            _check_export_hf(args)
            if rank == 0:
                check_output_file(args.json_out, "--json", args.overwrite)
            check_run_dir(args)
            if args.ep > world or world % args.ep:
                raise UserError(f"--ep {args.ep} does not divide the {world} rank(s) of this launch")
            parallel_cfg = ParallelConfig(dp=args.dp or world // args.ep, ep=args.ep, cpu_offload=args.cpu_offload)
            replicas = args.replicas or world
            if replicas % world:
                raise UserError(f"--replicas {replicas} is not a multiple of the {world} rank(s) of this launch")
            check_device(args.device)
            _check_loggers(args, run_dir)
            schedule = workload_schedule(args)
            ckpt.identity.update(
                workload=None if schedule.files else args.workload or "tiny", data=schedule.files, epochs=args.epochs
            )
            steps = len(schedule.order)
            if rank == 0:
                print(f"data: {schedule.description}", flush=True)
        sources = schedule.sources
        summaries, kept, kept_tokens = [], {}, 0
        with progress(
            len(sources), "checking inputs", "batch", leave=False, disable=rank != 0 or len(sources) < 2
        ) as bar:
            for i, (label, make) in enumerate(sources):
                with signals.window():
                    batch = make()
                    st = summarize(i, label, batch)
                    summaries.append(st)
                    if replicas > 1 and st.longest_len <= args.capacity and st.trajectories >= replicas:
                        check_plannable(batch, st, args.capacity, replicas, (args.mode,))
                    if kept_tokens + batch.num_tokens <= KEEP_TOKENS:
                        kept[i] = batch
                        kept_tokens += batch.num_tokens
                    del batch
                bar.update()
        with signals.window():
            try:
                check_capacity(summaries, args.capacity, replicas)
            except CapacityError as err:
                raise CapacityError(f"{err}. {CAPACITY_ADVICE}") from None
            # the step planner's processes start now, so that spawning them overlaps building the model
            workers = planner_workers(args.planner_workers) if args.mode == "compact" else 0
            shared_workers(workers)
            vocab, where = needed_vocab(summaries)
            meta = distributed or args.meta_init
            execution = ExecutionConfig(
                mode=args.mode,
                **recompute,
                attention=args.attention,
                linear_attention_backend=args.la_backend,
                # chunked log-probs in both modes: the baseline's plain log_softmax would hold
                # [positions, V] logits (tens of GiB per microbatch at a 157 k vocabulary)
                fused_logprobs=True,
                logprob_positions=args.logprobs,
            )
            if meta:
                model = build_model(args, vocab, where=where, meta=True)
            else:  # FlexAttention's backend probe (FA4's compile) runs while the model's values are drawn
                model = build_model_and_attention(args, vocab, execution, where=where).model
            check_recompute_layers(recompute, model)
            parallel = init_parallel(parallel_cfg, args.device, moe_experts(model))
            cfg = TrainConfig(
                capacity=args.capacity,
                execution=execution,
                lr=args.lr,
                kl_coef=args.kl_coef,
                replicas=replicas,
                moe_statistics=args.moe_stats,
                reduce_every_microbatch=args.reduce_every_microbatch,
                planner_workers=workers,
                prepare_ahead=not args.no_prepare_ahead,
            )
            num_parameters = model.num_parameters()
            model = parallelize(model, parallel)
            if meta:
                materialize(model, parallel, spec=args.model, seed=args.seed)
            optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
            start = ckpt.resume(model, optimizer, steps)
        if rank == 0:
            mesh = f"; {world} ranks (dp {parallel_cfg.dp} x ep {parallel_cfg.ep})" if distributed else ""
            print(
                f"model {args.model}: {model.config.layer_pattern} x hidden {model.config.hidden_size}, "
                f"{num_parameters:,} parameters, {args.dtype} on {args.device}; mode {args.mode}; "
                f"log-probs {args.logprobs}{mesh}",
                flush=True,
            )
            if start:
                left = f"; steps {start}..{steps - 1} to go" if start < steps else "; no step left"
                print(f"resumed {run_dir} after step {start - 1}{left}", flush=True)

        # ------------------------------------------------------------------ training
        steps_bar = progress(steps, "train", "step", disable=rank != 0)
        steps_bar.update(start)
        # with several ranks a signal is acted on at a step's end, by all ranks together
        step_window = contextlib.nullcontext if distributed else signals.window

        # a batch read by the checks is kept until its last step (epochs repeat it)
        last_use = {j: i for i, j in enumerate(schedule.order)}

        def load(i: int):  # noqa: ANN202 - runs in the prefetcher's thread
            j = schedule.order[i]
            if j not in kept:
                return sources[j][1]()
            return kept.pop(j) if last_use[j] == i else kept[j]

        metrics = _metrics_writer(args, run_dir, start, rank)

        # the next step is read and planned in a background thread while this one trains
        ahead = StepPrefetcher(cfg, world)
        if start < steps:
            ahead.submit(start, functools.partial(load, start))
        try:
            for i in range(steps):
                if i < start:
                    continue
                mb_bar = progress(None, f"step {i}", "mb", leave=False, position=1, disable=rank != 0)

                def on_progress(done: int, total: int, bar=mb_bar) -> None:  # noqa: ANN001
                    signals.defer()  # not inside tqdm
                    bar.total = total
                    bar.update(done - bar.n)
                    if not distributed:
                        signals.check()

                began = time.perf_counter()
                try:
                    with step_window():
                        planned = ahead.take(i)
                        assert planned is not None
                        if i + 1 < steps:
                            ahead.submit(i + 1, functools.partial(load, i + 1))
                        # on_update closes the window before the weights change
                        log = train_step(
                            model,
                            optimizer,
                            planned.source,
                            cfg,
                            step=i,
                            progress=on_progress,
                            on_update=on_update,
                            parallel=parallel,
                            planned=planned,
                        )
                finally:
                    mb_bar.close()
                logs.append(log)
                state["in_update"] = False
                if metrics is not None:
                    source = sources[schedule.order[i]][0]
                    step_seconds = time.perf_counter() - began
                    metrics.write(
                        {**log.metrics(), "epoch": schedule.epoch(i), "batch": source, "step_seconds": step_seconds}
                    )
                if rank == 0 and log.adv_nonzero == 0 and not state.get("warned_zero_adv"):
                    state["warned_zero_adv"] = True
                    tqdm.write(
                        f"harts: warning: step {i}: every advantage is zero, so the policy loss and its gradient "
                        "are zero and the weights only follow the MoE router losses (does the batch carry "
                        "advantages?); this warning is shown once",
                        file=sys.stderr,
                    )
                if rank == 0:
                    tqdm.write(
                        f"step {i}: loss {log.loss:+.5f}  grad-norm {log.grad_norm:.4f}  "
                        f"{log.microbatches} microbatches  {log.train_seconds:.2f} s  "
                        f"{log.tokens_per_second:,.0f} tok/s/rank",
                        file=sys.stdout,
                    )
                    sys.stdout.flush()
                steps_bar.update()
                if args.save_every and (i + 1) % args.save_every == 0 and i + 1 < steps:
                    ckpt.save(model, optimizer, i + 1)
                if distributed:
                    _agree_on_signal(signals)
            with signals.window():
                pass  # a signal during the last step's update or bookkeeping
        finally:
            ahead.close()
            steps_bar.close()
            if metrics is not None:
                metrics.close()
    except (Interrupted, Exception) as err:
        if isinstance(err, Interrupted):
            signum = err.signum
        elif signals.signum is not None and not isinstance(err, UserError):
            signum = signals.signum  # the interrupt surfaced through torch as another exception
        else:
            if not distributed and logs and not state["in_update"]:
                _save_after_failure(args, model, optimizer, ckpt, logs, world, err)
            raise
        signals.restore()  # a second signal aborts at once
        name = signal_mod.Signals(signum).name
        if rank == 0:
            done = f"after step {logs[-1].step}" if logs else "before the first step completed"
            print(f"harts: interrupted by {name} {done}", file=sys.stderr, flush=True)
        if logs:
            ckpt.save(model, optimizer, logs[-1].step + 1)
        _finish(args, model if logs else None, logs, world, interrupted=name, rank=rank)
        if distributed and dist.is_initialized():
            dist.destroy_process_group()
        return 128 + signum
    if logs:
        ckpt.save(model, optimizer, logs[-1].step + 1)
    _finish(args, model, logs, world, interrupted=None, rank=rank)
    if distributed:
        dist.destroy_process_group()
    return 0


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


def _metrics_writer(args: argparse.Namespace, run_dir: str | None, start: int, rank: int):  # noqa: ANN202
    """Rank 0's ``RUN_DIR/metrics.jsonl`` writer (None without a run directory): a resumed run
    drops the records after its checkpoint's step, a new one starts the file afresh."""
    import os
    import shutil

    from harts.rl.metrics import MetricsWriter, truncate_metrics

    if run_dir is None or rank != 0:
        return None
    truncate_metrics(run_dir, start)
    if start == 0:
        shutil.rmtree(os.path.join(run_dir, "tensorboard"), ignore_errors=True)
    settings = {k: v for k, v in vars(args).items() if not k.startswith("_")}
    return MetricsWriter(run_dir, tensorboard=args.tensorboard, wandb=args.wandb, config=settings)


def _agree_on_signal(signals: Signals) -> None:
    """Several ranks: stop together after this step if any rank has received a signal."""
    import torch
    import torch.distributed as dist

    flag = torch.tensor([signals.signum or 0], dtype=torch.int64)
    if dist.get_backend() == "nccl":
        flag = flag.cuda()
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    signum = int(flag.item())
    if signum:
        signals.signum = signals.signum or signum
        raise Interrupted(signals.signum)


class _Checkpointer:
    """The run directory's resumable checkpoints (``harts.parallel.checkpoint``), for this run's
    workload, seed and model (what a resumed run must match)."""

    def __init__(self, args: argparse.Namespace, run_dir: str | None) -> None:
        self.run_dir = run_dir
        self.auto = getattr(args, "resume_auto", False)
        self.identity = {
            "workload": args.workload,
            "seed": args.seed,
            "model": args.model,
            "layers": args.layers,
            "mode": args.mode,
        }
        self.saved_step = -1

    def resume(self, model, optimizer, num_steps: int) -> int:  # noqa: ANN001
        """Load the latest checkpoint when resuming; returns the first step to run (0 otherwise)."""
        import sys

        import torch.distributed as dist

        from harts.commands._resume import check_resumed_run
        from harts.errors import UserError
        from harts.parallel.checkpoint import latest_checkpoint, load_checkpoint

        if self.run_dir is None or latest_checkpoint(self.run_dir) is None:
            return 0
        run_dir = self.run_dir
        got = load_checkpoint(
            run_dir,
            model=model,
            optimizer=optimizer,
            fallback=self.auto,
            check=lambda saved: check_resumed_run(run_dir, saved.path, saved.extra, "train", self.identity),
        )
        for line in got.skipped if not dist.is_initialized() or dist.get_rank() == 0 else ():
            print(f"harts: warning: {line}", file=sys.stderr, flush=True)
        nxt = int(got.data_state["next_step"])
        if nxt > num_steps:
            raise UserError(f"--resume {self.run_dir}: it completed {nxt} steps, more than the {num_steps} asked for")
        self.saved_step = nxt
        return nxt

    def save(self, model, optimizer, next_step: int) -> None:  # noqa: ANN001
        """Checkpoint after ``next_step`` completed steps (every rank calls this)."""
        import sys

        import torch.distributed as dist

        from harts.parallel.checkpoint import save_checkpoint

        if self.run_dir is None or next_step == self.saved_step:
            return
        path = save_checkpoint(
            self.run_dir,
            step=next_step,
            model=model,
            optimizer=optimizer,
            data_state={"next_step": next_step},
            extra=self.identity,
        )
        self.saved_step = next_step
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"checkpoint {path}", file=sys.stderr, flush=True)


def _save_after_failure(
    args: argparse.Namespace,
    model,  # noqa: ANN001
    optimizer,  # noqa: ANN001
    ckpt: _Checkpointer,
    logs: list,
    world: int,
    err: BaseException,
) -> None:
    """A step failed (out of memory, a bug, ...) before changing the weights: keep the completed
    steps -- checkpoint, table, ``--save``, ``--json`` with a ``failed`` entry -- then the error
    propagates (one process only: with several ranks the others may be stuck in a collective)."""
    import sys

    failed_step = logs[-1].step + 1
    print(
        f"harts: step {failed_step} failed ({type(err).__name__}); keeping the {len(logs)} completed step(s)",
        file=sys.stderr,
        flush=True,
    )
    try:
        ckpt.save(model, optimizer, failed_step)
        _finish(
            args,
            model,
            logs,
            world,
            interrupted=None,
            failed={"step": failed_step, "error": f"{type(err).__name__}: {err}"},
        )
    except Exception as save_err:  # noqa: BLE001 - the original error is the one to report
        print(f"harts: could not keep them either: {save_err}", file=sys.stderr, flush=True)


def _finish(
    args: argparse.Namespace,
    model,
    logs: list,
    world: int,
    *,
    interrupted: str | None,  # noqa: ANN001
    failed: dict | None = None,
    rank: int = 0,
) -> None:
    """Table, then the weights, then the JSON (a JSON failure cannot lose the weights). Every rank
    calls this (a sharded model is gathered for ``--save``); rank 0 prints and writes."""
    import sys

    from harts.commands._inputs import write_json
    from harts.commands._table import format_table
    from harts.errors import OutputPathError
    from harts.trainer.weights import export_hf, save_weights

    if logs and rank == 0:
        rows = [
            [
                l.step,
                l.paths,
                l.raw_tokens,
                l.microbatches,
                l.rank_rows,
                l.rank_calls,
                l.rank_replay_rows,
                f"{l.loss:+.5f}",
                f"{l.grad_norm:.4f}",
                "-" if l.reward_mean is None else f"{l.reward_mean:+.3f}",
                "-" if l.reward_std is None else f"{l.reward_std:.3f}",
                f"{l.adv_mean:+.3f}",
                f"{l.adv_std:.3f}",
                f"{l.adv_nonzero:.0%}",
                f"{l.clip_frac:.3f}",
                f"{l.plan_seconds:.3f}",
                f"{l.prepare_seconds:.3f}",
                f"{l.train_seconds:.3f}",
            ]
            for l in logs
        ]
        print(
            format_table(
                [
                    "step",
                    "paths",
                    "raw tok",
                    "mbs",
                    "rows",
                    "calls",
                    "replay",
                    "loss",
                    "|g|",
                    "reward",
                    "reward std",
                    "adv mean",
                    "adv std",
                    "adv!=0",
                    "clip",
                    "plan s",
                    "prepare s",
                    "train s",
                ],
                rows,
            ),
            flush=True,
        )
    save_error = None
    for option, out, save in (("--save", args.save, save_weights), ("--export-hf", args.export_hf, export_hf)):
        if not out:
            continue
        if model is None:
            if rank == 0:
                print(f"nothing saved to {out}: no step completed", file=sys.stderr)
            continue
        try:
            save(model, out)
            partial = interrupted or failed
            if rank == 0:
                print(f"saved to {out}" + (f" (weights after step {logs[-1].step})" if partial else ""))
        except OSError as err:
            save_error = OutputPathError(f"{option} {out}: cannot write the weights ({err.strerror or err})")
    if args.json_out and rank == 0:
        record = {
            "mode": args.mode,
            "model": args.model,
            "world_size": world,
            "logprobs": args.logprobs,
            "steps": [l.to_dict() for l in logs],
        }
        if interrupted:
            record["interrupted"] = {"signal": interrupted, "completed_steps": len(logs)}
        if failed:
            record["failed"] = {**failed, "completed_steps": len(logs)}
        write_json(args.json_out, record)
        print(f"wrote {args.json_out}")
    if save_error is not None:
        raise save_error
