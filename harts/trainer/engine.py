"""The trainer engine: Tinker's training API over flat trajectories, executed compactly.

    engine = Engine(model)                                   # or Engine.from_spec("tiny" / HF dir)
    out = engine.forward_backward(trajectories, "importance_sampling")
    engine.optim_step(lr=1e-5)
    engine.save_state("ckpt/step1"); engine.save_weights_for_sampler("ckpt/sampler1")

A trajectory is a dict: ``tokens`` (ints, length n) and, optionally, per-target arrays of length
n - 1 (entry t describes the target predicted from ``tokens[:t + 1]``): ``weights``,
``advantages``, ``logprobs`` (the sampler's), ``sequence_ratio_mask`` (gspo) and ``targets``, the
token each log-prob is taken of (default ``tokens[t + 1]``; any token of the vocabulary). Targets
of shape [n - 1, K] score K tokens per position (top-k distillation), with any other field [n - 1]
or [n - 1, K]; their log-probs come back [n - 1, K] (``harts.rl.targets``). The engine finds the prefixes the trajectories share (``harts.tree.compact``),
plans microbatches of at most ``capacity`` compact tokens (``harts.plan.step``), runs each once
through the model, and hands back one log-prob array per trajectory, for ``tokens[1:]``, in the
caller's order. Shared prefixes are computed once; trajectories that share nothing run as they
would trajectory-wise. The losses are Tinker's sums over tokens (``harts.rl.losses``), so the
result does not depend on the microbatching, and the log-probs, the loss and every gradient equal
trajectory-wise execution of the same call (``Engine(model, ExecutionConfig(mode="trajectory"))``
is that baseline, on the same code path).

A callable loss ``fn(logprobs, trajectories) -> loss | (loss, metrics)`` gets one differentiable
float tensor per trajectory (Tinker's ``forward_backward_custom``): the engine runs a forward, takes
d loss / d logprobs from ``fn``, and runs the forward-backward of the linear loss
``sum(grad * logprobs)``, which has the same parameter gradient.

MoE models: the router's z / aux objective is added to the gradient with the whole call's router
statistics (``moe_statistics="step"``, independent of the microbatching), and the expert-bias
balancing update runs at ``optim_step`` from the counts of the calls since the last step (not
with LoRA adapters: the base model stays frozen).

``forward_backward`` accumulates gradients until ``optim_step``; ``save_state`` holds weights,
optimizer and RNG (``harts.trainer.state``), not gradients pending between the two.

No silent divergence: a ``forward_backward`` whose loss is not finite, or an ``optim_step``
whose gradient norm is not finite, raises ``DivergenceError`` (a ``UserError``) naming the step,
and the weights and AdamW's state stay those before it (no update ran); the gradients and expert
counts accumulated since the last ``optim_step`` are dropped, so the engine goes on from there
(a later ``save_state`` saves the weights of before the step). The checks read the loss and the
norm, which are on the host anyway: no device sync is added.

On a (dp, ep, cp, tp) mesh (``Engine.from_spec(..., parallel=ParallelConfig(...))`` under
torchrun, or ``Engine(model, parallel=state)`` for a model ``harts.parallel.parallelize``d for
``state``) every call is SPMD: every rank makes it with the same trajectories. Each row group
(cp x tp ranks) runs its replica's microbatches of the call's plan (which has world / (cp tp)
replicas, so a call needs at least that many trajectories), as ``harts train`` runs a step;
every rank gets the whole call's log-probs in the caller's order, and the same loss and
metrics. ``save_state`` then writes a sharded DCP checkpoint (``harts.parallel.checkpoint``)
that ``load_state`` reads on any layout, one process included; ``save_weights_for_sampler``
gathers the shards and rank 0 writes. LoRA adapters on a mesh are refused (``parallelize``
does not shard them), as is loading a one-process state on a mesh. ``docs/parallel.md``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from harts.errors import CapacityError, DivergenceError, UserError
from harts.models.execution.config import ExecutionConfig
from harts.models.hybrid_lm import HybridLM
from harts.parallel.expert_parallel import expert_parameters
from harts.parallel.mesh import ParallelConfig, ParallelState
from harts.parallel.parallelize import clip_grad_norm, is_parallelized
from harts.parallel.tensor_parallel import tensor_parallel_parameters
from harts.rl.losses import LOSSES, check_loss, tinker_loss
from harts.rl.targets import ColumnFold, expand_columns
from harts.trainer.checks import check_lr, check_weight_decay
from harts.trainer.state import load_optimizer, read_state, restore_rng, write_state
from harts.trainer.step import (
    PlannedStep,
    TrainConfig,
    accumulate_step_gradients,
    forward_step,
    not_finite,
    plan_training_step,
)
from harts.tree.batch import RolloutBatch

__all__ = [
    "COLUMN_FIELDS",
    "CustomLoss",
    "Engine",
    "ForwardBackwardOutput",
    "LOSS_INPUT_FIELDS",
    "OptimStepOutput",
    "TRAJECTORY_FIELDS",
    "trajectories_to_batch",
]

#: the optional per-target fields of a trajectory, and the RolloutBatch field each one fills
TRAJECTORY_FIELDS = {"weights": "loss_weights", "advantages": "advantages", "logprobs": "old_logprobs"}
#: the optional per-target loss inputs of a trajectory (``RolloutBatch.loss_inputs``)
LOSS_INPUT_FIELDS = ("sequence_ratio_mask",)
#: the per-target fields that may have K columns beside 2-D ``targets`` (``harts.rl.targets``)
COLUMN_FIELDS = ("targets", *TRAJECTORY_FIELDS, *LOSS_INPUT_FIELDS)

#: Tinker's forward_backward_custom: per-trajectory log-prob tensors [n_j - 1] and the
#: trajectories -> the loss, or (loss, metrics)
CustomLoss = Callable[
    [list[torch.Tensor], list[Mapping[str, Any]]], "torch.Tensor | tuple[torch.Tensor, dict[str, float]]"
]


@dataclass(frozen=True)
class ForwardBackwardOutput:
    """One ``forward_backward``: log-probs [n_j - 1] per trajectory (caller's order, float64),
    the loss (a sum over target tokens) and metrics (``<name>:sum`` / ``<name>:mean``)."""

    logprobs: list[np.ndarray]
    loss: float
    metrics: dict[str, float]


@dataclass(frozen=True)
class OptimStepOutput:
    """One ``optim_step``: the gradient norm before clipping, the learning rate used, the step count."""

    grad_norm: float
    lr: float
    step: int


def _per_target(values: Any, n: int, j: int, name: str) -> np.ndarray:
    """``values`` as float64, one per predicted token of trajectory ``j``; a one-line
    ``UserError`` naming ``name`` for anything else (numpy would read ``"1.5"`` as a number)."""
    what = f"trajectory {j}: {name} must be a list of numbers, one per predicted token"
    try:
        raw = values if isinstance(values, np.ndarray) else np.asarray(values)
    except (ValueError, TypeError):  # ragged nesting
        raise UserError(f"{what}, got a ragged {type(values).__name__}") from None
    if raw.dtype.kind not in "biuf":
        raise UserError(f"{what}, got {type(values).__name__} {_shown(values)}")
    arr = raw.astype(np.float64)
    if arr.ndim != 1 or arr.size != n - 1:
        got = arr.size if arr.ndim == 1 else f"shape {arr.shape}"
        raise UserError(f"trajectory {j}: {name} has {got} values for {n} tokens (need len(tokens) - 1 = {n - 1})")
    bad = np.flatnonzero(~np.isfinite(arr))
    if bad.size:
        raise UserError(f"trajectory {j}: {name}[{int(bad[0])}] is {arr[bad[0]]} (must be finite)")
    return arr


def _shown(value: Any) -> str:
    """``repr(value)``, cut to 40 characters for an error line."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _tokens(traj: Any, j: int, vocab_size: int) -> np.ndarray:
    if not isinstance(traj, Mapping):
        raise UserError(f"trajectory {j}: expected a dict with 'tokens', got {type(traj).__name__}")
    unknown = sorted(set(traj) - {"tokens", *COLUMN_FIELDS})
    if unknown:
        raise UserError(
            f"trajectory {j}: unknown field {unknown[0]!r}; a trajectory has tokens, {sorted(COLUMN_FIELDS[1:])}"
        )
    if "tokens" not in traj:
        raise UserError(f"trajectory {j}: has no 'tokens'")
    tokens = np.asarray(traj["tokens"])
    if tokens.ndim != 1 or tokens.size == 0:
        raise UserError(f"trajectory {j}: tokens must be a non-empty list of ints, got shape {tokens.shape}")
    if not np.issubdtype(tokens.dtype, np.integer):
        raise UserError(f"trajectory {j}: tokens must be ints, got {tokens.dtype}")
    out = tokens.astype(np.int64, copy=False)
    lo, hi = int(out.min()), int(out.max())
    if lo < 0 or hi >= vocab_size:
        t = int(np.flatnonzero((out < 0) | (out >= vocab_size))[0])
        raise UserError(f"trajectory {j}: token {t} is {int(out[t])}, outside the model's vocabulary [0, {vocab_size})")
    return out


def trajectories_to_batch(
    trajectories: Sequence[Mapping[str, Any]], *, vocab_size: int, require: Sequence[str] = ()
) -> RolloutBatch:
    """The ``RolloutBatch`` of flat ``trajectories`` (module docstring): every target token an
    action, per-target fields at positions 1..n-1 of each trajectory. ``require``: fields every
    trajectory must carry (``UserError`` naming the first that lacks one). A field some
    trajectories lack is 1 there for ``weights`` and 0 for ``advantages``; ``logprobs`` must be on
    all or none."""
    if isinstance(trajectories, (str, bytes)) or not isinstance(trajectories, Sequence) or not trajectories:
        raise UserError("trajectories: expected a non-empty list of dicts with 'tokens'")
    parts = [_tokens(t, j, vocab_size) for j, t in enumerate(trajectories)]
    lengths = np.array([p.size for p in parts], dtype=np.int64)
    offsets = np.zeros(len(parts) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    mask = np.ones(int(offsets[-1]), dtype=bool)
    mask[offsets[:-1]] = False
    fields: dict[str, np.ndarray | None] = {}
    for name, target in TRAJECTORY_FIELDS.items():
        have = [name in t and t[name] is not None for t in trajectories]
        missing = [j for j, h in enumerate(have) if not h]
        if missing and (name in require or (name == "logprobs" and any(have))):
            raise UserError(f"trajectory {missing[0]}: has no {name!r}, which this loss needs on every trajectory")
        if not any(have):
            fields[target] = None
            continue
        flat = np.full(int(offsets[-1]), 1.0 if name == "weights" else 0.0)
        for j, t in enumerate(trajectories):
            if have[j]:
                flat[offsets[j] + 1 : offsets[j + 1]] = _per_target(t[name], int(lengths[j]), j, name)
        fields[target] = flat
    advantages = fields["advantages"]
    inputs = {name: _flat_field(trajectories, name, lengths, offsets) for name in LOSS_INPUT_FIELDS}
    return RolloutBatch(
        tokens=np.concatenate(parts),
        offsets=offsets,
        action_mask=mask,
        advantages=advantages if advantages is not None else np.zeros(int(offsets[-1])),
        old_logprobs=fields["old_logprobs"],
        loss_weights=fields["loss_weights"],
        vocab_size=vocab_size,
        targets=_targets(trajectories, parts, offsets, vocab_size),
        loss_inputs={k: v for k, v in inputs.items() if v is not None} or None,
    )


def _flat_field(
    trajectories: Sequence[Mapping[str, Any]], name: str, lengths: np.ndarray, offsets: np.ndarray
) -> np.ndarray | None:
    """Per-target field ``name`` as a per-token array [S] (0 where a trajectory lacks it), None if
    no trajectory has it."""
    if not any(t.get(name) is not None for t in trajectories):
        return None
    flat = np.zeros(int(offsets[-1]))
    for j, t in enumerate(trajectories):
        if t.get(name) is not None:
            flat[offsets[j] + 1 : offsets[j + 1]] = _per_target(t[name], int(lengths[j]), j, name)
    return flat


def _targets(
    trajectories: Sequence[Mapping[str, Any]], parts: list[np.ndarray], offsets: np.ndarray, vocab_size: int
) -> np.ndarray | None:
    """``RolloutBatch.targets`` [S]: each trajectory's ``targets`` at positions 1..n-1 (its own
    tokens where it has none), None if no trajectory has any. ``UserError`` naming a target
    that is not an integer token id of the vocabulary."""
    if not any(t.get("targets") is not None for t in trajectories):
        return None
    flat = np.concatenate(parts)
    for j, t in enumerate(trajectories):
        if t.get("targets") is None:
            continue
        arr = _per_target(t["targets"], parts[j].size, j, "targets")
        bad = np.flatnonzero((arr != np.round(arr)) | (arr < 0) | (arr >= vocab_size))
        if bad.size:
            raise UserError(
                f"trajectory {j}: targets[{int(bad[0])}] is {arr[bad[0]]}, not a token id of the vocabulary "
                f"[0, {vocab_size})"
            )
        flat[offsets[j] + 1 : offsets[j + 1]] = arr.astype(np.int64)
    return flat


def _split(flat: np.ndarray, batch: RolloutBatch) -> list[np.ndarray]:
    """log-probs [S - N] -> one array [n_j - 1] per trajectory."""
    ends = np.cumsum(batch.lengths - 1)
    return np.split(flat, ends[:-1])


class Engine:
    """One model, its optimizer and its execution settings, behind Tinker's training calls
    (module docstring).

    Args:
        model: the ``HybridLM`` to train (``engine.model``); with LoRA adapters applied
            (``harts.trainer.lora.apply_lora``) only the adapters train and carry optimizer state.
        execution: how microbatches run (default compact, every log-prob computed);
            ``ExecutionConfig(mode="trajectory")`` is the trajectory-wise baseline.
        capacity: microbatch capacity in compact tokens (raw tokens trajectory-wise); a trajectory
            longer than it is a ``CapacityError``.
        lr, betas, eps, weight_decay: AdamW's (Tinker's defaults but the learning rate);
            ``optim_step`` may change them. Each a finite number; ``lr`` in [0, 1] (AdamW moves
            every weight by about ``lr`` per step: larger rates diverge), betas in [0, 1),
            ``eps`` > 0, ``weight_decay`` >= 0 with ``lr * weight_decay`` <= 1.
        grad_clip: gradient-norm clipping at ``optim_step`` (None: no clipping).
        expert_bias_rate: the MoE expert-bias balancing rate (0: off; always off with adapters).
        planner_workers: processes that build the step planner's candidates (0: this process).
        parallel: the mesh ``model`` was parallelized for (``harts.parallel.mesh.init_parallel``,
            ``harts.parallel.parallelize.parallelize``): every call is then SPMD over its ranks
            (module docstring). None: one process (refused while a process group of several
            ranks runs). ``UserError`` for an unsharded model, adapters, or a capacity that the
            cp x tp ranks of a row group cannot split.
    """

    def __init__(
        self,
        model: HybridLM,
        execution: ExecutionConfig | None = None,
        *,
        capacity: int = 65_536,
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-12,
        weight_decay: float = 0.0,
        grad_clip: float | None = None,
        expert_bias_rate: float = 1e-3,
        planner_workers: int = 0,
        parallel: ParallelState | None = None,
    ) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise UserError(f"capacity must be a positive integer, got {capacity!r}")
        self._parallel = _engine_state(model, parallel, capacity)
        self.model = model
        # the fused LM head on both sides: exact, and the baseline gets every optimization harts gets
        execution = ExecutionConfig.of(execution)
        if execution.fused_logprobs is None:
            execution = dataclasses.replace(execution, fused_logprobs=True)
        self.execution = execution
        self.train_config = TrainConfig(
            capacity=capacity,
            execution=self.execution,
            on_policy=False,
            moe_statistics="step",
            expert_bias_rate=expert_bias_rate,
            planner_workers=planner_workers,
        )
        self._adamw = _adamw_settings(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, grad_clip=grad_clip)
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise UserError("the model has no trainable parameters (every requires_grad is False)")
        self.optimizer = torch.optim.AdamW(
            params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=False
        )
        self.step = 0
        self._counts: torch.Tensor | None = None
        #: the frozen base weights are shared with other engines (``over_base``): never written
        self._shared_base = False

    # ------------------------------------------------------------------ building
    @classmethod
    def over_base(cls, base: HybridLM, lora: Any, **engine_options: Any) -> Engine:
        """An engine that trains ``lora`` adapters (a ``LoraConfig``) over ``base``'s weights,
        shared with every other engine made over the same ``base`` (``harts.trainer.lora.
        adapted_view``): N runs hold the base once, and each adds only its adapters, their
        gradients and AdamW state. ``load_state`` then checks a state's base weights against the
        shared ones (a ``UserError`` naming the first that differs) rather than writing them.
        ``engine_options`` go to ``Engine`` (one process: no ``parallel``)."""
        from harts.trainer.lora import LoraConfig, adapted_view

        if not isinstance(lora, LoraConfig):
            raise UserError(f"lora must be a harts.trainer.lora.LoraConfig, got {type(lora).__name__}")
        if engine_options.get("parallel") is not None:
            raise UserError("an engine over a shared base runs on one process: use parallel=None")
        engine = cls(adapted_view(base, lora), **engine_options)
        engine._shared_base = True
        return engine

    @staticmethod
    def load_model(
        spec: str,
        *,
        layers: int | None = None,
        dtype: str | None = None,
        device: str | torch.device = "cpu",
        seed: int = 0,
    ) -> HybridLM:
        """The model ``spec`` names (``from_spec``'s), without adapters or optimizer; loading
        errors as one-line ``UserError``s naming ``spec``."""
        from harts.integrations.loading import load_model

        try:
            return load_model(spec, dtype=dtype, layers=layers, seed=seed, device=device)
        except (ValueError, OSError) as err:
            if isinstance(err, UserError):
                raise
            raise UserError(f"model {spec!r}: {err}") from None

    @classmethod
    def from_spec(
        cls,
        spec: str,
        *,
        layers: int | None = None,
        dtype: str | None = None,
        device: str | torch.device = "cpu",
        lora: Any = None,
        seed: int = 0,
        parallel: ParallelConfig | None = None,
        **engine_options: Any,
    ) -> Engine:
        """An engine over the model ``spec`` names: a preset (``HybridConfig.preset``), a
        transformers checkpoint directory or a harts weights directory (``harts.integrations``).
        ``layers`` keeps the first N layers (presets); ``lora``: a ``LoraConfig`` to train
        adapters only; ``engine_options`` go to ``Engine``.

        ``parallel``: run on the (dp, ep, cp, tp) mesh it describes, over the ranks of this
        torchrun launch (every rank calls this and every later method with the same arguments).
        The process group is joined (gloo on CPU, NCCL on CUDA, where ``device="cuda"`` becomes
        ``cuda:LOCAL_RANK``), the layout is checked against the ranks, the capacity and the model
        (one-line ``UserError``s, before any weight is made), and the model is built on the meta
        device, sharded and given its values per shard as ``harts train`` does
        (``harts.parallel.build.build_parallel_model``): the same values as on one process."""
        if parallel is not None:
            return cls._from_spec_parallel(
                spec, parallel, layers=layers, dtype=dtype, device=device, lora=lora, seed=seed, **engine_options
            )
        model = cls.load_model(spec, layers=layers, dtype=dtype, device=device, seed=seed)
        if lora is not None:
            from harts.trainer.lora import apply_lora

            apply_lora(model, lora)
        return cls(model, **engine_options)

    @classmethod
    def _from_spec_parallel(
        cls,
        spec: str,
        parallel: ParallelConfig,
        *,
        layers: int | None,
        dtype: str | None,
        device: str | torch.device,
        lora: Any,
        seed: int,
        **engine_options: Any,
    ) -> Engine:
        """``from_spec`` on a mesh (its docstring)."""
        from harts.parallel.build import build_parallel_model
        from harts.parallel.mesh import check_layout, setup_process_group

        if not isinstance(parallel, ParallelConfig):
            raise UserError(f"parallel must be a harts.parallel.mesh.ParallelConfig, got {type(parallel).__name__}")
        if lora is not None:
            raise UserError(
                "LoRA adapters cannot be trained on a mesh (harts.parallel shards the base model's layers, "
                "not adapters): use parallel=None"
            )
        where = setup_process_group(str(device))
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        capacity = engine_options.get("capacity", 65_536)
        check_layout(
            world,
            ep=parallel.ep,
            cp=parallel.cp,
            tp=parallel.tp,
            capacity=capacity if isinstance(capacity, int) and capacity > 0 else None,
        )
        try:
            model, state = build_parallel_model(spec, parallel, where, dtype=dtype, layers=layers, seed=seed)
        except (ValueError, OSError) as err:
            if isinstance(err, UserError):
                raise
            raise UserError(f"model {spec!r}: {err}") from None
        return cls(model, parallel=state, **engine_options)

    # ------------------------------------------------------------------ inputs
    def _batch(
        self, trajectories: Sequence[Mapping[str, Any]] | RolloutBatch, require: Sequence[str] = ()
    ) -> RolloutBatch:
        if isinstance(trajectories, RolloutBatch):
            return trajectories
        return trajectories_to_batch(trajectories, vocab_size=self.model.config.vocab_size, require=require)

    def _plan(self, batch: RolloutBatch) -> PlannedStep:
        try:
            return plan_training_step(batch, self.train_config, self._parallel.replicas)
        except CapacityError:
            raise
        except ValueError as err:
            if isinstance(err, UserError):
                raise
            raise UserError(f"trajectories: {err}") from None

    def _collector(
        self, batch: RolloutBatch, planned: PlannedStep
    ) -> tuple[Callable[[int, torch.Tensor], None], Callable[..., np.ndarray]]:
        """(``on_logprobs`` hook, ``result(*extra)``: the step's log-probs [S - N] in batch order,
        then ``extra``, summed over the row groups on a mesh; the same on every rank)."""
        first = batch.offsets[:-1] - np.arange(batch.num_trajectories)
        got: list[tuple[np.ndarray, torch.Tensor]] = []

        def on_logprobs(k: int, lp: torch.Tensor) -> None:
            mb = np.asarray(planned.plan.microbatches[k], dtype=np.int64)
            n = batch.lengths[mb] - 1
            # the entries of the microbatch's trajectories in the whole batch's log-prob order
            start = np.repeat(first[mb] - np.cumsum(np.concatenate([[0], n[:-1]])), n)
            got.append((start + np.arange(int(n.sum())), lp))

        def result(*extra: float) -> np.ndarray:
            if self._parallel.distributed:
                return self._gather(batch.num_logprobs, got, *extra)
            out = np.full(batch.num_logprobs + len(extra), np.nan)
            if got:
                flat = torch.cat([lp for _, lp in got]).to(torch.float64).cpu().numpy()
                out[np.concatenate([idx for idx, _ in got])] = flat
            out[batch.num_logprobs :] = extra
            return out

        return on_logprobs, result

    def _gather(self, size: int, got: list[tuple[np.ndarray, torch.Tensor]], *extra: float) -> np.ndarray:
        """On a mesh: the whole call's log-probs [size] in batch order (then ``extra``, summed over
        the row groups), the same on every rank. Each row group runs its own microbatches, and
        every rank of a group holds all their log-probs; the first rank of each group contributes
        its entries, the others zeros, so one sum over all ranks adds each value to zeros only
        (exact) and leaves every rank with the same array."""
        state = self._parallel
        out = torch.zeros(size + len(extra), dtype=torch.float64, device=state.device)
        if state.row_rank == 0:
            if got:
                idx = torch.as_tensor(np.concatenate([i for i, _ in got]), device=state.device)
                out[idx] = torch.cat([lp.reshape(-1) for _, lp in got]).to(torch.float64)
            if extra:
                out[size:] = torch.tensor(extra, dtype=torch.float64)
        dist.all_reduce(out)
        return out.cpu().numpy()

    # ------------------------------------------------------------------ calls
    def forward(self, trajectories: Sequence[Mapping[str, Any]] | RolloutBatch) -> list[np.ndarray]:
        """Log-probs of each trajectory's targets (``tokens[1:]`` by default; float64 [n_j - 1], or
        [n_j - 1, K] for K-column targets; caller's order), no grad."""
        trajectories, columns = self._columns(trajectories)
        batch = self._batch(trajectories)
        planned = self._plan(batch)
        on_logprobs, result = self._collector(batch, planned)
        forward_step(self.model, planned, self.train_config, on_logprobs, parallel=self._parallel)
        return columns.fold(_split(result(), batch))

    @staticmethod
    def _columns(
        trajectories: Sequence[Mapping[str, Any]] | RolloutBatch,
    ) -> tuple[Sequence[Mapping[str, Any]] | RolloutBatch, ColumnFold]:
        """K-column trajectories as K copies each (``harts.rl.targets``) and the fold back."""
        if isinstance(trajectories, RolloutBatch) or isinstance(trajectories, (str, bytes)):
            return trajectories, ColumnFold(())
        if not isinstance(trajectories, Sequence):
            return trajectories, ColumnFold(())
        return expand_columns(trajectories, COLUMN_FIELDS)

    def forward_backward(
        self,
        trajectories: Sequence[Mapping[str, Any]] | RolloutBatch,
        loss: str | CustomLoss = "cross_entropy",
        loss_config: Mapping[str, Any] | None = None,
    ) -> ForwardBackwardOutput:
        """Loss ``loss`` of ``trajectories`` and its gradients, accumulated into ``.grad`` until
        ``optim_step`` (module docstring). ``loss``: ``cross_entropy``, ``importance_sampling``,
        ``ppo``, ``cispo``, ``gspo``, ``dro`` (``harts.rl.losses``) or a ``CustomLoss``;
        ``loss_config`` the loss's options (``clip_low_threshold`` / ``clip_high_threshold`` for
        ppo, cispo and gspo, ``beta`` for dro). Log-probs come back [n_j - 1] per trajectory, or
        [n_j - 1, K] for K-column targets."""
        if callable(loss):
            if loss_config:
                raise UserError("loss_config applies to the built-in losses, not to a callable loss")
            return self._custom(trajectories, loss)
        trajectories, columns = self._columns(trajectories)
        if not isinstance(loss, str):
            raise UserError(f"loss must be a name or a callable, got {type(loss).__name__}")
        config = check_loss(loss, loss_config)
        need = [name for name, target in TRAJECTORY_FIELDS.items() if target in LOSSES[loss]]
        batch = self._batch(trajectories, require=need)
        for target in LOSSES[loss]:
            if isinstance(trajectories, RolloutBatch) and target != "advantages" and getattr(batch, target) is None:
                raise UserError(f"loss {loss} needs the batch's {target}")

        def objective(lp: torch.Tensor, sub: RolloutBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            return tinker_loss(lp, sub, loss, config)

        out = self._run(batch, objective)
        return dataclasses.replace(out, logprobs=columns.fold(out.logprobs)) if columns.expanded else out

    def _run(
        self,
        batch: RolloutBatch,
        objective: Callable[[torch.Tensor, RolloutBatch], tuple[torch.Tensor, dict[str, torch.Tensor]]],
    ) -> ForwardBackwardOutput:
        planned = self._plan(batch)
        on_logprobs, result = self._collector(batch, planned)
        # the gradients of expert blocks and tensor-parallel shards are summed over their
        # replicas at the end of each call (``finish_gradients``), all of ``.grad``: what earlier
        # calls accumulated is set aside so that it is not summed again
        held = self._hold_summed_gradients()
        acc = accumulate_step_gradients(
            self.model,
            batch,
            self.train_config,
            parallel=self._parallel,
            planned=planned,
            objective=objective,
            on_logprobs=on_logprobs,
        )
        for p, g in held:
            p.grad = g if p.grad is None else p.grad + g
        # acc.loss is on the host already (the call's one sync) and the same on every rank
        self._check_finite({"the loss": acc.loss, "the MoE router objective": acc.moe_objective})
        if acc.expert_counts is not None:
            self._counts = acc.expert_counts if self._counts is None else self._counts + acc.expert_counts
        d = acc.diagnostics
        metrics = {"loss:sum": acc.loss, "target_tokens:sum": d["target_tokens"], "weight:sum": d["weight"]}
        if "ratio" in d and d["weight"] > 0:
            metrics["ratio:mean"] = d["ratio"] / d["weight"]
        if "clipped" in d:
            metrics["clip_fraction:mean"] = d["clipped"] / max(d["target_tokens"], 1.0)
        if acc.expert_counts is not None:
            metrics["moe_objective:sum"] = acc.moe_objective
        metrics["microbatches:sum"] = float(acc.microbatches)
        # the log-probs and the rows of every row group's microbatches (one exchange on a mesh)
        flat = result(float(acc.rows))
        metrics["rows:sum"] = float(flat[-1])
        return ForwardBackwardOutput(logprobs=_split(flat[:-1], batch), loss=acc.loss, metrics=metrics)

    def _check_finite(self, values: dict[str, float]) -> None:
        """``DivergenceError`` naming the step if one of ``values`` is not finite, after dropping
        what the calls since the last ``optim_step`` accumulated (gradients, expert counts): the
        weights and AdamW's state are those before the step, and the engine takes the next call
        as if those calls had not been made."""
        what = not_finite(values)
        if what is None:
            return
        self.optimizer.zero_grad(set_to_none=True)
        self._counts = None
        raise DivergenceError(
            f"step {self.step + 1}: {what}; the weights and the optimizer state are left as they were before this "
            "step and the gradients accumulated since the last optim_step are dropped"
        )

    def _hold_summed_gradients(self) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
        """On a mesh: the expert-block and tensor-parallel gradients accumulated so far, taken
        out of ``.grad`` (None there), to be added back after the call's own sum."""
        if not self._parallel.distributed:
            return []
        held = []
        for p in [*expert_parameters(self.model), *tensor_parallel_parameters(self.model)]:
            if p.grad is not None:
                held.append((p, p.grad))
                p.grad = None
        return held

    def _custom(
        self, trajectories: Sequence[Mapping[str, Any]] | RolloutBatch, fn: CustomLoss
    ) -> ForwardBackwardOutput:
        """Tinker's forward_backward_custom (module docstring)."""
        if isinstance(trajectories, RolloutBatch):
            raise UserError("a callable loss takes trajectories as a list of dicts, not a RolloutBatch")
        given = list(trajectories)
        trajectories, columns = self._columns(trajectories)
        batch = self._batch(trajectories)
        dtype = torch.float64 if self.model.config.dtype == "float64" else torch.float32
        lps = [torch.tensor(a, dtype=dtype, requires_grad=True) for a in columns.fold(self.forward(batch))]
        out = fn(lps, given)
        value, user_metrics = out if isinstance(out, tuple) else (out, {})
        if not isinstance(value, torch.Tensor) or value.numel() != 1 or not value.requires_grad:
            raise UserError(
                "a callable loss must return a differentiable scalar tensor of the log-probs (or (loss, metrics))"
            )
        self._check_finite({"the loss": float(value.detach())})
        grads = torch.autograd.grad(value, lps, allow_unused=True)
        g = np.concatenate(
            columns.unfold(
                [
                    np.zeros(lp.shape) if gr is None else gr.detach().to(torch.float64).numpy()
                    for lp, gr in zip(lps, grads)
                ]
            )
        )
        # the linear loss sum(g * lp) is cross_entropy with weights -g: the same parameter gradient
        weights = np.zeros(batch.num_tokens)
        keep = np.ones(batch.num_tokens, dtype=bool)
        keep[batch.offsets[:-1]] = False
        self._check_finite({"the loss's largest gradient in the log-probs": float(np.abs(g).max(initial=0.0))})
        weights[keep] = -g
        linear = dataclasses.replace(batch, loss_weights=weights, old_logprobs=None)
        res = self._run(linear, lambda lp, sub: tinker_loss(lp, sub, "cross_entropy", {}))
        metrics = {k: v for k, v in res.metrics.items() if k not in ("loss:sum", "weight:sum")}
        metrics.update({str(k): float(v) for k, v in user_metrics.items()})
        metrics["loss:sum"] = float(value.detach())
        return ForwardBackwardOutput(
            logprobs=[lp.detach().to(torch.float64).numpy() for lp in lps], loss=float(value.detach()), metrics=metrics
        )

    def optim_step(
        self,
        *,
        lr: float | None = None,
        betas: tuple[float, float] | None = None,
        eps: float | None = None,
        weight_decay: float | None = None,
        grad_clip: float | None = None,
    ) -> OptimStepOutput:
        """One AdamW update from the accumulated gradients, then zero them. Arguments given here
        replace the engine's settings from this step on (``grad_clip`` 0 or None: no clipping;
        ``lr`` in [0, 1]). Returns the gradient norm before clipping.

        A gradient norm that is not finite raises ``DivergenceError`` naming the step (counted
        from 1, as ``OptimStepOutput.step``) instead of updating: the weights, AdamW's state and
        settings stay as they were, and the gradients are dropped."""
        given = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay, "grad_clip": grad_clip}
        adamw = _adamw_settings(**{**self._adamw, **{k: v for k, v in given.items() if v is not None}})
        clip = adamw["grad_clip"]
        # the norm is on the host for clipping anyway: checking it costs no device sync
        norm = clip_grad_norm(self.model, float("inf") if clip is None else clip, self._parallel)
        self._check_finite({"the gradient norm": float(norm)})
        self._adamw = adamw
        for group in self.optimizer.param_groups:
            group.update({k: v for k, v in self._adamw.items() if k != "grad_clip"})
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self._counts is not None and self.train_config.expert_bias_rate and not _has_adapters(self.model):
            self.model.update_expert_bias(self._counts, rate=self.train_config.expert_bias_rate)
        self._counts = None
        self.step += 1
        return OptimStepOutput(grad_norm=float(norm), lr=float(self._adamw["lr"]), step=self.step)

    # ------------------------------------------------------------------ state
    def _identity(self) -> dict[str, Any]:
        from harts.trainer.lora import lora_config_of

        lora = lora_config_of(self.model)
        return {
            "model_config": self.model.config.to_dict(),
            "lora": None if lora is None else dataclasses.asdict(lora),
        }

    def save_state(self, path: str | Path) -> None:
        """Weights, optimizer state and RNG to directory ``path``. Gradients accumulated since the
        last ``optim_step`` are not saved.

        One process: ``harts.trainer.state``'s layout (no pickle, atomic). On a mesh: a sharded
        ``torch.distributed.checkpoint`` under ``path/checkpoints/step-<step>/``
        (``harts.parallel.checkpoint``: every rank writes its shards, no rank gathers the model);
        ``load_state`` reads it on any layout, one process included."""
        fields = {**self._identity(), "step": self.step, "adamw": self._adamw}
        if self._counts is not None:
            fields["pending_expert_counts"] = self._counts.tolist()
        if self._parallel.distributed:
            from harts.parallel.checkpoint import save_checkpoint

            save_checkpoint(
                path, step=self.step, model=self.model, optimizer=self.optimizer, data_state={}, extra=fields
            )
            return
        write_state(path, self.model, self.optimizer, fields)

    def load_state(self, path: str | Path) -> None:
        """Restore what ``save_state`` wrote; ``UserError`` naming the first difference if it
        was written for another model or adapter, or naming a damaged file. A state saved on a
        mesh (its newest checkpoint under ``path``) loads on any mesh or on one process; one
        saved by a one-process engine loads on one process only."""
        from harts.parallel.checkpoint import latest_checkpoint

        if latest_checkpoint(path) is not None:
            if self._shared_base:
                raise UserError(
                    f"{path}: a state saved on a mesh (full weights) cannot load into LoRA adapters over a shared base"
                )
            meta = self._load_sharded(path)
        elif self._parallel.distributed:
            raise UserError(
                f"{path}: a one-process engine's state (harts.trainer.state), which loads on one process only; "
                "a state saved on a mesh loads on any layout"
            )
        else:
            meta = self._load_whole(path)
        self._adamw = _adamw_settings(**meta["adamw"])
        self.step = int(meta["step"])
        pending = meta.get("pending_expert_counts")
        self._counts = None if pending is None else torch.tensor(pending, device=self._parallel.device)
        self.optimizer.zero_grad(set_to_none=True)

    def _check_identity(self, path: str | Path, meta: Mapping[str, Any]) -> None:
        mine = self._identity()
        for key in ("model_config", "lora"):
            saved, here = meta.get(key), mine[key]
            if saved != here:
                diff = _first_difference(saved, here)
                raise UserError(f"{path}: the state was saved for another {key.replace('_', ' ')} ({diff})")

    def _load_sharded(self, path: str | Path) -> dict[str, Any]:
        """``load_state`` of a mesh's checkpoint (DCP reshards it onto this layout); its fields."""
        from harts.parallel.checkpoint import CheckpointState, load_checkpoint

        def check(state: CheckpointState) -> None:
            self._check_identity(state.path, state.extra)

        return load_checkpoint(path, model=self.model, optimizer=self.optimizer, check=check).extra

    def _load_whole(self, path: str | Path) -> dict[str, Any]:
        """``load_state`` of a one-process engine's state; its fields."""
        meta, model_sd, opt_tensors, rng = read_state(path)
        self._check_identity(path, meta)
        expected = self.model.state_dict()
        bad = sorted(set(expected) ^ set(model_sd))
        if bad:
            raise UserError(f"{path}/model.safetensors: tensor names differ from this model's (first: {bad[0]})")
        for name, t in model_sd.items():
            if tuple(t.shape) != tuple(expected[name].shape):
                raise UserError(
                    f"{path}/model.safetensors: {name} has shape {tuple(t.shape)}, expected {tuple(expected[name].shape)}"
                )
        # over a shared base (``over_base``) the frozen weights are other engines' too: the
        # state must hold the same values, which are then left as they are
        shared = {n for n, p in self.model.named_parameters() if not p.requires_grad} if self._shared_base else set()
        for name in sorted(shared):
            if not torch.equal(model_sd[name].to(expected[name].device, expected[name].dtype), expected[name]):
                raise UserError(
                    f"{path}/model.safetensors: {name} differs from the shared base model's "
                    "(the state was saved over other base weights)"
                )
        with torch.no_grad():
            for name, t in model_sd.items():
                if name not in shared:
                    expected[name].copy_(t)
        load_optimizer(self.model, self.optimizer, meta["param_groups"], opt_tensors, f"{path}/optimizer.safetensors")
        restore_rng(rng)
        return meta

    def save_weights_for_sampler(self, path: str | Path) -> str:
        """The current weights, adapters merged, as a directory an inference engine loads:
        transformers' layout (``save_hf_checkpoint``) for a model loaded from transformers, harts'
        own (``harts.integrations.native``, ``--model DIR``) otherwise. Returns the path. On a
        mesh every rank calls it: the shards are gathered and rank 0 writes
        (``harts.trainer.weights.save_weights``)."""
        from harts.trainer.lora import merged_model

        if self._parallel.distributed:
            from harts.trainer.weights import save_weights

            save_weights(self.model, str(path))
            return str(path)
        model = merged_model(self.model) if _has_adapters(self.model) else self.model
        if getattr(model, "hf_source", None):
            from harts.integrations.hf import save_hf_checkpoint

            save_hf_checkpoint(model, str(path))
        else:
            from harts.integrations.native import save_native

            save_native(model, path)
        return str(path)


def _engine_state(model: HybridLM, parallel: ParallelState | None, capacity: int) -> ParallelState:
    """The engine's mesh: ``parallel``, checked against the model, or one process."""
    if parallel is None:
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if world > 1:
            raise UserError(
                f"a process group of {world} ranks is running: pass parallel= (the ParallelState the model was "
                "parallelized for), or build with Engine.from_spec(..., parallel=ParallelConfig(...))"
            )
        return ParallelState(config=ParallelConfig(), rank=0, world_size=1, device=model.embed_tokens.weight.device)
    if not isinstance(parallel, ParallelState):
        raise UserError(f"parallel must be a harts.parallel.mesh.ParallelState, got {type(parallel).__name__}")
    if not parallel.distributed:
        return parallel
    if not is_parallelized(model):
        raise UserError(
            "parallel= is a mesh of several ranks but the model is not sharded: apply harts.parallel.parallelize "
            "(or build with Engine.from_spec(..., parallel=ParallelConfig(...)))"
        )
    if _has_adapters(model):
        raise UserError(
            "LoRA adapters cannot be trained on a mesh (harts.parallel shards the base model's layers, not "
            "adapters): use one process"
        )
    if capacity % parallel.row_ranks:
        raise UserError(
            f"--cp {parallel.cp} x --tp {parallel.tp} = {parallel.row_ranks} does not divide --capacity {capacity} "
            "(each rank of a row group holds capacity / (cp tp) rows)"
        )
    return parallel


def _adamw_settings(
    *, lr: float, betas: tuple[float, float] | list[float], eps: float, weight_decay: float, grad_clip: float | None
) -> dict[str, Any]:
    """The AdamW settings checked (``UserError`` naming the first bad one): every one a finite
    number, the learning rate in [0, 1] (``harts.trainer.checks.check_lr``) and
    ``lr * weight_decay <= 1``."""

    def number(name: str, v: Any, lo: float, *, open_lo: bool = False) -> float:
        if (
            isinstance(v, bool)
            or not isinstance(v, (int, float))
            or not np.isfinite(v)
            or v < lo
            or (open_lo and v == lo)
        ):
            raise UserError(f"{name} must be a finite number {'>' if open_lo else '>='} {lo}, got {v!r}")
        return float(v)

    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise UserError(f"betas must be two numbers in [0, 1), got {betas!r}")
    b1, b2 = (number("betas", b, 0.0) for b in betas)
    if b1 >= 1 or b2 >= 1:
        raise UserError(f"betas must be in [0, 1), got {tuple(betas)}")
    rate, decay = check_lr(lr), number("weight_decay", weight_decay, 0.0)
    check_weight_decay(decay, rate)
    return {
        "lr": rate,
        "betas": (b1, b2),
        "eps": number("eps", eps, 0.0, open_lo=True),
        "weight_decay": decay,
        "grad_clip": None if grad_clip is None else number("grad_clip", grad_clip, 0.0) or None,
    }


def _has_adapters(model: HybridLM) -> bool:
    from harts.trainer.lora import lora_config_of

    return lora_config_of(model) is not None


def _first_difference(saved: Any, here: Any) -> str:
    if isinstance(saved, dict) and isinstance(here, dict):
        for key in sorted(set(saved) | set(here)):
            if saved.get(key) != here.get(key):
                return f"{key}: saved {saved.get(key)!r}, here {here.get(key)!r}"
    return f"saved {saved!r}, here {here!r}"
