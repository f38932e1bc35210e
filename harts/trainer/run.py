"""``harts train``'s runtime: a training run over a schedule of batches, from a ``RunConfig``.

``run_training(cfg, signals, hooks)`` does, in order:

1. joins the process group under torchrun (``harts.parallel.mesh``) and checks the mesh
   (``ep`` divides the ranks, ``replicas`` is a multiple of them) and the device;
2. reads every batch of the schedule once and checks it (``harts.trainer.checks``: each
   trajectory fits the capacity, every replica gets microbatches, the vocabulary the batches
   need); batches up to ``keep_tokens`` tokens are kept for training;
3. builds the model (``harts.trainer.build``; on the meta device and materialized after
   sharding with several ranks or ``meta_init``), shards it (FSDP2, expert parallelism), makes
   the optimizer and resumes from the run directory's newest checkpoint
   (``harts.trainer.checkpoints``);
4. trains step after step (``harts.trainer.step``), the next step read and planned on a
   background thread, with ``RUN_DIR/metrics.jsonl`` written every step and a checkpoint every
   ``save_every`` steps, and at the end;
5. ``hooks.finish(result)``: the command's table, weights and JSON.

Stopping: SIGINT / SIGTERM (``harts.trainer.signals``) stop the run after the last completed
step; a step interrupted while its gradients are computed is discarded (only ``p.grad`` had
changed), one interrupted in its update finishes first. With several ranks the ranks agree at
each step's end, so they stop after the same step. The completed steps are checkpointed and
finished (``result.interrupted``), and the exit status is 128 + the signal's number. A step that
fails before changing the weights (one process) keeps the completed steps the same way
(``result.failed``) before its error propagates.

Divergence: a step whose loss or gradient norm is not finite stops the run with a
``DivergenceError`` naming it (``harts.trainer.step``), before its update, and nothing is
saved -- no checkpoint, no ``--save``: the steps before it led there (a learning rate too high,
huge advantages), so their weights are not worth keeping either. The run directory keeps the
checkpoints written before, to resume from with another ``--lr``.

LoRA (``RunConfig.lora``, one process): once the model holds its values, ``apply_lora`` freezes
every base weight in the model's dtype and adds the adapters (``harts.trainer.lora``); AdamW gets
the adapters alone, the MoE expert-bias balancing is off (it writes a base buffer), and the
checkpoints hold the adapters and their optimizer state, not the base (``adapter_module``): a
resumed run builds the base again from its model and seed, which the run's identity pins (the
model configuration's digest among them), and goes on bit for bit. ``harts.parallel`` shards the
base's layers, not adapters: several ranks are refused.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal as signal_mod
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm

from harts.errors import CapacityError, DivergenceError, OutputPathError, UserError
from harts.models.hybrid_lm import HybridLM
from harts.parallel.agree import agree
from harts.parallel.build import materialize, moe_experts
from harts.parallel.mesh import ParallelConfig, ParallelState, init_parallel, launch_mesh, setup_process_group
from harts.parallel.parallelize import parallelize
from harts.plan.step.workers import shared_workers
from harts.rl.grpo import FLAT_LOSS_NOTE
from harts.rl.metrics import MetricsWriter, truncate_metrics
from harts.trainer.build import ModelSpec, build_model, build_model_and_attention, check_device
from harts.trainer.checkpoints import RunCheckpoints
from harts.trainer.checks import (
    StepSummary,
    batch_vocab,
    check_capacity,
    check_plannable,
    check_recompute_layers,
    max_compression,
    summarize,
)
from harts.trainer.lora import LoraConfig, adapter_module, apply_lora
from harts.trainer.signals import Interrupted, Signals
from harts.trainer.step import StepLog, StepPrefetcher, TrainConfig, train_step
from harts.tree.batch import RolloutBatch
from harts.tree.dataset import Schedule

__all__ = [
    "CAPACITY_ADVICE",
    "KEEP_TOKENS",
    "RunConfig",
    "RunHooks",
    "RunResult",
    "run_settings",
    "run_training",
    "step_line",
]

#: batches read by the checks before step 0 are kept for training up to this many tokens in all
#: (above it, a step's batch is read again when it runs; a file is read once either way)
KEEP_TOKENS = 20_000_000

#: what a too-long trajectory's error adds (a trajectory is never split: no context parallelism)
CAPACITY_ADVICE = (
    "A larger capacity needs more device memory per rank: if it does not fit, add --recompute, and "
    "spread the model over more ranks (torchrun --nproc-per-node N: FSDP shards parameters, gradients "
    "and optimizer state N ways; --ep E splits the MoE experts; --cpu-offload moves the shards to the "
    "host). One trajectory is not split across ranks (no context parallelism)"
)


@dataclass(kw_only=True)
class RunConfig:
    """Everything a training run needs (``harts train`` makes one from its flags)."""

    #: the model, its device and backends
    model: ModelSpec
    #: the step: capacity, execution, optimisation; ``replicas`` None: the ranks of the launch
    train: TrainConfig
    #: the steps' batches, in order
    schedule: Schedule
    #: mesh: ranks holding the same experts (None: ranks / (ep cp tp)), expert-parallel degree,
    #: context-parallel degree, tensor-parallel degree, offload
    dp: int | None = None
    ep: int = 1
    cp: int = 1
    tp: int = 1
    cpu_offload: bool = False
    #: build on the meta device and initialise after sharding, also on one process
    meta_init: bool = False
    #: train LoRA adapters over the frozen base (one process; module docstring); None: every weight
    lora: LoraConfig | None = None
    #: checkpoints and ``metrics.jsonl`` go here (None: neither)
    run_dir: str | None = None
    #: checkpoint every N steps (besides at the end and on a stop)
    save_every: int | None = None
    #: resume from the newest checkpoint that loads, passing over damaged newer ones
    resume_fallback: bool = False
    #: what a resumed run must match (flag name -> value), saved with every checkpoint;
    #: ``run_training`` adds the optimizer's settings (``run_settings``) and the plan's replicas
    identity: dict[str, Any] = field(default_factory=dict)
    #: also log the metrics to TensorBoard / this W&B project (``settings`` is W&B's run config)
    tensorboard: bool = False
    wandb: str | None = None
    settings: dict[str, Any] = field(default_factory=dict)
    keep_tokens: int = KEEP_TOKENS


@dataclass
class RunResult:
    """What ``hooks.finish`` reports: the completed steps' logs and the trained model (None
    when no step completed); ``interrupted``: the signal's name; ``failed``: the failed step
    and its error."""

    logs: list[StepLog]
    model: HybridLM | None
    world: int
    rank: int
    interrupted: str | None = None
    failed: dict[str, Any] | None = None
    #: a LoRA run's rank, alpha, targets and trainable (adapter) parameters; None: every weight trained
    lora: dict[str, Any] | None = None


@dataclass
class RunHooks:
    """What the command supplies around the runtime."""

    #: a tqdm-like bar: ``progress(total, desc, unit, leave=, position=, disable=)``
    progress: Callable[..., Any]
    #: the run's report (table, weights, JSON); every rank calls it (a sharded model is gathered)
    finish: Callable[[RunResult], None]
    #: ``check(checkpoint_path, saved_identity, identity)`` raises to refuse a checkpoint to resume
    #: from (``identity``: ``RunConfig.identity`` with what ``run_training`` adds)
    check_resumed: Callable[[Any, dict[str, Any], dict[str, Any]], None] | None = None
    #: ``check(spec, vocab_size, where, train, world, compression)`` raises to refuse a model that
    #: will not fit its device (``harts.commands._memory.train_memory_check``), before the model is
    #: built; ``compression``: the steps' largest semantic / compact positions
    check_memory: Callable[[ModelSpec, int, str, TrainConfig, int, float], None] | None = None


def run_training(cfg: RunConfig, signals: Signals, hooks: RunHooks) -> int:
    """Run ``cfg`` (module docstring); returns the exit status (0, or 128 + a signal's number)."""
    run = _Run(cfg, signals, hooks)
    try:
        run.train()
    except (Interrupted, Exception) as err:
        signum = run.signal_of(err)
        if isinstance(err, DivergenceError):
            raise DivergenceError(
                f"{err} and nothing was saved (the checkpoints of earlier steps stay; a lower --lr?)"
            ) from None
        if signum is None:
            run.keep_after_failure(err)
            raise
        return run.stop(signum)
    run.finish()
    return 0


class _Run:
    """One run's state across its phases (``run_training``)."""

    def __init__(self, cfg: RunConfig, signals: Signals, hooks: RunHooks) -> None:
        self.cfg, self.signals, self.hooks = cfg, signals, hooks
        self.device = setup_process_group(cfg.model.device)
        self.distributed = dist.is_initialized() and dist.get_world_size() > 1
        self.rank = dist.get_rank() if self.distributed else 0
        self.world = dist.get_world_size() if self.distributed else 1
        self.spec = replace(cfg.model, device=self.device)
        # one plan replica per row group (cp x tp ranks)
        self.rows = cfg.cp * cfg.tp
        self.train_cfg = replace(cfg.train, replicas=cfg.train.replicas or max(self.world // self.rows, 1))
        if cfg.lora is not None:  # the expert-bias balancing writes a base buffer: the base stays as it is
            self.train_cfg = replace(self.train_cfg, expert_bias_rate=0.0)
        self.ckpt = RunCheckpoints(
            cfg.run_dir,
            dict(cfg.identity),
            fallback=cfg.resume_fallback,
            check=hooks.check_resumed,
            replicas=self.train_cfg.replicas,
        )
        self.logs: list[StepLog] = []
        self.model: Any = None
        #: what checkpoints hold: the model, or a LoRA run's adapters alone (``adapter_module``)
        self.state: Any = None
        self.lora: dict[str, Any] | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.parallel: ParallelState | None = None
        #: True from the moment a step starts changing the weights until it has returned its log
        self.in_update = False
        self.warned_zero_advantages = False
        self.noted_flat_loss = False
        self.num_parameters = 0

    # ------------------------------------------------------------------ phases
    def train(self) -> None:
        """Steps 1-4 of the module docstring."""
        with self.signals.window():
            parallel_cfg = self._check_mesh()
        if self.rank == 0:
            print(f"data: {self.cfg.schedule.description}", flush=True)
        summaries, kept = self._read_batches()
        with self.signals.window():
            start = self._build(summaries, parallel_cfg)
        self._print_start(parallel_cfg, start)
        self._train_steps(kept, start)

    def _check_mesh(self) -> ParallelConfig:
        cfg, world = self.cfg, self.world
        config = launch_mesh(
            world,
            dp=cfg.dp,
            ep=cfg.ep,
            cp=cfg.cp,
            tp=cfg.tp,
            capacity=cfg.train.capacity,
            cpu_offload=cfg.cpu_offload,
        )
        replicas = self.train_cfg.replicas
        assert replicas is not None
        if cfg.lora is not None and world > 1:
            raise UserError(
                f"--lora on {world} ranks: LoRA adapters train on one process (harts.parallel shards the base "
                "model's layers, not adapters); launch without torchrun"
            )
        if replicas % (world // self.rows):
            raise UserError(
                f"--replicas {replicas} is not a multiple of the {world // self.rows} data replicas of this launch "
                f"({world} rank(s) / (--cp {cfg.cp} x --tp {cfg.tp}))"
            )
        check_device(self.device)
        return config

    def _read_batches(self) -> tuple[list[StepSummary], dict[int, RolloutBatch]]:
        """Every source read and checked once (step 2); the batches kept for training."""
        sources, train = self.cfg.schedule.sources, self.train_cfg
        replicas = train.replicas or 1
        summaries: list[StepSummary] = []
        kept: dict[int, RolloutBatch] = {}
        kept_tokens = 0
        disable = self.rank != 0 or len(sources) < 2
        with self.hooks.progress(len(sources), "checking inputs", "batch", leave=False, disable=disable) as bar:
            for i, (label, make) in enumerate(sources):
                with self.signals.window():
                    batch = make()
                    st = summarize(i, label, batch)
                    summaries.append(st)
                    if replicas > 1 and st.longest_len <= train.capacity and st.trajectories >= replicas:
                        check_plannable(batch, st, train.capacity, replicas, (train.execution.mode,))
                    if kept_tokens + batch.num_tokens <= self.cfg.keep_tokens:
                        kept[i] = batch
                        kept_tokens += batch.num_tokens
                    del batch
                bar.update()
        with self.signals.window():
            try:
                check_capacity(summaries, train.capacity, replicas)
            except CapacityError as err:
                raise CapacityError(f"{err}. {CAPACITY_ADVICE}") from None
        return summaries, kept

    def _build(self, summaries: list[StepSummary], parallel_cfg: ParallelConfig) -> int:
        """Model, shards, optimizer, resumed state (step 3); returns the first step to run."""
        cfg, spec, train = self.cfg, self.spec, self.train_cfg
        # the step planner's processes start now, so that spawning them overlaps building the model
        shared_workers(train.planner_workers)
        meta = self.distributed or cfg.meta_init
        problem: UserError | None = None
        try:  # no collective in here: a refusal (a --model that does not load) stops every rank at once
            vocab, where = batch_vocab(summaries, spec.model, quiet=self.rank != 0)
            if self.hooks.check_memory is not None:
                # a rank of a row group holds capacity / (cp tp) rows between the mixers, and inside
                # them cp tp times the rows for 1 / (cp tp) of the heads: about capacity / (cp tp)
                # rows' activations
                per_rank = replace(train, capacity=max(train.capacity // self.rows, 1))
                self.hooks.check_memory(spec, vocab, where, per_rank, self.world, max_compression(summaries))
            if meta:
                model = build_model(spec, vocab, where=where, meta=True)
            else:  # FlexAttention's backend probe (FA4's compile) runs while the model's values are drawn
                model = build_model_and_attention(spec, vocab, train.execution, where=where).model
        except UserError as err:
            problem = err
        problem = agree(problem)
        if problem is not None:
            raise problem
        execution = train.execution
        check_recompute_layers(
            {"recompute_layers": execution.recompute_layers, "moe_keep_gate_up": execution.moe_keep_gate_up}, model
        )
        self.parallel = init_parallel(parallel_cfg, self.device, moe_experts(model))
        self.num_parameters = model.num_parameters()
        digest = config_digest(model.config)
        model = parallelize(model, self.parallel)
        if meta:
            materialize(model, self.parallel, spec=spec.model, seed=spec.seed)
        self.model = self.state = model
        params = list(model.parameters())
        if cfg.lora is not None:  # after materialize: adapters go on the base's values
            params = apply_lora(model, cfg.lora)
            self.state = adapter_module(model)
            self.lora = {
                "rank": cfg.lora.rank,
                "alpha": cfg.lora.alpha,
                "targets": list(cfg.lora.targets),
                "trainable_parameters": sum(p.numel() for p in params),
            }
        self.optimizer = torch.optim.AdamW(params, lr=train.lr, weight_decay=train.weight_decay)
        self.ckpt.identity.update(run_settings(self.optimizer, train))
        self.ckpt.identity["model-config"] = digest
        start = self.ckpt.resume(self.state, self.optimizer, len(cfg.schedule.order))
        self._apply_lr(self.optimizer, train.lr, start)
        self._note_replicas(start)
        return start

    def _note_replicas(self, start: int) -> None:
        """A resumed run on another number of ranks (without ``--replicas``) plans its steps for
        another number of replicas: the same loss up to rounding, but another microbatching, and
        with ``moe_statistics="microbatch"`` another MoE objective. Allowed (a run may grow onto
        more ranks), and said."""
        had, now = self.ckpt.resumed_replicas, self.train_cfg.replicas
        if had is None or had == now or self.rank != 0:
            return
        print(
            f"--replicas {now} from step {start} on (the checkpoint's run planned {had} replicas; --replicas {had} keeps "
            "its plan and MoE objective on any number of ranks it divides)",
            flush=True,
        )

    def _apply_lr(self, optimizer: torch.optim.Optimizer, lr: float, start: int) -> None:
        """A resumed run takes this command's ``--lr`` from its next step on (the checkpoint's
        optimizer state carries the learning rate it was saved with), and says so."""
        saved = {float(g["lr"]) for g in optimizer.param_groups}
        if saved == {lr}:
            return
        for group in optimizer.param_groups:
            group["lr"] = lr
        if self.rank == 0:
            was = ", ".join(f"{v:g}" for v in sorted(saved))
            print(f"--lr {lr:g} from step {start} on (the checkpoint's run used {was})", flush=True)

    def _print_start(self, parallel_cfg: ParallelConfig, start: int) -> None:
        if self.rank != 0:
            return
        spec, execution, config = self.spec, self.train_cfg.execution, self.model.config
        cp = f" x cp {parallel_cfg.cp}" if parallel_cfg.cp > 1 else ""
        tp = f" x tp {parallel_cfg.tp}" if parallel_cfg.tp > 1 else ""
        mesh = f"; {self.world} ranks (dp {parallel_cfg.dp} x ep {parallel_cfg.ep}{cp}{tp})" if self.distributed else ""
        print(
            f"model {spec.model}: {config.layer_pattern} x hidden {config.hidden_size}, "
            f"{self.num_parameters:,} parameters, {spec.dtype} on {spec.device}; mode {execution.mode}; "
            f"log-probs {execution.logprob_positions}{mesh}",
            flush=True,
        )
        if self.lora is not None:
            lora = self.lora
            print(
                f"LoRA rank {lora['rank']}, alpha {lora['alpha']:g}, targets {','.join(lora['targets'])}: "
                f"{lora['trainable_parameters']:,} trainable parameters (float32 or wider), the base frozen",
                flush=True,
            )
        if start:
            steps = len(self.cfg.schedule.order)
            left = f"; steps {start}..{steps - 1} to go" if start < steps else "; no step left"
            print(f"resumed {self.cfg.run_dir} after step {start - 1}{left}", flush=True)

    # ------------------------------------------------------------------ the steps
    def _train_steps(self, kept: dict[int, RolloutBatch], start: int) -> None:
        """Step 4: every step from ``start``, the next one read and planned ahead."""
        schedule = self.cfg.schedule
        steps = len(schedule.order)
        # a batch read by the checks is kept until its last step (epochs repeat it)
        last_use = {j: i for i, j in enumerate(schedule.order)}

        def load(i: int) -> RolloutBatch:  # runs in the prefetcher's thread
            j = schedule.order[i]
            if j not in kept:
                return schedule.sources[j][1]()
            return kept.pop(j) if last_use[j] == i else kept[j]

        bar = self.hooks.progress(steps, "train", "step", disable=self.rank != 0)
        bar.update(start)
        metrics = self._metrics_writer(start)
        ahead = StepPrefetcher(self.train_cfg, self.world // self.rows)
        if start < steps:
            ahead.submit(start, functools.partial(load, start))
        try:
            for i in range(start, steps):
                began = time.perf_counter()
                log = self._step(i, ahead, functools.partial(load, i + 1) if i + 1 < steps else None)
                self._after_step(log, time.perf_counter() - began, metrics)
                bar.update()
                if self.cfg.save_every and (i + 1) % self.cfg.save_every == 0 and i + 1 < steps:
                    self.ckpt.save(self.state, self._optimizer(), i + 1)
                if self.distributed:
                    _agree_on_signal(self.signals)
            with self.signals.window():
                pass  # a signal during the last step's update or bookkeeping
        finally:
            ahead.close()
            bar.close()
            if metrics is not None:
                metrics.close()

    def _step(self, i: int, ahead: StepPrefetcher, load_next: Callable[[], RolloutBatch] | None) -> StepLog:
        """Step ``i``: interruptible until its gradients are complete (``on_update``)."""
        signals, distributed = self.signals, self.distributed
        mb_bar = self.hooks.progress(None, f"step {i}", "mb", leave=False, position=1, disable=self.rank != 0)

        def on_progress(done: int, total: int) -> None:
            signals.defer()  # not inside tqdm
            mb_bar.total = total
            mb_bar.update(done - mb_bar.n)
            if not distributed:
                signals.check()

        def on_update() -> None:
            signals.defer()
            self.in_update = True

        # with several ranks a signal is acted on at a step's end, by all ranks together
        window = contextlib.nullcontext() if distributed else signals.window()
        try:
            with window:
                planned = ahead.take(i)
                assert planned is not None
                if load_next is not None:
                    ahead.submit(i + 1, load_next)
                # on_update closes the window before the weights change
                log = train_step(
                    self.model,
                    self._optimizer(),
                    planned.source,
                    self.train_cfg,
                    step=i,
                    progress=on_progress,
                    on_update=on_update,
                    parallel=self.parallel,
                    planned=planned,
                )
        finally:
            mb_bar.close()
        self.logs.append(log)
        self.in_update = False
        return log

    def _after_step(self, log: StepLog, step_seconds: float, metrics: MetricsWriter | None) -> None:
        """The step's metrics record, its line on stdout, and a warning for zero advantages."""
        i, schedule = log.step, self.cfg.schedule
        if metrics is not None:
            source = schedule.sources[schedule.order[i]][0]
            metrics.write({**log.metrics(), "epoch": schedule.epoch(i), "batch": source, "step_seconds": step_seconds})
        if self.rank != 0:
            return
        if log.adv_nonzero == 0 and not self.warned_zero_advantages:
            self.warned_zero_advantages = True
            tqdm.write(
                f"harts: warning: step {i}: every advantage is zero, so the policy loss and its gradient "
                "are zero and the weights only follow the MoE router losses (does the batch carry "
                "advantages?); this warning is shown once",
                file=sys.stderr,
            )
        if not self.noted_flat_loss and self.train_cfg.on_policy:
            self.noted_flat_loss = True
            tqdm.write(f"harts: note: {FLAT_LOSS_NOTE}", file=sys.stdout)
        tqdm.write(f"step {i}: {step_line(log)}", file=sys.stdout)
        sys.stdout.flush()

    def _metrics_writer(self, start: int) -> MetricsWriter | None:
        """Rank 0's ``RUN_DIR/metrics.jsonl`` writer (None without a run directory): a resumed run
        drops the records after its checkpoint's step, a new one starts the file afresh."""
        import shutil

        run_dir = self.cfg.run_dir
        if run_dir is None or self.rank != 0:
            return None
        truncate_metrics(run_dir, start)
        if start == 0:
            shutil.rmtree(os.path.join(run_dir, "tensorboard"), ignore_errors=True)
        return MetricsWriter(run_dir, tensorboard=self.cfg.tensorboard, wandb=self.cfg.wandb, config=self.cfg.settings)

    def _optimizer(self) -> torch.optim.Optimizer:
        assert self.optimizer is not None, "the optimizer is made with the model"
        return self.optimizer

    # ------------------------------------------------------------------ endings
    def result(self, **what: Any) -> RunResult:
        model = self.model if self.logs else None
        return RunResult(logs=self.logs, model=model, world=self.world, rank=self.rank, lora=self.lora, **what)

    def finish(self) -> None:
        """The end of a run that completed its steps: last checkpoint, the report."""
        if self.logs:
            self.ckpt.save(self.state, self._optimizer(), self.logs[-1].step + 1)
        self.hooks.finish(self.result())
        if self.distributed:
            dist.destroy_process_group()

    def signal_of(self, err: BaseException) -> int | None:
        """The signal that stopped the run by raising ``err``, or None for a failure."""
        if isinstance(err, Interrupted):
            return err.signum
        if self.signals.signum is not None and not isinstance(err, UserError):
            return self.signals.signum  # the interrupt surfaced through torch as another exception
        return None

    def stop(self, signum: int) -> int:
        """After a signal: checkpoint and report the completed steps; returns the exit status."""
        self.signals.restore()  # a second signal aborts at once
        name = signal_mod.Signals(signum).name
        if self.rank == 0:
            done = f"after step {self.logs[-1].step}" if self.logs else "before the first step completed"
            print(f"harts: interrupted by {name} {done}", file=sys.stderr, flush=True)
        if self.logs:
            self.ckpt.save(self.state, self._optimizer(), self.logs[-1].step + 1)
        self.hooks.finish(self.result(interrupted=name))
        if self.distributed and dist.is_initialized():
            dist.destroy_process_group()
        return 128 + signum

    def keep_after_failure(self, err: BaseException) -> None:
        """A step failed (out of memory, a bug, ...) before changing the weights: keep the
        completed steps (checkpoint, report with a ``failed`` entry); the error propagates after
        (one process only: with several ranks the others may be stuck in a collective). A write
        that failed (a full disk: a checkpoint, ``metrics.jsonl``) is not retried: writing more
        there would fail the same way, and the previous checkpoint is whole to resume from."""
        if self.distributed or not self.logs or self.in_update or isinstance(err, OutputPathError):
            return
        failed_step = self.logs[-1].step + 1
        print(
            f"harts: step {failed_step} failed ({type(err).__name__}); keeping the {len(self.logs)} completed step(s)",
            file=sys.stderr,
            flush=True,
        )
        try:
            self.ckpt.save(self.state, self._optimizer(), failed_step)
            self.hooks.finish(self.result(failed={"step": failed_step, "error": f"{type(err).__name__}: {err}"}))
        except Exception as save_err:  # noqa: BLE001 - the original error is the one to report
            print(f"harts: could not keep them either: {save_err}", file=sys.stderr, flush=True)


def step_line(log: StepLog) -> str:
    """A step's line on stdout: the loss beside what moves while it stays flat (the batch's reward
    where it has rewards, the KL from its sampler log-probs where it has them, the entropy
    estimate, the clip fraction, the gradient norm), then the step's work and speed."""
    reward = f"reward {log.reward_mean:.4f}  " if log.reward_mean is not None else ""
    kl = f"kl-sampler {log.kl_sampler:.4g}  " if log.kl_sampler is not None else ""
    return (
        f"loss {log.loss:+.5f}  grad-norm {log.grad_norm:.4f}  {reward}{kl}entropy {log.entropy:.4f}  "
        f"clip {log.clip_frac:.3f}  {log.microbatches} microbatches  {log.train_seconds:.2f} s  "
        f"{log.tokens_per_second:,.0f} tok/s/rank"
    )


def config_digest(config: Any) -> str:  # noqa: ANN401 - a HybridConfig
    """A short sha256 of the model's whole configuration (``HybridConfig.to_dict``, keys sorted),
    for a run's identity: a checkpoint directory whose config.json changed since the run began
    (same flags, same tensor shapes) is then refused on resume rather than continued."""
    import hashlib
    import json

    text = json.dumps(config.to_dict(), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def run_settings(optimizer: torch.optim.Optimizer, train: TrainConfig) -> dict[str, Any]:
    """The settings no flag of ``harts train`` sets that change what a run computes, for its
    identity (``RunConfig.identity``): the optimizer's (but the learning rate, which may change on
    resume) and the step's gradient clipping and loss. JSON data and tuples, as a checkpoint keeps them."""
    d = optimizer.defaults
    adamw = {k: d[k] for k in ("betas", "eps", "weight_decay", "amsgrad") if k in d}
    if "betas" in adamw:
        adamw["betas"] = tuple(float(b) for b in adamw["betas"])
    return {
        type(optimizer).__name__: adamw,
        "TrainConfig": {
            "max_grad_norm": train.max_grad_norm,
            "clip_eps": train.clip_eps,
            "reduction": train.reduction,
            "expert_bias_rate": train.expert_bias_rate,
            "on_policy": train.on_policy,
        },
    }


def _agree_on_signal(signals: Signals) -> None:
    """Several ranks: stop together after this step if any rank has received a signal."""
    flag = torch.tensor([signals.signum or 0], dtype=torch.int64)
    if dist.get_backend() == "nccl":
        flag = flag.cuda()
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    signum = int(flag.item())
    if signum:
        signals.signum = signals.signum or signum
        raise Interrupted(signals.signum)
