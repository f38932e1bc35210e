"""GRPO-style token-level clipped policy loss, built only from log-probs + RolloutBatch metadata.

The model hands over ``logprobs`` [S - N] in original order (entry ``offsets[j] - j + t - 1``
is token t >= 1 of trajectory j). Per-token metadata of the batch is aligned by dropping
every trajectory's first token. Nothing here knows about prefix sharing (paper Eq. 18):
the same function consumes trajectory-wise and compact log-probs.

Per action token (action_mask), with ratio r = exp(lp - old_lp):
    pg   = -min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A)
    kl   = exp(ref - lp) - (ref - lp) - 1                      (k3 estimator, only with kl_coef)
    l    = (pg + kl_coef * kl) * loss_weight
Reduction: "token_mean" (sum l / sum mask*weight over the batch) or "sequence_mean" (mean over
trajectories of each trajectory's token mean; trajectories without actions are skipped).
Without ``old_logprobs``, or with ``on_policy``, the ratio is taken against the detached current
log-probs: r = 1, so the loss's value is -(weighted mean advantage), fixed by the batch whatever
the weights (``FLAT_LOSS_NOTE``); only its gradient, -A d lp, carries the signal.

Diagnostics (detached, weighted means over the action entries): ``clip_frac``, ``ratio_mean``,
``kl_mean`` (the k3 KL to the reference, with ``kl_coef``), ``kl_sampler`` and ``entropy``:

    kl_sampler = r_s - 1 - log r_s,  r_s = exp(lp - old)       (k3 estimator of KL(sampler || policy))
    entropy    = -lp                                           (sampled-token estimate)

``kl_sampler`` reads the batch's ``old_logprobs`` (the sampler's, also under ``on_policy``; 0
without them): for tokens drawn from the sampler its mean is an unbiased, non-negative estimate
of KL(sampler || policy), which grows as training moves the policy off the data. ``entropy`` is
the mean negative log-prob of the sampled action tokens, the Monte Carlo estimate of the policy's
entropy for tokens drawn from it (for a sampler's tokens: their cross-entropy under the policy);
the full-vocabulary entropy would need every action row's logits again, which the log-prob op
never materializes (``harts.trainer.online.policy_pass`` computes it where one forward is spare).

Every per-token term is computed on the entries with a non-zero action weight only (they are
index-selected first): the other entries may be NaN (``ExecutionConfig.logprob_positions=
"actions"`` leaves them uncomputed) and never reach the loss, the metrics or the gradient. A NaN
at a weighted entry is a bug upstream and is not hidden: the loss and metrics become NaN. A
batch without any weighted entry has loss 0 (and zero gradients).

Shapes: lp_L with L = S - N; meta_L the batch's per-token arrays minus first tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from harts.ops.upload import upload
from harts.tree.batch import RolloutBatch

__all__ = [
    "FLAT_LOSS_NOTE",
    "GRPOOutput",
    "grpo_loss",
    "grpo_normalizer",
    "group_advantages",
    "per_logprob",
    "weighted_entries",
]


#: why an on-policy GRPO loss does not move (module docstring), said once by ``harts train``
FLAT_LOSS_NOTE = (
    "the loss is GRPO's on-policy surrogate: its ratio is 1, so its value is -(mean advantage) of the batch "
    "whatever the weights, and only its gradient trains; reward, kl-sampler (KL from the batch's sampler "
    "log-probs), entropy and grad-norm show the training"
)


@dataclass
class GRPOOutput:
    loss: torch.Tensor
    #: detached diagnostics as 0-dim tensors on the loss's device, so computing them does not
    #: wait for the device: clip fraction, mean ratio, mean KL to the reference and to the sampler,
    #: entropy estimate, action tokens (module docstring)
    metric_tensors: dict[str, torch.Tensor]

    @property
    def metrics(self) -> dict[str, float]:
        """``metric_tensors`` as Python floats (waits for the device)."""
        if not self.metric_tensors:
            return {}
        values = torch.stack([t.to(torch.float64) for t in self.metric_tensors.values()]).tolist()
        return dict(zip(self.metric_tensors, values))


def per_logprob(batch: RolloutBatch, values: np.ndarray) -> np.ndarray:
    """Per-token array [S] -> the entries aligned with ``logprobs`` [S - N]."""
    keep = np.ones(batch.num_tokens, dtype=bool)
    keep[batch.offsets[:-1]] = False
    return values[keep]


def group_advantages(rewards: np.ndarray, group_ids: np.ndarray, *, eps: float = 1e-6, std: bool = True) -> np.ndarray:
    """GRPO's group-relative advantages: (r - mean_group) / (std_group + eps), float64 [N]."""
    rewards = np.asarray(rewards, dtype=np.float64)
    group_ids = np.asarray(group_ids)
    if rewards.shape != group_ids.shape:
        raise ValueError(f"rewards {rewards.shape} and group_ids {group_ids.shape} must have the same shape")
    out = np.empty_like(rewards)
    for gid in np.unique(group_ids):
        sel = group_ids == gid
        r = rewards[sel]
        out[sel] = (r - r.mean()) / (r.std() + eps) if std else r - r.mean()
    return out


