"""Online RL: sample rollout trees from the policy, score them, train on them, step after step.

One step of ``OnlineTrainer.step``:

1. ``collect``: the current weights sample ``tasks`` episodes of the environment as rollout
   trees (forks at turn boundaries), with the sampler's log-probs and group-relative
   advantages (``harts.rollout.collect``);
2. one forward without gradients of the current policy (in ``execution.mode``) gives the
   training forward's log-probs of the same tokens: their gap to the sampler's is the
   train/inference mismatch, reported every step (0 up to rounding: both run the same layers
   on the same weights); the same pass gives the policy's entropy at action tokens (logits of
   those rows only, in chunks). A forward of the frozen reference (the initial weights) gives
   ``ref_logprobs``: the k3 KL to the reference, and its penalty when ``kl_coef > 0``;
3. ``updates`` optimizer updates (``train_step``), each on a slice of the step's tasks, with
   the sampler's log-probs as ``old_logprobs``: the first slice is on-policy, the later ones
   see the weights already moved, which is where the clip fraction comes from.

Everything a resumed run needs besides the model and optimizer lives in ``OnlineState`` (step
index, the task RNG, the sampler RNG, the per-step history) with ``state_dict`` /
``load_state_dict``; ``OnlineTrainer.state_dict`` adds the reference weights. Sampling depends
only on those RNGs and the weights, so compact and trajectory-wise runs with one seed sample the
same trees, and a run resumed from a checkpoint equals the uninterrupted one.

``OnlineTrainer.snapshot()`` / ``restore()`` keep an in-memory copy of everything a step changes
(weights and buffers, optimizer, online state, torch's global RNG), so a step that is interrupted
or fails halfway -- after some of its updates -- can be undone and the run saved as it was
after the last completed step (``harts demo`` does this; it costs a copy of the model per step).

Shapes: lp_L per-logprob arrays (L = S - N, ``RolloutBatch.num_logprobs``).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from harts.envs.base import Environment
from harts.models.hybrid_lm import HybridLM
from harts.rl.grpo import per_logprob
from harts.rollout.collect import RolloutConfig, collect
from harts.trainer.step import TrainConfig, train_step
from harts.tree.batch import RolloutBatch
from harts.tree.compact import prefix_index

__all__ = ["OnlineConfig", "OnlineState", "OnlineTrainer", "policy_pass"]


@dataclass(kw_only=True)
class OnlineConfig:
    """Settings of an online run (sampling, updates, optimisation)."""

    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    #: optimisation and execution of each update (``on_policy`` is forced off: the sampler's
    #: log-probs are the old log-probs)
    train: TrainConfig = field(default_factory=TrainConfig)
    #: optimizer updates per step, each on ``tasks / updates`` of the step's trees
    updates: int = 2
    seed: int = 0


class OnlineState:
    """What a resumed run needs besides weights and optimizer (module docstring)."""

    def __init__(self, seed: int) -> None:
        self.step = 0
        self.task_rng = np.random.default_rng(seed)
        self.sampler = torch.Generator().manual_seed(seed)
        #: one metrics record per finished step
        self.history: list[dict[str, Any]] = []

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "task_rng": copy.deepcopy(self.task_rng.bit_generator.state),
            "sampler": self.sampler.get_state().clone(),
            "history": copy.deepcopy(self.history),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.task_rng.bit_generator.state = copy.deepcopy(state["task_rng"])
        self.sampler.set_state(state["sampler"])
        self.history = copy.deepcopy(state["history"])


@torch.no_grad()
def policy_pass(model: HybridLM, batch: RolloutBatch, trainer: TrainConfig) -> tuple[np.ndarray, float]:
    """Log-probs lp_L of ``batch`` by the training forward (no gradients) and the mean entropy
    of the policy at action tokens (float64 host values).

    The entropy reads the final hidden rows the forward computed (a hook on ``model.norm``) and
    forms logits for the predicting rows of action tokens only, ``chunk`` rows at a time.
    """
    # every entry: they become the batch's ref_logprobs, which must be finite everywhere
    cfg = replace(trainer.execution, logprob_positions="all")
    inputs: Any = batch
    pred = batch.predicting_positions()
    if cfg.mode == "compact":
        inputs = model.prepare_compact(batch, cfg)
        pred = np.asarray(inputs.layout.semantic_to_phys)[pred]
    hidden: list[torch.Tensor] = []
    handle = model.norm.register_forward_hook(lambda _m, _i, out: hidden.append(out))
    try:
        out = model(inputs, cfg)
    finally:
        handle.remove()
    act = per_logprob(batch, batch.action_mask)
    rows = torch.as_tensor(pred[act], device=hidden[0].device)
    entropy_sum = 0.0
    for chunk in rows.split(4096):
        logp = torch.log_softmax(torch.nn.functional.linear(hidden[0][chunk], model.lm_head_weight).double(), -1)
        entropy_sum += float(-(logp.exp() * logp).sum())
    return out.logprobs.double().cpu().numpy(), entropy_sum / max(int(act.sum()), 1)


def _per_token(batch: RolloutBatch, lp_L: np.ndarray) -> np.ndarray:
    """lp_L -> a per-token array [S] (first tokens get 0), the layout of ``old/ref_logprobs``."""
    idx = batch.logprob_index()
    return np.where(idx >= 0, lp_L[np.maximum(idx, 0)], 0.0)


class OnlineTrainer:
    """Runs online steps on ``model`` (module docstring); ``state`` may come from a checkpoint."""

    def __init__(
        self,
        model: HybridLM,
        make_env: Callable[[], Environment],
        cfg: OnlineConfig,
        *,
        optimizer: torch.optim.Optimizer | None = None,
        state: OnlineState | None = None,
    ) -> None:
        if cfg.updates < 1 or cfg.updates > cfg.rollout.tasks:
            raise ValueError(f"updates must be in [1, tasks={cfg.rollout.tasks}], got {cfg.updates}")
        self.model, self.make_env, self.cfg = model, make_env, cfg
        self.train_cfg = replace(cfg.train, on_policy=False)
        self.reference = copy.deepcopy(model).requires_grad_(False)
        self.optimizer = optimizer or torch.optim.AdamW(
            model.parameters(), lr=cfg.train.lr, weight_decay=cfg.train.weight_decay
        )
        self.state = state or OnlineState(cfg.seed)

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint needs besides ``model`` and ``optimizer``: the online state and the
        reference policy's weights (the initial weights, which a resumed run no longer has)."""
        return {"state": self.state.state_dict(), "reference": self.reference.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state.load_state_dict(state["state"])
        self.reference.load_state_dict(state["reference"])

    def snapshot(self) -> dict[str, Any]:
        """Copies of what ``step`` changes (module docstring); ``restore`` puts them back."""
        return {
            "tensors": {n: t.detach().clone() for n, t in self._tensors()},
            "optimizer": copy.deepcopy(self.optimizer.state_dict()),
            "state": self.state.state_dict(),
            "torch_rng": torch.get_rng_state(),
        }

    def restore(self, snap: dict[str, Any]) -> None:
        """Back to the moment of ``snapshot()`` (bitwise)."""
        with torch.no_grad():
            for name, t in self._tensors():
                t.copy_(snap["tensors"][name])
        self.optimizer.load_state_dict(copy.deepcopy(snap["optimizer"]))
        self.state.load_state_dict(snap["state"])
        torch.set_rng_state(snap["torch_rng"])

    def _tensors(self) -> list[tuple[str, torch.Tensor]]:
        # buffers too: the MoE expert bias is one, also when not persistent
        return [*self.model.named_parameters(), *self.model.named_buffers()]

    def step(self, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
        """One online step; returns (and appends to ``state.history``) its metrics record."""
        t0 = time.perf_counter()
        note = progress or (lambda _phase: None)
        note("sample")
        ro = collect(self.model, self.make_env, self.cfg.rollout, self.state.task_rng, self.state.sampler)
        note("score")
        batch = ro.batch
        groups = batch.group_ids
        assert batch.old_logprobs is not None and groups is not None, "collect() sets both"
        lp, entropy = policy_pass(self.model, batch, self.train_cfg)
        ref_lp, _ = policy_pass(self.reference, batch, self.train_cfg)
        act = per_logprob(batch, batch.action_mask)
        sampled = per_logprob(batch, batch.old_logprobs)
        d = ref_lp[act] - lp[act]
        kl = float(np.mean(np.exp(d) - d - 1.0))
        mismatch = float(np.abs(lp[act] - sampled[act]).max())
        batch = replace(batch, ref_logprobs=_per_token(batch, ref_lp))

        logs = []
        for i, tasks in enumerate(np.array_split(np.arange(self.cfg.rollout.tasks), self.cfg.updates)):
            note(f"update {i + 1}/{self.cfg.updates}")
            sub = batch.select(np.flatnonzero(np.isin(groups, tasks)))
            logs.append(train_step(self.model, self.optimizer, sub, self.train_cfg, step=self.state.step))
        acts = max(sum(log.action_tokens for log in logs), 1)
        step_seconds = time.perf_counter() - t0
        record = {
            "step": self.state.step,
            "reward": float(ro.rewards.mean()),
            "success": float(np.mean([bool(i.get("success")) for i in ro.infos])),
            "kl": kl,
            "clip_frac": sum(log.clip_frac * log.action_tokens for log in logs) / acts,
            # from the sampler's log-probs to the policy each update starts from (0 at the first)
            "kl_sampler": sum((log.kl_sampler or 0.0) * log.action_tokens for log in logs) / acts,
            "entropy": entropy,
            "compression": batch.num_tokens / prefix_index(batch).num_compact_tokens,
            "loss": float(np.mean([log.loss for log in logs])),
            "grad_norm": float(np.mean([log.grad_norm for log in logs])),
            "mismatch": mismatch,
            "trajectories": batch.num_trajectories,
            "raw_tokens": batch.num_tokens,
            "retries": ro.retries,
            "sample_seconds": ro.sample_seconds,
            "step_seconds": step_seconds,
            "tokens_per_second": batch.num_tokens / step_seconds,
        }
        self.state.history.append(record)
        self.state.step += 1
        return record
