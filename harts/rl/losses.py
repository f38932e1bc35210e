"""Tinker's per-token losses, on log-probs in batch order: ``cross_entropy``, ``importance_sampling``,
``ppo``, ``cispo``, ``dro`` and ``gspo``.

Each loss is a *sum* over target tokens, never a mean (Tinker's definitions), so the loss of a batch
is the sum of its microbatches' losses, whatever the microbatching, and a compact execution that
hands over the same log-probs gives the same loss and the same gradients. With ``lp`` the model's
log-prob of a target token, ``q`` the sampler's (``old_logprobs``), ``A`` the advantage, ``w`` the
token's weight (``loss_weights``, 1 where the batch has none), ``r = exp(lp - q)`` and ``sg`` the
stop-gradient:

    cross_entropy        -sum w * lp
    importance_sampling  -sum w * r * A
    ppo                  -sum w * min(r * A, clip(r, lo, hi) * A)          lo, hi = 0.8, 1.2
    cispo                -sum w * sg(clip(r, lo, hi)) * lp * A             lo, hi = 0, 4
    dro                  -sum w * (lp * A - beta / 2 * (lp - q)^2)         beta = 0.05
    gspo                 -sum w * min(s_t * A, clip(s_t, lo, hi) * A)      lo, hi = 0.8, 1.2

GSPO (token-level variant, Tinker's): ``s_t = exp(sg(L_j) + lp - sg(lp))`` carries its sequence's
ratio ``exp(L_j)`` as value and its own log-prob's gradient, where ``L_j`` is the mean of
``lp - q`` over the tokens of trajectory j that ``loss_inputs["sequence_ratio_mask"]`` marks
(non-zero), or, without a mask, over the tokens that carry its loss (below).

``lo`` / ``hi`` are ``loss_config``'s ``clip_low_threshold`` / ``clip_high_threshold``, ``beta``
its ``beta``; the defaults are Tinker's (cispo's clip is one-sided: no lower bound, the upper at 4). Only the entries of ``action_mask`` take part (the engine marks every target token
an action); the other entries of ``logprobs`` may be NaN and never reach the loss.

Metrics count the tokens that *carry* loss only: a non-zero weight and, for the policy losses, a
non-zero advantage (dro with ``beta`` > 0 penalizes every weighted token). Padded prompt
positions (zero advantage, a placeholder sampler log-prob) thus never reach ``ratio`` or
``target_tokens``: on-policy data has a mean ratio of exactly 1.

Shapes: ``lp_L`` with L = S - N, the entries of ``RolloutBatch`` ``logprobs`` (see
``harts.rl.grpo``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from harts.errors import UserError
from harts.ops.upload import upload
from harts.rl.grpo import per_logprob
from harts.tree.batch import RolloutBatch

__all__ = ["LOSSES", "LOSS_CONFIG_KEYS", "check_loss", "tinker_loss"]

#: the losses by name, and the batch fields each one reads besides the log-probs
LOSSES: dict[str, tuple[str, ...]] = {
    "cross_entropy": (),
    "importance_sampling": ("old_logprobs", "advantages"),
    "ppo": ("old_logprobs", "advantages"),
    "cispo": ("old_logprobs", "advantages"),
    "dro": ("old_logprobs", "advantages"),
    "gspo": ("old_logprobs", "advantages"),
}

_CLIP = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}

#: the ``loss_config`` keys each loss takes, with their defaults
LOSS_CONFIG_KEYS: dict[str, dict[str, float]] = {
    "cross_entropy": {},
    "importance_sampling": {},
    "ppo": dict(_CLIP),
    "cispo": {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0},
    "dro": {"beta": 0.05},
    "gspo": dict(_CLIP),
}

Objective = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def check_loss(name: str, config: Mapping[str, Any] | None) -> dict[str, float]:
    """``config`` completed with the loss's defaults; ``UserError`` naming an unknown loss or key."""
    if name not in LOSSES:
        raise UserError(f"unknown loss {name!r}; harts has {sorted(LOSSES)} or a callable on per-token log-probs")
    allowed = LOSS_CONFIG_KEYS[name]
    out = dict(allowed)
    for key, value in (config or {}).items():
        if key not in allowed:
            raise UserError(f"loss_config: {name} takes {sorted(allowed) or 'no keys'}, got {key!r}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(value):
            raise UserError(f"loss_config.{key} must be a finite number, got {value!r}")
        out[key] = float(value)
    if "clip_low_threshold" in out and not 0 <= out["clip_low_threshold"] <= out["clip_high_threshold"]:
        raise UserError(
            f"loss_config: need 0 <= clip_low_threshold <= clip_high_threshold, got "
            f"{out['clip_low_threshold']} and {out['clip_high_threshold']}"
        )
    if out.get("beta", 0.0) < 0:
        raise UserError(f"loss_config.beta must be >= 0, got {out['beta']}")
    return out


def _objective(name: str, cfg: dict[str, float]) -> Objective:
    """Per-token loss ``f(lp, log_r, A)`` of loss ``name`` (module docstring), before the
    weights; ``log_r`` is the log importance ratio (GSPO's ``log s_t``)."""
    if name == "cross_entropy":
        return lambda lp, log_r, a: -lp
    if name == "importance_sampling":
        return lambda lp, log_r, a: -torch.exp(log_r) * a
    if name == "dro":
        beta = cfg["beta"]
        return lambda lp, log_r, a: -(lp * a - 0.5 * beta * log_r**2)
    lo, hi = cfg["clip_low_threshold"], cfg["clip_high_threshold"]
    if name == "cispo":
        return lambda lp, log_r, a: -torch.clamp(torch.exp(log_r), lo, hi).detach() * lp * a

    def clipped(lp: torch.Tensor, log_r: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        r = torch.exp(log_r)
        return -torch.minimum(r * a, torch.clamp(r, lo, hi) * a)

    return clipped


def _carrying(name: str, cfg: dict[str, float], w: np.ndarray, adv: np.ndarray) -> np.ndarray:
    """bool: the selected entries whose per-token loss depends on the log-prob (module docstring)."""
    if name == "cross_entropy" or (name == "dro" and cfg["beta"] > 0):
        return w != 0
    return (w != 0) & (adv != 0)


def _sequence_log_ratio(
    lp: torch.Tensor, q: torch.Tensor, traj: np.ndarray, in_ratio: np.ndarray, num_trajectories: int
) -> torch.Tensor:
    """GSPO's ``L_j`` [N]: the mean of ``sg(lp) - q`` over each trajectory's ``in_ratio`` entries
    (``traj`` [L'] the trajectory of each selected entry); 0 where a trajectory has none."""
    dev, dt = lp.device, lp.dtype
    idx = upload(traj[in_ratio], dev)
    diff = (lp.detach() - q)[upload(np.flatnonzero(in_ratio), dev)]
    total = torch.zeros(num_trajectories, device=dev, dtype=dt).index_add_(0, idx, diff)
    count = torch.zeros(num_trajectories, device=dev, dtype=dt).index_add_(0, idx, torch.ones_like(diff))
    return total / count.clamp(min=1.0)


def tinker_loss(
    logprobs: torch.Tensor, batch: RolloutBatch, name: str, config: dict[str, float]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss ``name`` (``check_loss``'d ``config``) of ``logprobs`` [S - N] under ``batch``.

    Returns the loss (a 0-dim tensor, summed over the action entries) and detached sums over the
    entries that carry loss (module docstring), which add up over microbatches:
    ``target_tokens`` (their count), ``weight`` (their summed weight) and, for the policy losses,
    ``ratio`` (summed w * r) and ``clipped`` (entries whose ratio was clipped: ppo, cispo, gspo).
    """
    n = batch.num_logprobs
    if logprobs.shape != (n,):
        raise ValueError(f"logprobs must have shape ({n},) for this batch, got {tuple(logprobs.shape)}")
    # a sum over up to millions of tokens: never accumulated in a 16-bit type
    dev, dt = logprobs.device, torch.promote_types(logprobs.dtype, torch.float32)
    sel = np.flatnonzero(per_logprob(batch, batch.action_mask))
    lp = logprobs.index_select(0, upload(sel, dev)).to(dt)

    def host(a: np.ndarray | None, fill: float) -> np.ndarray:
        return np.full(sel.size, fill) if a is None else per_logprob(batch, a)[sel]

    w_h, adv_h = host(batch.loss_weights, 1.0), host(batch.advantages, 0.0)
    w, q, adv = upload(w_h, dev, dt), upload(host(batch.old_logprobs, 0.0), dev, dt), upload(adv_h, dev, dt)
    carry = _carrying(name, config, w_h, adv_h)
    log_r = lp - q
    if name == "gspo":
        traj = np.repeat(np.arange(batch.num_trajectories), batch.lengths - 1)[sel]
        mask = (batch.loss_inputs or {}).get("sequence_ratio_mask")
        in_ratio = carry if mask is None else host(mask, 0.0) != 0
        seq = _sequence_log_ratio(lp, q, traj, in_ratio, batch.num_trajectories)
        log_r = seq[upload(traj, dev)] + lp - lp.detach()
    loss = (_objective(name, config)(lp, log_r, adv) * w).sum()
    with torch.no_grad():
        on = upload(np.flatnonzero(carry), dev)
        w_on, r_on = w[on], torch.exp(log_r[on])
        metrics = {"target_tokens": torch.tensor(float(on.numel()), device=dev, dtype=dt), "weight": w_on.sum()}
        if name != "cross_entropy":
            metrics["ratio"] = (r_on * w_on).sum()
            if "clip_low_threshold" in config:
                lo, hi = config["clip_low_threshold"], config["clip_high_threshold"]
                metrics["clipped"] = ((r_on < lo) | (r_on > hi)).to(dt).sum()
    return loss, metrics