def action_weight(batch: RolloutBatch) -> np.ndarray:
    """float64 [S - N]: action mask times loss weight, aligned with ``logprobs``."""
    mask = per_logprob(batch, batch.action_mask.astype(np.float64))
    return mask if batch.loss_weights is None else mask * per_logprob(batch, batch.loss_weights)


def weighted_entries(weight: np.ndarray) -> np.ndarray:
    """int64 [A']: the entries of ``logprobs`` [S - N] with a non-zero action weight ``weight``
    (``action_weight(batch)``): the only ones a policy loss reads (a subset of
    ``batch.action_logprob_entries()``)."""
    return np.flatnonzero(weight != 0)


def grpo_normalizer(batch: RolloutBatch, reduction: str = "token_mean") -> float:
    """The denominator ``grpo_loss`` uses for the whole of ``batch`` (see ``normalizer``)."""
    weight = action_weight(batch)
    if reduction == "token_mean":
        return max(float(weight.sum()), 1e-12)
    traj = np.repeat(np.arange(batch.num_trajectories), batch.lengths - 1)
    per_traj = np.bincount(traj, weights=weight, minlength=batch.num_trajectories)
    return float(max(int((per_traj > 0).sum()), 1))


def grpo_loss(
    logprobs: torch.Tensor,
    batch: RolloutBatch,
    *,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    kl_coef: float = 0.0,
    reduction: str = "token_mean",
    normalizer: float | None = None,
    on_policy: bool = False,
) -> GRPOOutput:
    """The clipped policy loss of ``logprobs`` under ``batch``'s metadata (module docstring).

    ``on_policy``: the ratio is taken against the detached ``logprobs`` even where the batch
    carries ``old_logprobs``, which then feed the ``kl_sampler`` diagnostic only.

    ``normalizer`` replaces the reduction's denominator (the batch's summed action weight for
    ``token_mean``, its number of trajectories with actions for ``sequence_mean``) — pass the
    whole step's value when ``batch`` is one microbatch of it, so that microbatch losses add
    up to the step's loss exactly under gradient accumulation and data parallelism.
    """
    n = batch.num_logprobs
    if logprobs.shape != (n,):
        raise ValueError(f"logprobs must have shape ({n},) for this batch, got {tuple(logprobs.shape)}")
    if reduction not in ("token_mean", "sequence_mean"):
        raise ValueError(f"reduction must be 'token_mean' or 'sequence_mean', got {reduction!r}")
    if kl_coef and batch.ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs in the batch")
    dev, dt = logprobs.device, logprobs.dtype
    weight_np = action_weight(batch)
    sel = weighted_entries(weight_np)
    sel_t = upload(sel, dev)

    def meta(a: np.ndarray) -> torch.Tensor:
        return upload(per_logprob(batch, a)[sel], dev, dt)

    # from here on every per-token tensor holds the weighted entries only (module docstring)
    lp = logprobs.index_select(0, sel_t)
    weight = upload(weight_np[sel], dev, dt)
    adv = meta(batch.advantages)
    sampler = None if batch.old_logprobs is None else meta(batch.old_logprobs)
    old = lp.detach() if sampler is None or on_policy else sampler
    ratio = torch.exp(lp - old)
    hi = clip_eps if clip_eps_high is None else clip_eps_high
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + hi)
    per_tok = -torch.minimum(ratio * adv, clipped * adv)
    kl = None
    if kl_coef:
        assert batch.ref_logprobs is not None, "kl_coef needs ref_logprobs"
        d = meta(batch.ref_logprobs) - lp
        kl = torch.exp(d) - d - 1.0
        per_tok = per_tok + kl_coef * kl

    if reduction == "token_mean":
        den = weight.sum().clamp_min(1e-12) if normalizer is None else normalizer
        loss = (per_tok * weight).sum() / den
    else:
        traj_np = np.repeat(np.arange(batch.num_trajectories), batch.lengths - 1)[sel]
        traj = upload(traj_np, dev, torch.int64)
        num = torch.zeros(batch.num_trajectories, device=dev, dtype=dt).index_add(0, traj, per_tok * weight)
        den = torch.zeros(batch.num_trajectories, device=dev, dtype=dt).index_add(0, traj, weight)
        has = den > 0
        count = has.sum().clamp_min(1) if normalizer is None else normalizer
        loss = (num[has] / den[has]).sum() / count

    with torch.no_grad():
        zero = torch.zeros((), device=dev, dtype=dt)
        w = weight.sum().clamp_min(1e-12)
        was_clipped = ((ratio - clipped).abs() > 0).to(dt)
        metrics = {
            "clip_frac": (was_clipped * weight).sum() / w,
            "ratio_mean": (ratio * weight).sum() / w,
            "kl_mean": (kl * weight).sum() / w if kl is not None else zero,
            "kl_sampler": _k3(lp.detach() - sampler, weight) / w if sampler is not None else zero,
            "entropy": -(lp.detach() * weight).sum() / w,
            "action_tokens": upload(np.asarray(float(batch.action_mask.sum())), dev, dt),
        }
    return GRPOOutput(loss=loss, metric_tensors=metrics)


def _k3(d: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """sum(weight * (exp(d) - 1 - d)): the weighted k3 KL terms of log-ratios ``d`` [A'], each >= 0
    (``expm1`` keeps the small ones exact)."""
    return (torch.expm1(d) - d).mul(weight).sum()
