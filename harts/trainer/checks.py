"""The checks of a run's batches before its first step: every step's batch is read once and
summarized (``StepSummary``: trajectory lengths, token ids), then checked against the
microbatch capacity and the replicas (``check_capacity``, ``check_plannable``) and the
vocabulary it needs is found (``needed_vocab``), so that a problem in step k is reported in
seconds, not after k steps. Errors are ``UserError`` / ``CapacityError`` naming the step, its
source and the command-line option to change.

The optimizer's settings are checked here too (``check_lr``, ``check_weight_decay``): the range
of learning rates harts takes, the same for ``harts train``, the ``Engine`` and the server.

Module level imports only the standard library (the command line's ``--help`` stays instant).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from harts.errors import CapacityError, UserError

if TYPE_CHECKING:
    from harts.models.execution.config import ExecutionConfig
    from harts.tree.batch import RolloutBatch

#: the largest learning rate taken. AdamW moves every weight by about the learning rate at each
#: step whatever the gradient's scale, so a rate above 1 moves weights further than their own
#: size (initialized at ~0.02) in one step: such a run diverges, and a rate like 1e30 overflows
#: the weights at its first step. Refusing it before any work beats finding NaN weights later.
MAX_LR = 1.0

__all__ = [
    "MAX_LR",
    "StepSummary",
    "batch_vocab",
    "check_capacity",
    "check_lr",
    "check_plannable",
    "check_recompute_layers",
    "check_weight_decay",
    "max_compression",
    "needed_vocab",
    "published_vocab",
    "summarize",
    "vocab_note",
]


@dataclass
class StepSummary:
    """What the checks before the first step need to know about one step's batch."""

    step: int
    label: str
    trajectories: int
    tokens: int
    #: the longest trajectory: its index and length
    longest: int
    longest_len: int
    #: the largest token id: where it is (trajectory, position)
    max_token: int
    max_token_at: tuple[int, int]
    #: the batch's declared vocabulary (file header), if any
    vocab_size: int | None
    #: positions after prefix sharing (``harts.tree.compact``); ``tokens / compact_tokens`` is
    #: the step's compression, which sizes compact attention's gathered views
    compact_tokens: int = 0

    def where(self) -> str:
        return f"step {self.step} ({self.label})"


def summarize(step: int, label: str, batch: RolloutBatch) -> StepSummary:
    import numpy as np

    from harts.tree.compact import prefix_index

    lengths = batch.lengths
    j = int(np.argmax(lengths))
    k = int(np.argmax(batch.tokens))
    jt = int(np.searchsorted(batch.offsets, k, side="right") - 1)
    return StepSummary(
        step=step,
        label=label,
        trajectories=batch.num_trajectories,
        tokens=batch.num_tokens,
        longest=j,
        longest_len=int(lengths[j]),
        max_token=int(batch.tokens[k]),
        max_token_at=(jt, int(k - batch.offsets[jt])),
        vocab_size=batch.vocab_size,
        compact_tokens=prefix_index(batch).num_compact_tokens,
    )


def max_compression(summaries: list[StepSummary]) -> float:
    """The largest semantic / compact positions of the steps (1.0 without prefix sharing)."""
    return max([s.tokens / s.compact_tokens for s in summaries if s.compact_tokens] or [1.0])


def check_capacity(
    summaries: list[StepSummary], capacity: int, dp: int = 1, *, dp_name: str = "data-parallel ranks"
) -> None:
    """Every trajectory of every step fits ``--capacity`` (the rule's owner:
    ``harts.plan.step.step_plan.capacity_error``) and every step has >= ``dp`` trajectories."""
    from harts.plan.step.step_plan import capacity_error

    fits = max(s.longest_len for s in summaries)
    for s in summaries:
        if s.longest_len > capacity:
            where = f"{s.where()}: "
            raise capacity_error(s.longest, s.longest_len, capacity, where=where, option="--capacity", fits=fits)
    for s in summaries:
        if s.trajectories < dp:
            raise UserError(
                f"{s.where()} has {s.trajectories} trajectories, fewer than the {dp} {dp_name} "
                f"(every replica needs a microbatch); use at most {s.trajectories}"
            )


