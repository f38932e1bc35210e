"""A training run of the server, and the work its requests do on the worker thread.

A run is one ``Engine`` (a model with LoRA adapters and its AdamW state) created by one
``create_model`` (or by loading a saved state into a new run). The functions here are what the
worker runs for that run's requests, in the run's request order; each returns the encoded
response (``Done``). They are called only from the worker thread.

Metrics go out under Tinker's ``<name>:<reduction>`` names (the SDK combines chunked results by
the suffix); ``harts/engine_seconds:sum`` is the engine's own time for the call, so a client can
tell the server's overhead from the model's work.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

import numpy as np

from harts.errors import UserError
from harts.serve.futures import Done
from harts.serve.wire import PROTO_MEDIA_TYPE, WireError, encode_forward_backward_output

if TYPE_CHECKING:
    from harts.trainer.engine import Engine

__all__ = [
    "TrainingRun",
    "check_adam_params",
    "forward_backward",
    "json_done",
    "optim_step",
    "reset_optimizer",
    "tinker_metrics",
]


@dataclass(slots=True)
class TrainingRun:
    """One training run: its Tinker identity, its LoRA settings and (once created) its engine."""

    model_id: str
    session_id: str
    base_model: str
    #: Tinker's ``LoraConfig`` fields (rank, seed, train_attn, train_mlp, train_unembed); None: full weights
    lora: dict[str, Any] | None
    created: datetime
    user_metadata: dict[str, Any] | None = None
    #: the tenant whose key created it (``harts.serve.tenants``); written into ``run.json`` so
    #: that ownership survives a restart
    tenant: str | None = None
    engine: Engine | None = None
    #: bumped by every weight update (``optim_step``, a load), so a sampler snapshot knows if it is current
    version: int = 0
    last_request: datetime | None = None

    def record(self) -> dict[str, Any]:
        """What ``run.json`` holds (enough to make the same engine again)."""
        return {
            "model_id": self.model_id,
            "session_id": self.session_id,
            "base_model": self.base_model,
            "lora": self.lora,
            "created": self.created.isoformat(),
            "user_metadata": self.user_metadata,
            "tenant": self.tenant,
        }

    def live_engine(self) -> Engine:
        """The run's engine (a run's requests run after its create job, which may have failed)."""
        if self.engine is None:
            raise UserError(f"training run {self.model_id} has no model: its creation failed")
        return self.engine


def json_done(model: Any) -> Done:
    """A pydantic response model as the JSON body of a finished request."""
    return Done(model.model_dump_json(exclude_none=True).encode(), "application/json")


def tinker_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """Engine metrics under Tinker's ``name:reduction`` names (a count without one sums)."""
    out = {}
    for k, v in metrics.items():
        name, sep, reduction = k.partition(":")
        out[f"{name.replace(':', '_')}:{reduction.replace(':', '_') if sep else 'sum'}"] = float(v)
    return out


def forward_backward(
    engine: Engine,
    trajs: Sequence[dict[str, Any]],
    loss_fn: str,
    loss_config: dict[str, Any],
    *,
    forward_only: bool,
) -> Done:
    """``forward`` / ``forward_backward`` of one request: per-datum ``logprobs`` [T] or [T, K] (and,
    for cross_entropy, ``elementwise_loss`` = -weights * logprobs of the same shape), the loss as
    ``loss:sum``."""
    start = time.perf_counter()
    if forward_only:
        logprobs = engine.forward(trajs)
        metrics = {"loss:sum": _loss_only(engine, trajs, logprobs, loss_fn, loss_config)}
    else:
        out = engine.forward_backward(trajs, loss_fn, loss_config)
        logprobs = out.logprobs
        metrics = tinker_metrics(out.metrics)
    metrics["harts/engine_seconds:sum"] = time.perf_counter() - start
    outputs: dict[str, list[np.ndarray]] = {"logprobs": logprobs}
    if loss_fn == "cross_entropy":
        outputs["elementwise_loss"] = [-_weights_like(t, lp) * lp for t, lp in zip(trajs, logprobs)]
    body = encode_forward_backward_output(outputs, metrics, len(trajs))
    return Done(body, PROTO_MEDIA_TYPE)


def _weights_like(traj: dict[str, Any], lp: np.ndarray) -> np.ndarray:
    """A trajectory's ``weights`` (1 where it has none) in the shape of its log-probs: weights [T]
    beside top-k log-probs [T, K] weigh every column of a position alike."""
    if "weights" not in traj:
        return np.ones_like(lp)
    w = np.asarray(traj["weights"], dtype=np.float64)
    return np.broadcast_to(w[:, None] if w.ndim < lp.ndim else w, lp.shape)


def _loss_only(
    engine: Engine, trajs: Sequence[dict[str, Any]], logprobs: list[np.ndarray], loss_fn: str, cfg: dict[str, Any]
) -> float:
    """The loss of a forward-only call, from its log-probs (``harts.rl.losses``, no graph)."""
    import torch

    from harts.rl.losses import check_loss, tinker_loss
    from harts.rl.targets import expand_columns
    from harts.trainer.engine import COLUMN_FIELDS, trajectories_to_batch

    copies, columns = expand_columns(trajs, COLUMN_FIELDS)
    batch = trajectories_to_batch(copies, vocab_size=engine.model.config.vocab_size)
    lp = torch.from_numpy(np.concatenate(columns.unfold(logprobs)))
    loss, _ = tinker_loss(lp, batch, loss_fn, check_loss(loss_fn, cfg))
    return float(loss)


def check_adam_params(params: Any) -> None:
    """The ranges of Tinker's ``AdamParams`` that keep a run from diverging, checked when the
    request arrives (a 400 naming the field, no work queued): ``learning_rate`` in [0, 1] (AdamW
    moves every weight by about the learning rate per step; ``harts.trainer.checks.check_lr``)
    and ``learning_rate * weight_decay`` <= 1. Tinker's own types take any float; the other
    fields' finiteness and signs are the service's checks."""
    from harts.trainer.checks import check_lr, check_weight_decay

    try:
        lr = check_lr(params.learning_rate, "optim_params.learning_rate")
        check_weight_decay(float(params.weight_decay), lr, "optim_params.weight_decay")
    except UserError as err:
        raise WireError(str(err)) from None


def optim_step(engine: Engine, params: Any) -> dict[str, float]:
    """One AdamW step with Tinker's ``AdamParams`` (every field given each step); its metrics."""
    out = engine.optim_step(
        lr=params.learning_rate,
        betas=(params.beta1, params.beta2),
        eps=params.eps,
        weight_decay=params.weight_decay,
        grad_clip=params.grad_clip_norm,
    )
    # not "step": the cookbook's loops merge these metrics into their own, keyed by their step
    return {"grad_norm": out.grad_norm, "learning_rate": out.lr, "optimizer_step": float(out.step)}


def reset_optimizer(engine: Engine) -> None:
    """Forget AdamW's moments and step counts (a state loaded without its optimizer)."""
    engine.optimizer.state.clear()
    engine.optimizer.zero_grad(set_to_none=True)
