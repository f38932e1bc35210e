"""One training step: plan it, run every microbatch compactly, one optimizer update.

Per step (one RolloutBatch):

1. ``plan_step(batch, dp=D, capacity=T)`` with D = ``cfg.replicas`` (default: the ranks) —
   every rank builds the same plan (numpy only, deterministic), so no plan is communicated
   (the "trajectory" baseline instead packs raw tokens at T:
   ``harts.plan.baselines.trajectory_plan``, as a trajectory-wise trainer must);
2. each rank executes its replicas' microbatches in slot order (rank r of W: replicas r, r + W,
   ...), microbatch k + 1 prepared on a host thread while k is launched
   (``harts.plan.prefetch.Prefetched``; ``cfg.prepare_ahead``): the plan hands out its slice of the step's compaction with its call plan
   (``StepPlan.prepare_microbatch``; nothing is compacted twice), ``model.prepare_compact``
   adds the layout and the LM head's index plan, forward under
   ``cfg.execution`` (mode "compact" or the "trajectory" baseline),
   GRPO loss normalized by the *whole step's* denominator, MoE router objective weighted by
   the microbatch's share of the step's semantic tokens (or, with ``moe_statistics="step"``,
   normalized by the whole step's router statistics), backward (gradients accumulate);
3. gradients are reduced once per step: FSDP2 reduce-scatters (sums) them in the last
   microbatch's backward, expert blocks are summed over their ``dp`` replicas
   (``harts.parallel``), and the loss and q-weighted expert counts are summed across ranks;
   because every microbatch loss is already divided by the global denominator, the sum is
   exactly the gradient of the step's loss — identical for any D and any microbatching;
4. gradient clipping (over the shards), optimizer step, expert-bias update from the summed counts.
   A step whose loss or gradient norm is not finite stops there (``DivergenceError`` naming the
   step), before the optimizer step: the weights and AdamW's state stay those before it. The
   loss is checked once it is on the host anyway (step 3's one sync) and the norm where
   clipping computes it, so the check adds no device sync.

Parallelism is torch's own engine, applied from outside: ``harts.parallel.init_parallel`` builds
the (dp, ep, cp) mesh and ``parallelize`` shards the model (FSDP2, expert and context
parallelism); pass the ``ParallelState`` as ``parallel=``. Without it the loop runs on one
process. ``cfg.replicas`` makes one process execute a D-replica plan (every replica's
microbatches in sequence): the same microbatches, hence the same step objective, as D ranks
(or D context-parallel groups).
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist

from harts.errors import DivergenceError, UserError
from harts.models.execution.config import ExecutionConfig
from harts.models.hybrid_lm import HybridLM
from harts.models.layers.moe import MoE
from harts.parallel.mesh import ParallelConfig, ParallelState
from harts.parallel.parallelize import clip_grad_norm, finish_gradients, set_gradient_sync
from harts.plan.baselines.trajectory_plan import TrajectoryPlan, plan_trajectory_step
from harts.plan.calls import CallPlan
from harts.plan.prefetch import Prefetched
from harts.plan.step import StepPlan, plan_step
from harts.plan.step.workers import shared_workers
from harts.rl.grpo import grpo_loss, grpo_normalizer
from harts.trainer.checks import check_lr, check_weight_decay
from harts.trainer.step_sums import StepSums
from harts.tree.batch import RolloutBatch
from harts.tree.compact import CompactBatch

__all__ = [
    "Objective",
    "PlannedStep",
    "StepObserver",
    "StepPrefetcher",
    "TrainConfig",
    "StepLog",
    "MicrobatchItem",
    "accumulate_step_gradients",
    "forward_step",
    "microbatch_inputs",
    "microbatch_item",
    "prepared_microbatches",
    "check_capacity",
    "grpo_objective",
    "not_finite",
    "plan_training_step",
    "parallel_state",
    "replicas_of",
    "train_step",
]


@dataclass(kw_only=True)
class TrainConfig:
    """Optimisation and execution settings of ``train``."""

    #: microbatch capacity T in compact tokens (harts' planner; raw tokens for the trajectory
    #: baseline, which holds every token); trajectories longer than T are an error
    capacity: int = 65_536
    #: how every microbatch executes: mode "compact" (harts) or "trajectory" (the baseline, its
    #: microbatches packed from raw tokens), attention, recompute, linear-attention backend;
    #: by default log-probs at action tokens only (``logprob_positions="actions"``): the loss and
    #: every diagnostic of ``StepLog`` read nothing else, and the LM head is a step's largest cost
    #: (an ``ExecutionConfig`` given here keeps its own setting, ``"all"`` unless it says otherwise)
    execution: ExecutionConfig = field(default_factory=lambda: ExecutionConfig(logprob_positions="actions"))
    #: AdamW's learning rate, in [0, 1] (``harts.trainer.checks.check_lr``: above 1 a run diverges)
    lr: float = 1e-4
    #: AdamW's decoupled weight decay: finite, >= 0, and lr * weight_decay <= 1
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    clip_eps: float = 0.2
    kl_coef: float = 0.0
    reduction: str = "token_mean"
    #: aux-loss-free expert-bias update rate (0 disables)
    expert_bias_rate: float = 1e-3
    #: train on-policy: the ratio against the detached log-probs and no reference KL (synthetic
    #: workloads carry random old / ref log-probs); the batch's old log-probs, the sampler's, feed
    #: the KL-to-sampler diagnostic only
    on_policy: bool = True
    #: MoE load-balancing statistics (z / aux loss): "microbatch" (the paper's default: each
    #: microbatch's own router statistics, weighted by its share of the step's tokens; the step's
    #: objective then depends on the microbatching) or "step" (the whole step's statistics over
    #: all microbatches and ranks, the same for any microbatching and D; costs one extra
    #: no-grad forward per microbatch to count the step's expert assignments first)
    moe_statistics: str = "microbatch"
    #: replicas D of the step plan; None: the number of ranks W. A multiple of W: each rank runs
    #: D / W replicas' microbatches in sequence (one process all of them), so a D-replica plan
    #: -- and the step's MoE objective, which depends on the microbatches -- is the same on any W
    replicas: int | None = None

    #: reduce-scatter the FSDP gradients after every microbatch instead of once per step: more
    #: communication, but no unsharded gradient is kept between microbatches (once per step,
    #: the default, holds every layer's full gradient until the step's last backward)
    reduce_every_microbatch: bool = False

    #: processes that build the step planner's independent candidates in parallel
    #: (``harts.plan.step.workers``, one pool per process kept until exit; the same plan, sooner);
    #: 0 plans in the calling process
    planner_workers: int = 0

    #: prepare each microbatch's host inputs on a background thread while the one before it is
    #: launched (``harts.plan.prefetch``; the same inputs); False prepares each in the training
    #: thread right before it runs
    prepare_ahead: bool = True

    def __post_init__(self) -> None:
        lr = check_lr(self.lr)
        wd = self.weight_decay
        if isinstance(wd, bool) or not isinstance(wd, (int, float)) or not math.isfinite(wd) or wd < 0:
            raise UserError(f"weight_decay must be a finite number >= 0, got {wd!r}")
        check_weight_decay(float(wd), lr)
        if self.moe_statistics not in ("microbatch", "step"):
            raise ValueError(f"moe_statistics must be 'microbatch' or 'step', got {self.moe_statistics!r}")
        if (
            isinstance(self.planner_workers, bool)
            or not isinstance(self.planner_workers, int)
            or self.planner_workers < 0
        ):
            raise ValueError(f"planner_workers must be an integer >= 0, got {self.planner_workers!r}")


@dataclass
class StepLog:
    """What one step did (same on every rank except ``rank_seconds``)."""

    step: int
    paths: int
    raw_tokens: int
    microbatches: int
    #: microbatches this rank executed, their rows (physical rows in compact mode), calls, replay rows
    rank_microbatches: int
    rank_rows: int
    rank_calls: int
    rank_replay_rows: int
    loss: float
    moe_objective: float
    grad_norm: float
    plan_seconds: float
    #: seconds the training thread spent on the microbatches' host preparation: waiting for
    #: the background thread (``TrainConfig.prepare_ahead``), or preparing them itself
    prepare_seconds: float
    train_seconds: float
    #: semantic tokens per second of training time, per rank
    tokens_per_second: float
    #: the policy loss's diagnostics over the step's action tokens: clipped fraction, mean k3 KL
    #: to the reference (0 without kl_coef), action tokens
    clip_frac: float = 0.0
    kl: float = 0.0
    action_tokens: int = 0
    #: mean k3 KL from the sampler's log-probs (the batch's old log-probs; None without them) and
    #: the policy's entropy estimate at the action tokens (``harts.rl.grpo``), before the update
    kl_sampler: float | None = None
    entropy: float = 0.0
    #: the batch's advantages over its action tokens: mean, std, fraction that are non-zero
    adv_mean: float = 0.0
    adv_std: float = 0.0
    adv_nonzero: float = 0.0
    #: the batch's per-trajectory rewards (``RolloutBatch.rewards``): mean and std; None where
    #: the batch carries none
    reward_mean: float | None = None
    reward_std: float | None = None
    #: tokens the step's microbatches computed: their compact rows in compact mode (a prefix two
    #: microbatches share counts in both), raw tokens trajectory-wise
    compact_tokens: int = 0
    #: the optimizer's learning rate of this step (its first parameter group)
    lr: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)

    def metrics(self) -> dict[str, Any]:
        """The step's record of ``metrics.jsonl``: optimisation, tokens and compression, times,
        and the RL diagnostics (reward only where the batch carries rewards)."""
        record: dict[str, Any] = {
            "step": self.step,
            "loss": self.loss,
            "grad_norm": self.grad_norm,
            "lr": self.lr,
            "tokens": self.raw_tokens,
            "compact_tokens": self.compact_tokens,
            "compression": self.raw_tokens / max(self.compact_tokens, 1),
            "trajectories": self.paths,
            "microbatches": self.microbatches,
            "train_seconds": self.train_seconds,
            "plan_seconds": self.plan_seconds,
            "prepare_seconds": self.prepare_seconds,
            "tokens_per_second": self.tokens_per_second,
            "moe_objective": self.moe_objective,
            "kl": self.kl,
            "entropy": self.entropy,
            "clip_frac": self.clip_frac,
            "action_tokens": self.action_tokens,
            "adv_mean": self.adv_mean,
            "adv_std": self.adv_std,
            "adv_nonzero": self.adv_nonzero,
        }
        if self.reward_mean is not None:
            record["reward"] = self.reward_mean
            record["reward_std"] = self.reward_std
        if self.kl_sampler is not None:
            record["kl_sampler"] = self.kl_sampler
        return record


def parallel_state(model: HybridLM, parallel: ParallelState | None) -> ParallelState:
    """``parallel``, or the one-process state (refused under a process group: the model must be
    sharded by ``harts.parallel.parallelize`` and its state passed)."""
    if parallel is not None:
        return parallel
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise ValueError(
            "a process group of several ranks is running: shard the model with harts.parallel.parallelize "
            "and pass its ParallelState as parallel=..."
        )
    return ParallelState(config=ParallelConfig(), rank=0, world_size=1, device=model.embed_tokens.weight.device)


def replicas_of(cfg: TrainConfig, state: ParallelState) -> list[int]:
    """The plan replicas this rank executes: with R data-replica ranks (the ranks W, or W / C
    context-parallel groups, whose C ranks run the same microbatches) and D = ``cfg.replicas``
    (default R; a multiple of R), replica rank r runs replicas r, r + R, ... (one process runs
    all D in sequence)."""
    d = cfg.replicas or state.replicas
    if int(d) != d or d < 1:
        raise ValueError(f"replicas must be a positive integer, got {d!r}")
    if d % state.replicas:
        raise ValueError(
            f"replicas={d} is not a multiple of the {state.replicas} data replicas (every one runs as many replicas)"
        )
    return list(range(state.replica_rank, d, state.replicas))


@dataclass
class _Accumulated:
    loss: float
    moe_objective: float
    expert_counts: torch.Tensor | None
    microbatches: int
    rank_microbatches: int
    rows: int
    calls: int
    replay_rows: int
    plan_seconds: float
    prepare_seconds: float
    #: clip_frac, kl, kl_sampler, entropy, action_tokens summed over microbatches (means weighted
    #: by action tokens)
    diagnostics: dict[str, float] = field(default_factory=dict)
    #: tokens the step's microbatches compute (``StepLog.compact_tokens``), over all replicas
    work_tokens: int = 0


#: a microbatch's loss of its log-probs [S_k - N_k] under its batch, with detached 0-dim sums that
#: add up over microbatches (the same keys every call)
Objective = Callable[[torch.Tensor, RolloutBatch], tuple[torch.Tensor, dict[str, torch.Tensor]]]


#: the step's diagnostics (``StepLog`` field) <- the policy loss's metric each sums
_DIAGNOSTICS = {"clip_frac": "clip_frac", "kl": "kl_mean", "kl_sampler": "kl_sampler", "entropy": "entropy"}


def grpo_objective(batch: RolloutBatch, cfg: TrainConfig) -> Objective:
    """``train``'s objective for a step on ``batch``: GRPO under ``cfg`` normalized by the whole
    step's denominator, with the clip fraction and KL weighted by each microbatch's action tokens
    (so that their sums divided by ``action_tokens`` are the step's means)."""
    kl = cfg.kl_coef if batch.ref_logprobs is not None else 0.0
    normalizer = grpo_normalizer(batch, cfg.reduction)

    def objective(logprobs: torch.Tensor, sub: RolloutBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        pg = grpo_loss(
            logprobs,
            sub,
            clip_eps=cfg.clip_eps,
            kl_coef=kl,
            reduction=cfg.reduction,
            normalizer=normalizer,
            on_policy=cfg.on_policy,
        )
        m = pg.metric_tensors
        acts = m["action_tokens"]
        sums = {name: m[key] * acts for name, key in _DIAGNOSTICS.items()}
        return pg.loss, {**sums, "action_tokens": acts}

    return objective


def check_capacity(batch: RolloutBatch, capacity: int, *, step: int | None = None) -> None:
    """Every trajectory of ``batch`` fits ``capacity``; else ``CapacityError`` naming the longest
    trajectory and the smallest capacity that fits (the rule's owner:
    ``harts.plan.step.step_plan.check_capacity``)."""
    from harts.plan.step.step_plan import check_capacity as check_fits

    check_fits(batch.lengths, capacity, where="" if step is None else f"step {step}: ")


def _set_step_statistics(model: HybridLM, stats: tuple[torch.Tensor, float] | None) -> None:
    """Give every MoE layer its row of the step's counts [L_moe, E] and the step's weight (None clears)."""
    moe = [m for m in model.modules() if isinstance(m, MoE)]
    for i, m in enumerate(moe):
        m.step_statistics = None if stats is None else (stats[0][i], stats[1])


@torch.no_grad()
def _step_expert_counts(model: HybridLM, inputs: Iterable[Any], cfg: TrainConfig, state: ParallelState) -> torch.Tensor:
    """The step's q-weighted expert counts [L_moe, E]: a no-grad forward of this rank's
    microbatches (prepared one at a time as ``inputs`` yields them), summed over ranks (routing depends only on the weights, which the step has
    not changed yet, so the training forwards route the same way)."""
    counts: torch.Tensor | None = None
    for x in inputs:
        c = model(x, cfg.execution).expert_counts
        assert c is not None, "only MoE models count their experts"
        counts = c if counts is None else counts + c
    assert counts is not None
    if state.world_size > 1:
        dist.all_reduce(counts)
    return counts


@dataclass(frozen=True)
class PlannedStep:
    """A step's batch as training runs it, with its plan (``plan_training_step``): step 1 of the
    module docstring, which needs no model and no device, so it can run ahead of training
    (``StepPrefetcher``)."""

    #: the batch given to ``plan_training_step``
    source: RolloutBatch
    #: the batch trained on (``cfg.on_policy``: without reference log-probs)
    batch: RolloutBatch
    plan: StepPlan | TrajectoryPlan
    #: seconds the planning took (wherever it ran)
    plan_seconds: float


def plan_training_step(batch: RolloutBatch, cfg: TrainConfig, world: int = 1) -> PlannedStep:
    """Check ``batch`` against ``cfg.capacity`` and plan it for ``cfg.replicas`` (default
    ``world``) replicas: harts' step plan in compact mode, raw-token packing trajectory-wise.
    Raises ``CapacityError`` naming the longest trajectory."""
    source = batch
    if cfg.on_policy:  # the old log-probs stay for the KL-to-sampler diagnostic (TrainConfig.on_policy)
        batch = replace(batch, ref_logprobs=None)
    check_capacity(batch, cfg.capacity)
    t0 = time.perf_counter()
    # harts plans compact tokens; the trajectory-wise baseline packs raw tokens at the capacity
    plan: StepPlan | TrajectoryPlan = (
        plan_step(batch, dp=cfg.replicas or world, capacity=cfg.capacity, workers=shared_workers(cfg.planner_workers))
        if cfg.execution.mode == "compact"
        else plan_trajectory_step(batch.lengths, dp=cfg.replicas or world, capacity=cfg.capacity)
    )
    return PlannedStep(source=source, batch=batch, plan=plan, plan_seconds=time.perf_counter() - t0)


class StepPrefetcher:
    """Loads and plans the next training step while the current one trains: one background
    thread that loads and plans the submitted steps in submission order.

    Planning a step (``plan_training_step``: capacity check, the step planner, its
    compaction) is numpy on the host and needs neither the model nor the device. Done between
    steps it is time the device stands idle, and a large step's planning is seconds of host work
    (all replicas are planned on every rank).
    ``StepPrefetcher`` runs it, and the loading of the step's batch, in one background thread:

        with StepPrefetcher(cfg, world) as ahead:
            ahead.submit(0, load_step_0)
            for i in range(num_steps):
                planned = ahead.take(i)                 # waits only if planning is still running
                if i + 1 < num_steps:
                    ahead.submit(i + 1, partial(load_step, i + 1))
                train_step(model, opt, planned.source, cfg, planned=planned)

    The thread overlaps training because torch releases the GIL inside its operators (and the
    host waits in them while the device is busy); numpy releases it in its array loops. The plan
    is the one the training thread would have made (planning is deterministic), so the run's
    results do not change. An exception raised while loading or planning step k is raised by
    ``take(k)``, in the training thread, with its traceback.

    Only for batches that do not depend on the weights being trained: rollouts sampled from the
    model between steps must be planned after they are sampled. The host holds one more step
    (its batch and its plan's compaction) than without it.
    """

    def __init__(self, cfg: TrainConfig, world: int = 1) -> None:
        self.cfg, self.world = cfg, world
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="harts-plan")
        self._pending: dict[Any, Future] = {}
        #: seconds ``take`` waited for each key (the planning not hidden behind training)
        self.waited: dict[Any, float] = {}

    def submit(self, key: Any, load: Callable[[], RolloutBatch | None]) -> None:
        """Start loading (``load()``; None: nothing to train) and planning step ``key``."""
        if key in self._pending:
            raise ValueError(f"step {key!r} was already submitted")
        self._pending[key] = self._pool.submit(self._load_and_plan, load)

    def _load_and_plan(self, load: Callable[[], RolloutBatch | None]) -> PlannedStep | None:
        batch = load()
        return None if batch is None else plan_training_step(batch, self.cfg, self.world)

    def take(self, key: Any) -> PlannedStep | None:
        """The planned step ``key`` (None if its loader returned None), waiting for it if needed;
        re-raises what loading or planning raised. KeyError if ``key`` was never submitted."""
        if key not in self._pending:
            raise KeyError(f"step {key!r} was not submitted")
        future = self._pending.pop(key)
        t0 = time.perf_counter()
        try:
            return future.result()
        finally:
            self.waited[key] = time.perf_counter() - t0

    def close(self) -> None:
        """Drop steps not yet started; a plan already running finishes in the background."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._pending.clear()

    def __enter__(self) -> StepPrefetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


#: microbatch k of a planned step: its batch, and in compact mode its slice of the step's
#: compaction and its call plan (None, None trajectory-wise)
MicrobatchItem = tuple[RolloutBatch, "CompactBatch | None", "CallPlan | None"]


def microbatch_item(model: HybridLM, planned: PlannedStep, k: int) -> MicrobatchItem:
    """Microbatch ``k`` of ``planned`` (``MicrobatchItem``): nothing is compacted twice, the
    compact slice comes from the step's own compaction."""
    if isinstance(planned.plan, StepPlan):
        cb, call_plan = planned.plan.prepare_microbatch(k, model.config.chunk_size)
        return cb.batch, cb, call_plan
    return planned.batch.select(planned.plan.microbatches[k]), None, None


def microbatch_inputs(model: HybridLM, item: MicrobatchItem, execution: ExecutionConfig) -> Any:
    """The model's prepared inputs of one ``MicrobatchItem`` (host work only)."""
    sub, cb, call_plan = item
    if cb is None:
        return model.prepare_trajectory(sub, execution)
    return model.prepare_compact(cb, execution, plan=call_plan)


def prepared_microbatches(
    model: HybridLM,
    planned: PlannedStep,
    ks: list[int],
    execution: ExecutionConfig,
    *,
    ahead: bool = True,
    made: list[MicrobatchItem | None] | None = None,
) -> Prefetched[tuple[RolloutBatch, Any]]:
    """``(sub, inputs)`` of microbatches ``ks`` in order, each prepared on a background thread
    while the caller runs the one before (``ahead``); ``made``: items already sliced (or None)."""

    def prepare(k: int, item: MicrobatchItem | None) -> tuple[RolloutBatch, Any]:
        item = item if item is not None else microbatch_item(model, planned, k)
        return item[0], microbatch_inputs(model, item, execution)

    made = made if made is not None else [None] * len(ks)
    return Prefetched([functools.partial(prepare, k, item) for k, item in zip(ks, made)], ahead=ahead)


@torch.no_grad()
def forward_step(
    model: HybridLM,
    planned: PlannedStep,
    cfg: TrainConfig,
    on_logprobs: Callable[[int, torch.Tensor], None],
    *,
    parallel: ParallelState | None = None,
) -> None:
    """A no-grad forward of this rank's microbatches of ``planned``, as
    ``accumulate_step_gradients`` runs them: ``on_logprobs(k, logprobs)`` per microbatch."""
    state = parallel_state(model, parallel)
    mine = [k for r in replicas_of(cfg, state) for k in planned.plan.for_replica(r)]
    for k, (_, inputs) in zip(
        mine, prepared_microbatches(model, planned, mine, cfg.execution, ahead=cfg.prepare_ahead)
    ):
        on_logprobs(k, model(inputs, cfg.execution).logprobs)


class StepObserver(Protocol):
    """What watches ``accumulate_step_gradients`` run its microbatches (a benchmark's timers:
    ``harts.experiments.step_bench``), so that what is timed is the step training runs, not a copy
    of it.

    Both methods are called on the training thread, for each microbatch in the order they run:
    ``microbatch_started`` once its inputs are in hand, right before its forward is launched;
    ``microbatch_ended`` once its backward is launched (the device may still be running it), with
    its forward's ``ModelOutput.info`` (host numbers: rows, calls, replay rows). ``index`` counts
    this call's microbatches from 0. An observer must not synchronize the device (recording a CUDA
    event does not): the step never waits for the device between microbatches, and a sync would
    change what is observed. Without an observer the step makes none of these calls.
    """

    def microbatch_started(self, index: int, sub: RolloutBatch) -> None: ...

    def microbatch_ended(self, index: int, info: Mapping[str, Any]) -> None: ...


def accumulate_step_gradients(
    model: HybridLM,
    batch: RolloutBatch,
    cfg: TrainConfig,
    *,
    progress: Callable[[int, int], None] | None = None,
    parallel: ParallelState | None = None,
    planned: PlannedStep | None = None,
    objective: Objective | None = None,
    on_logprobs: Callable[[int, torch.Tensor], None] | None = None,
    microbatches: Sequence[int] | None = None,
    prepared: Sequence[tuple[RolloutBatch, Any]] | None = None,
    observer: StepObserver | None = None,
) -> _Accumulated:
    """Steps 1-3 of the module docstring: afterwards every ``p.grad`` holds the gradient of
    the whole step's loss (summed over this rank's microbatches and across ranks). Under
    context parallelism every rank of a group has the microbatch's log-probs and computes its
    loss; the gradient sum over the group is that loss's gradient once
    (``harts.parallel.context_parallel``).

    ``objective(logprobs, sub)`` is a microbatch's loss of its log-probs [S_k - N_k] under its
    batch ``sub``, with detached sums that add up over microbatches (``Objective``); default
    GRPO normalized by the whole step's denominator (``grpo_objective``). The loss of the step
    is the sum of the microbatches' losses, so an objective must be additive over trajectories.
    ``on_logprobs(k, logprobs)`` receives every microbatch's detached log-probs (``k`` indexes
    ``plan.microbatches``, whose trajectories are ``sub``'s, in that order).

    ``progress(done, total)`` is called once the step is planned (``done = 0``) and after each of
    this rank's microbatches. Only ``p.grad`` changes here, so interrupting this function leaves
    the weights and the optimizer state as they were (the next ``zero_grad`` discards the rest).
    ``planned``: ``plan_training_step(batch, cfg, world)``, made ahead (else it is made here);
    ValueError if it was made for another batch or replica count.

    ``microbatches``: the ids (into ``plan.microbatches``) of the microbatches to run, in order,
    on one process (default this rank's replicas', ``replicas_of``); a subset accumulates its
    share of the step's gradient (one replica of a D-replica plan, a benchmark's warm-up).
    ``prepared``: their ``(sub, inputs)`` made ahead (``microbatch_item``, ``microbatch_inputs``),
    none prepared inside the step (default: each on a host thread while the one before it runs,
    ``cfg.prepare_ahead``). ``observer``: told as each microbatch starts and ends (``StepObserver``).
    """
    state = parallel_state(model, parallel)
    planned = _checked_plan(batch, cfg, state, planned)
    batch, plan = planned.batch, planned.plan
    if objective is None:
        objective = grpo_objective(batch, cfg)
    mine = _microbatches_to_run(plan, cfg, state, microbatches, prepared)
    if progress is not None:
        progress(0, len(mine))
    # the ranks of a row group (cp x tp) compute the same loss: the group's first reports it
    sums = StepSums(
        state.device, model.config.router_z_loss_coef, model.config.router_aux_loss_coef, reports=state.row_rank == 0
    )
    step_level = cfg.moe_statistics == "step" and any(isinstance(m, MoE) for m in model.modules())
    items: list[MicrobatchItem | None] = [None] * len(mine)
    prepare_seconds = 0.0
    if step_level:
        items, prepare_seconds = _set_step_level_statistics(model, planned, mine, cfg, state, prepared)

    # each microbatch is prepared on a background thread while the one before it is launched (no
    # device sync between them): the training thread waits only for what that does not hide
    ahead = _in_order(model, planned, mine, cfg, items, prepared)
    try:
        for done, (k, (sub, inputs)) in enumerate(zip(mine, ahead), start=1):
            if observer is not None:
                observer.microbatch_started(done - 1, sub)
            out = model(inputs, cfg.execution)
            if on_logprobs is not None:
                on_logprobs(k, out.logprobs.detach())
            # step-level statistics are already the microbatch's share of the step's losses
            share = 1.0 if step_level else sub.num_tokens / batch.num_tokens
            total = sums.add(out, *objective(out.logprobs, sub), router_share=share)
            # FSDP reduces the gradients once, in the step's last backward (or after each one)
            set_gradient_sync(model, cfg.reduce_every_microbatch or done == len(mine))
            total.backward()
            if observer is not None:
                observer.microbatch_ended(done - 1, out.info)
            del out, total  # nothing of this microbatch outlives its backward
            if progress is not None:
                progress(done, len(mine))
    finally:
        prepare_seconds += ahead.waited
        if step_level:
            _set_step_statistics(model, None)
    if state.world_size > 1:
        finish_gradients(model, state)
    loss_sum, moe_sum, diagnostics = sums.reduce(state.world_size)  # the step's one host sync
    return _Accumulated(
        loss=loss_sum,
        moe_objective=moe_sum,
        expert_counts=sums.counts,
        microbatches=len(plan.microbatches),
        rank_microbatches=len(mine),
        rows=sums.rows,
        calls=sums.calls,
        replay_rows=sums.replay_rows,
        plan_seconds=planned.plan_seconds,
        prepare_seconds=prepare_seconds,
        diagnostics=diagnostics,
        work_tokens=int(np.sum(plan.work)),
    )


def _checked_plan(
    batch: RolloutBatch, cfg: TrainConfig, state: ParallelState, planned: PlannedStep | None
) -> PlannedStep:
    """``planned``, checked to be ``batch``'s for this step's replicas, or the plan made now."""
    world = state.replicas
    rows = state.cp * state.tp
    if rows > 1 and cfg.capacity % rows:
        raise UserError(
            f"cp={state.cp} x tp={state.tp} = {rows} does not divide capacity={cfg.capacity} (each rank of a "
            "row group holds capacity / (cp tp) rows)"
        )
    if planned is None:
        return plan_training_step(batch, cfg, world)
    if planned.source is not batch:
        raise ValueError("planned= was made for another batch (plan_training_step(batch, cfg, world) of this one)")
    if planned.plan.dp != (cfg.replicas or world):
        raise ValueError(f"planned= has {planned.plan.dp} replicas; this step runs {cfg.replicas or world}")
    return planned


def _microbatches_to_run(
    plan: StepPlan | TrajectoryPlan,
    cfg: TrainConfig,
    state: ParallelState,
    chosen: Sequence[int] | None,
    prepared: Sequence[tuple[RolloutBatch, Any]] | None,
) -> list[int]:
    """The ids of the microbatches this call runs, in order: ``chosen``, checked, or this rank's
    replicas' in slot order; ValueError if ``prepared`` does not hold as many."""
    if chosen is None:
        replicas = replicas_of(cfg, state)
        # every rank must run as many microbatches (FSDP's last-backward sync, expert all-to-alls)
        assert all(len(plan.for_replica(r)) == plan.num_slots for r in replicas), "a replica's slots are uneven"
        mine = [k for r in replicas for k in plan.for_replica(r)]
    elif state.world_size > 1:
        raise ValueError("microbatches= is for one process; under a process group each rank runs its replicas'")
    else:
        mine = list(chosen)
        bad = [k for k in mine if not 0 <= k < len(plan.microbatches)]
        if bad:
            raise ValueError(f"microbatches= names {bad}, not among the plan's {len(plan.microbatches)} microbatches")
    if prepared is not None and len(prepared) != len(mine):
        raise ValueError(f"prepared= holds {len(prepared)} microbatches; this step runs {len(mine)}")
    return mine


def _in_order(
    model: HybridLM,
    planned: PlannedStep,
    mine: list[int],
    cfg: TrainConfig,
    items: list[MicrobatchItem | None],
    prepared: Sequence[tuple[RolloutBatch, Any]] | None,
) -> Prefetched[tuple[RolloutBatch, Any]]:
    """``(sub, inputs)`` of microbatches ``mine`` in order: ``prepared_microbatches`` (each
    prepared while the one before it runs), or those ``prepared`` before the step, handed out the
    same way (``waited`` is then the host's time taking them: nothing to wait for)."""
    if prepared is None:
        return prepared_microbatches(model, planned, mine, cfg.execution, ahead=cfg.prepare_ahead, made=items)
    return Prefetched([functools.partial(_itself, item) for item in prepared], ahead=False)


def _itself(item: tuple[RolloutBatch, Any]) -> tuple[RolloutBatch, Any]:
    return item


def _set_step_level_statistics(
    model: HybridLM,
    planned: PlannedStep,
    mine: list[int],
    cfg: TrainConfig,
    state: ParallelState,
    prepared: Sequence[tuple[RolloutBatch, Any]] | None = None,
) -> tuple[list[MicrobatchItem | None], float]:
    """``moe_statistics="step"``: count the step's expert assignments (a first, no-grad pass)
    and give them to every MoE layer; returns the microbatches' slices, made once for both
    passes, and the seconds slicing them took (none with ``prepared``: their inputs, made ahead)."""
    began = time.perf_counter()
    items: list[MicrobatchItem | None] = (
        [microbatch_item(model, planned, k) for k in mine] if prepared is None else [None] * len(mine)
    )
    seconds = time.perf_counter() - began
    inputs = (
        (microbatch_inputs(model, it, cfg.execution) for it in items if it is not None)
        if prepared is None
        else (x for _, x in prepared)
    )
    counts = _step_expert_counts(model, inputs, cfg, state)
    _set_step_statistics(model, (counts, float(planned.batch.num_tokens)))
    return items, seconds


def not_finite(values: dict[str, float]) -> str | None:
    """``"<name> is <value>"`` of the first of ``values`` (name -> number) that is not finite,
    None when all are: a step's divergence, in the words of its error."""
    for name, value in values.items():
        if not math.isfinite(value):
            return f"{name} is {value}"
    return None


def _check_finite(optimizer: torch.optim.Optimizer, step: int, values: dict[str, float]) -> None:
    """``DivergenceError`` naming ``step`` if one of ``values`` is not finite, the gradients
    dropped first (the optimizer has not stepped: the weights are those before the step)."""
    what = not_finite(values)
    if what is None:
        return
    optimizer.zero_grad(set_to_none=True)
    raise DivergenceError(
        f"step {step}: {what}; the weights and the optimizer state are left as they were before this step"
    )


def train_step(
    model: HybridLM,
    optimizer: torch.optim.Optimizer,
    batch: RolloutBatch,
    cfg: TrainConfig,
    *,
    step: int = 0,
    progress: Callable[[int, int], None] | None = None,
    on_update: Callable[[], None] | None = None,
    parallel: ParallelState | None = None,
    planned: PlannedStep | None = None,
) -> StepLog:
    """One optimizer update on ``batch`` (see the module docstring); ``planned``: its plan made
    ahead (``plan_training_step``, e.g. by a ``StepPrefetcher``), else it is planned here.

    ``progress(done, total)`` follows this rank's microbatches (see
    ``accumulate_step_gradients``). ``on_update()`` is called when the gradients are complete,
    right before the weights change (clipping, optimizer step, expert-bias update): until then
    the step can be abandoned with the model and optimizer untouched; from then on it should
    run to the end (``harts train`` stops taking interrupts there).

    A loss or gradient norm that is not finite raises ``DivergenceError`` naming ``step``
    before the optimizer step (the weights and the optimizer state stay those before it; the
    loss is checked before ``on_update``, the norm after).
    """
    state = parallel_state(model, parallel)
    world = state.world_size
    optimizer.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    acc = accumulate_step_gradients(model, batch, cfg, progress=progress, parallel=state, planned=planned)
    planned_here = planned is None
    _check_finite(optimizer, step, {"the loss": acc.loss, "the MoE router objective": acc.moe_objective})
    if on_update is not None:
        on_update()
    grad_norm = clip_grad_norm(model, cfg.max_grad_norm, state)
    _check_finite(optimizer, step, {"the gradient norm": grad_norm})
    optimizer.step()
    if acc.expert_counts is not None and cfg.expert_bias_rate:
        model.update_expert_bias(acc.expert_counts, rate=cfg.expert_bias_rate)
    if state.device.type == "cuda":
        torch.cuda.synchronize(state.device)
    # planning is reported apart from the training interval (the paper's F/B/Grad vs Core); a
    # plan made ahead took none of it
    train_seconds = time.perf_counter() - t0 - (acc.plan_seconds if planned_here else 0.0)
    acts = acc.diagnostics.get("action_tokens", 0.0)
    adv = batch.advantages[batch.action_mask]
    return StepLog(
        step=step,
        paths=batch.num_trajectories,
        raw_tokens=batch.num_tokens,
        microbatches=acc.microbatches,
        rank_microbatches=acc.rank_microbatches,
        rank_rows=acc.rows,
        rank_calls=acc.calls,
        rank_replay_rows=acc.replay_rows,
        loss=acc.loss,
        moe_objective=acc.moe_objective,
        grad_norm=float(grad_norm),
        plan_seconds=round(acc.plan_seconds, 4),
        prepare_seconds=round(acc.prepare_seconds, 4),
        train_seconds=round(train_seconds, 4),
        tokens_per_second=round(batch.num_tokens / max(train_seconds, 1e-9) / world, 1),
        clip_frac=acc.diagnostics.get("clip_frac", 0.0) / max(acts, 1.0),
        kl=acc.diagnostics.get("kl", 0.0) / max(acts, 1.0),
        action_tokens=int(acts),
        kl_sampler=None if batch.old_logprobs is None else acc.diagnostics.get("kl_sampler", 0.0) / max(acts, 1.0),
        entropy=acc.diagnostics.get("entropy", 0.0) / max(acts, 1.0),
        adv_mean=float(adv.mean()) if adv.size else 0.0,
        adv_std=float(adv.std()) if adv.size else 0.0,
        adv_nonzero=float(np.count_nonzero(adv) / adv.size) if adv.size else 0.0,
        reward_mean=None if batch.rewards is None else float(batch.rewards.mean()),
        reward_std=None if batch.rewards is None else float(batch.rewards.std()),
        compact_tokens=acc.work_tokens,
        lr=float(optimizer.param_groups[0]["lr"]),
    )
