"""Tinker's per-token losses, on log-probs in batch order: ``cross_entropy``, ``importance_sampling``,
``ppo`` and ``cispo``.

Each loss is a *sum* over target tokens, never a mean (Tinker's definitions), so the loss of a batch
is the sum of its microbatches' losses, whatever the microbatching, and a compact execution that
hands over the same log-probs gives the same loss and the same gradients. With ``lp`` the model's
log-prob of a target token, ``q`` the sampler's (``old_logprobs``), ``A`` the advantage, ``w`` the
token's weight (``loss_weights``, 1 where the batch has none) and ``r = exp(lp - q)``:

    cross_entropy        -sum w * lp
    importance_sampling  -sum w * r * A
    ppo                  -sum w * min(r * A, clip(r, lo, hi) * A)          lo, hi = 0.8, 1.2
    cispo                -sum w * sg(clip(r, lo, hi)) * lp * A             lo, hi = 0.8, 1.2

``lo`` / ``hi`` are ``loss_config``'s ``clip_low_threshold`` / ``clip_high_threshold``. Only the
entries of ``action_mask`` take part (the engine marks every target token an action); the other
entries of ``logprobs`` may be NaN and never reach the loss.

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
}

#: the ``loss_config`` keys each loss takes, with their defaults
LOSS_CONFIG_KEYS: dict[str, dict[str, float]] = {
    "cross_entropy": {},
    "importance_sampling": {},
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "cispo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
}


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
    return out


def _objective(name: str, cfg: dict[str, float]) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """Per-token loss ``f(lp, q, A)`` of loss ``name`` (module docstring), before the weights."""
    if name == "cross_entropy":
        return lambda lp, q, a: -lp
    if name == "importance_sampling":
        return lambda lp, q, a: -torch.exp(lp - q) * a
    lo, hi = cfg["clip_low_threshold"], cfg["clip_high_threshold"]
    if name == "ppo":

        def ppo(lp: torch.Tensor, q: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
            r = torch.exp(lp - q)
            return -torch.minimum(r * a, torch.clamp(r, lo, hi) * a)

        return ppo
    return lambda lp, q, a: -torch.clamp(torch.exp(lp - q), lo, hi).detach() * lp * a


def tinker_loss(
    logprobs: torch.Tensor, batch: RolloutBatch, name: str, config: dict[str, float]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss ``name`` (``check_loss``'d ``config``) of ``logprobs`` [S - N] under ``batch``.

    Returns the loss (a 0-dim tensor, summed over the action entries) and detached sums that add up
    over microbatches: ``target_tokens`` (entries taking part), ``weight`` (their summed weight)
    and, for the policy losses, ``ratio`` (summed w * r) and ``clipped`` (entries whose ratio was
    clipped, ppo and cispo).
    """
    n = batch.num_logprobs
    if logprobs.shape != (n,):
        raise ValueError(f"logprobs must have shape ({n},) for this batch, got {tuple(logprobs.shape)}")
    # a sum over up to millions of tokens: never accumulated in a 16-bit type
    dev, dt = logprobs.device, torch.promote_types(logprobs.dtype, torch.float32)
    sel = np.flatnonzero(per_logprob(batch, batch.action_mask))
    lp = logprobs.index_select(0, upload(sel, dev)).to(dt)

    def meta(a: np.ndarray | None, fill: float) -> torch.Tensor:
        if a is None:
            return torch.full((sel.size,), fill, device=dev, dtype=dt)
        return upload(per_logprob(batch, a)[sel], dev, dt)

    w = meta(batch.loss_weights, 1.0)
    q = meta(batch.old_logprobs, 0.0)
    adv = meta(batch.advantages, 0.0)
    loss = (_objective(name, config)(lp, q, adv) * w).sum()
    with torch.no_grad():
        metrics = {"target_tokens": torch.tensor(float(sel.size), device=dev, dtype=dt), "weight": w.sum()}
        if name != "cross_entropy":
            r = torch.exp(lp - q)
            metrics["ratio"] = (r * w).sum()
            if "clip_low_threshold" in config:
                lo, hi = config["clip_low_threshold"], config["clip_high_threshold"]
                metrics["clipped"] = ((r < lo) | (r > hi)).to(dt).sum()
    return loss, metrics
