"""PPO policy loss with optional dual clip, from log-probs + RolloutBatch metadata.

Same inputs and alignment as ``grpo_loss`` (per-token advantages from the batch, e.g. GAE
computed by the caller; old log-probs required). With dual clip c > 1 (Ye et al. 2020), a
token with negative advantage contributes at most ``-c * A``:

    pg = -min(r A, clip(r, 1 - eps, 1 + eps) A);   pg = min(pg, -c A) where A < 0

Reduction as in ``grpo_loss``; as there, every term is computed on the entries with a non-zero
action weight only (the others may be NaN: ``logprob_positions="actions"``), and a NaN at a
weighted entry makes the loss NaN. Shapes: lp_L, L = S - N.
"""

from __future__ import annotations

import numpy as np
import torch

from harts.ops.upload import upload
from harts.rl.grpo import GRPOOutput, action_weight, per_logprob, weighted_entries
from harts.tree.batch import RolloutBatch

__all__ = ["ppo_policy_loss"]


def ppo_policy_loss(
    logprobs: torch.Tensor,
    batch: RolloutBatch,
    *,
    clip_eps: float = 0.2,
    dual_clip: float | None = 3.0,
) -> GRPOOutput:
    """Token-mean PPO clipped surrogate over action tokens (module docstring)."""
    if logprobs.shape != (batch.num_logprobs,):
        raise ValueError(f"logprobs must have shape ({batch.num_logprobs},), got {tuple(logprobs.shape)}")
    if batch.old_logprobs is None:
        raise ValueError("PPO needs old_logprobs in the batch")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    dev, dt = logprobs.device, logprobs.dtype
    weight_np = action_weight(batch)
    sel = weighted_entries(weight_np)

    def meta(a: np.ndarray) -> torch.Tensor:
        return upload(per_logprob(batch, a)[sel], dev, dt)

    # the weighted entries only: the others may be NaN (never computed) and never enter the loss
    lp = logprobs.index_select(0, upload(sel, dev))
    weight = upload(weight_np[sel], dev, dt)
    adv = meta(batch.advantages)
    ratio = torch.exp(lp - meta(batch.old_logprobs))
    pg = -torch.minimum(ratio * adv, torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * adv)
    if dual_clip is not None:
        pg = torch.where(adv < 0, torch.minimum(pg, -dual_clip * adv), pg)
    total = weight.sum().clamp_min(1e-12)
    loss = (pg * weight).sum() / total
    with torch.no_grad():
        metrics = {
            "ratio_mean": (ratio * weight).sum() / total,
            "clip_frac": (((ratio - 1).abs() > clip_eps).to(dt) * weight).sum() / total,
            "action_tokens": weight.gt(0).sum(),
        }
    return GRPOOutput(loss=loss, metric_tensors=metrics)