def check_plannable(
    batch: RolloutBatch, summary: StepSummary, capacity: int, dp: int, modes: tuple[str, ...] = ("compact",)
) -> None:
    """Each of ``modes`` can plan ``batch`` for ``dp`` replicas: harts' step planner ("compact")
    splits it into a multiple of ``dp`` microbatches of ``capacity`` compact tokens (with D > 1
    a small capacity can need more microbatches than there are trajectories); the baseline's
    raw-token packing ("trajectory") gives every replica as many microbatches."""
    from harts.plan.baselines.trajectory_plan import plan_trajectory_step
    from harts.plan.step.step_plan import check_inputs
    from harts.tree.compact import prefix_index

    n = summary.trajectories
    if "trajectory" in modes:
        try:
            plan_trajectory_step(batch.lengths, dp=dp, capacity=capacity)
        except ValueError as err:  # its message says what to change
            raise CapacityError(f"{summary.where()}: trajectory-wise baseline: {err}") from None
    if "compact" in modes and dp * max(1, -(-summary.tokens // (capacity * dp))) > dp * (n // dp):
        # (when even the raw tokens, >= the compact work, fit, there is no need to compact)
        try:
            check_inputs(prefix_index(batch), dp, capacity)
        except ValueError as err:
            raise CapacityError(f"{summary.where()}: {err}; raise --capacity") from None


def needed_vocab(summaries: list[StepSummary], model: str | None = None) -> tuple[int, str]:
    """The vocabulary to build the model with for every step, and where the largest token id sits.

    The steps need their declared vocabulary, or their largest token id + 1. ``model`` (the
    ``--model`` they train): a published model's preset (``harts.models.presets.MODEL_FIELDS``)
    keeps its own vocabulary where that covers the steps (its LM head is part of the shape
    being trained and measured), and grows to theirs otherwise (``vocab_note`` says so). The
    small presets (``tiny``, ``ling3_tiny``) are sized to the steps; a checkpoint keeps its own
    and is checked against this (``harts.trainer.build.check_vocab``)."""
    top = max(summaries, key=lambda s: s.max_token)
    vocab = max(top.max_token + 1, *(s.vocab_size or 0 for s in summaries))
    if model is not None:
        vocab = max(vocab, published_vocab(model) or 0)
    j, t = top.max_token_at
    return vocab, f"token id {top.max_token:,} ({top.where()}, trajectory {j}, position {t})"


def batch_vocab(summaries: list[StepSummary], model: str, *, quiet: bool = False) -> tuple[int, str]:
    """``needed_vocab(summaries, model)``: the vocabulary ``--model`` is built with for the
    steps, and where their largest token id sits; a published preset's vocabulary grown to fit
    them is said in one line on stderr (unless ``quiet``: the ranks but the first)."""
    import sys

    vocab, where = needed_vocab(summaries, model)
    note = vocab_note(model, vocab)
    if note and not quiet:
        print(f"harts: note: {note}", file=sys.stderr, flush=True)
    return vocab, where


def published_vocab(model: str) -> int | None:
    """The vocabulary of a published model's preset ``model``; None for a checkpoint, a small
    preset or an unknown name (reported where the model is built)."""
    from harts.integrations.loading import is_checkpoint

    if is_checkpoint(model):
        return None
    from harts.models.config import HybridConfig, preset_key
    from harts.models.presets import MODEL_FIELDS

    try:
        key = preset_key(model)
    except UserError:
        return None
    return HybridConfig.preset(key).vocab_size if key in MODEL_FIELDS else None


def vocab_note(model: str, vocab: int) -> str | None:
    """One line when ``needed_vocab`` grew a published preset's vocabulary to fit the steps."""
    own = published_vocab(model)
    if own is None or vocab == own:
        return None
    return f"--model {model}: its vocabulary of {own:,} grown to {vocab:,} to fit the batch's tokens"


def check_recompute_layers(fields: Mapping[str, Any] | ExecutionConfig, model: Any) -> None:
    """UserError unless ``--recompute-layers`` (``fields`` from ``recompute_fields``, or the
    ``ExecutionConfig`` made of them) is at most ``model``'s number of decoder layers, and
    ``--moe-keep-gate-up`` at most its MoE layers, naming both."""
    if not isinstance(fields, Mapping):
        fields = {"recompute_layers": fields.recompute_layers, "moe_keep_gate_up": fields.moe_keep_gate_up}
    layers, have = fields.get("recompute_layers"), model.config.num_hidden_layers
    if layers is not None and layers > have:
        raise UserError(f"--recompute-layers {layers}: the model has {have} decoder layers (use 0 .. {have})")
    keep = fields.get("moe_keep_gate_up", 0)
    moe_layers = sum(1 for layer in model.layers if layer.is_moe)
    if keep > moe_layers:
        noun = "MoE layer" if moe_layers == 1 else "MoE layers"
        raise UserError(f"--moe-keep-gate-up {keep}: the model has {moe_layers} {noun} (use 0 .. {moe_layers})")


def check_lr(lr: Any, name: str = "lr", *, zero: bool = True) -> float:  # noqa: ANN401 - any input
    """``lr`` as a float if it is a finite number in [0, ``MAX_LR``] (``(0, MAX_LR]`` without
    ``zero``), else a one-line ``UserError`` naming ``name`` and the range. Zero is a learning
    rate for Tinker's clients (a schedule's warmup may start there: the step then changes only
    AdamW's moments), not for ``harts train``, which has no schedule."""
    lo = "[0" if zero else "(0"
    if isinstance(lr, bool) or not isinstance(lr, (int, float)):
        raise UserError(f"{name}: expected a number in {lo}, {MAX_LR:g}], got {lr!r}")
    value = float(lr)
    if not (math.isfinite(value) and (0.0 <= value if zero else 0.0 < value) and value <= MAX_LR):
        raise UserError(
            f"{name}: {lr!r} is outside {lo}, {MAX_LR:g}] (AdamW moves every weight by about the learning rate "
            "per step; larger rates diverge)"
        )
    return value


def check_weight_decay(weight_decay: float, lr: float, name: str = "weight_decay") -> None:
    """``UserError`` naming ``name`` unless ``lr * weight_decay <= 1``: AdamW multiplies every
    weight by ``1 - lr * weight_decay`` at each step, which beyond 1 flips its sign and grows it
    step after step until it overflows (``weight_decay`` itself is already a finite number >= 0)."""
    if lr * weight_decay > 1.0:
        raise UserError(
            f"{name}: {weight_decay:g} times the learning rate {lr:g} is over 1 (AdamW multiplies every weight "
            "by 1 - lr x weight_decay per step; beyond 1 the weights grow until they overflow)"
        )
