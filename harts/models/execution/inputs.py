"""A batch prepared for the model: everything host-side a forward needs, made before it runs.

``prepare_compact(config, batch, execution)`` compacts the batch, plans its calls (Algorithm 1,
``harts.plan.calls``) and builds the physical layout every layer reads (``harts.plan.layout``);
``prepare_trajectory`` leaves the rows as they are. Both make the LM head's host inputs
(``head_inputs``: which hidden row and target each computed log-prob reads). ``prepare_inputs``
turns whatever a caller hands the model (a ``RolloutBatch``, a ``CompactBatch``, or inputs
prepared for the other mode) into the inputs of ``execution``'s mode, which is what
``HybridLM.__call__`` does before ``HybridLM.forward``: the forward executes a fixed plan and
never plans (numpy only here, no model state).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from harts.models.execution.config import ExecutionConfig
from harts.ops.logprob.mapped import LogprobIndex, logprob_index
from harts.plan.calls import CallPlan, plan_calls
from harts.plan.layout import Layout, build_layout
from harts.tree.batch import RolloutBatch
from harts.tree.compact import CompactBatch, compact

if TYPE_CHECKING:
    from harts.models.config import HybridConfig

__all__ = [
    "CompactInputs",
    "HeadInputs",
    "ModelInputs",
    "TrajectoryInputs",
    "check_batch",
    "check_prepared",
    "head_inputs",
    "prepare_compact",
    "prepare_inputs",
    "prepare_trajectory",
]


@dataclass(frozen=True)
class HeadInputs:
    """The LM head's host inputs for one batch under one ``logprob_positions`` setting: which
    hidden row and target each computed log-prob reads, and the fused head's index bookkeeping.

    ``prepare_compact`` / ``prepare_trajectory`` make them ahead of the forward (numpy
    only), so that no host work sits between the layers' kernels and the head's; a forward whose
    setting differs makes its own. Shapes (n computed positions): ``rows`` [n] hidden rows
    (trajectory: the position itself; compact: its physical row), ``targets`` [n] target tokens,
    ``entries`` [n] the log-prob entries computed (None: all, in order), ``index`` the fused
    head's ``LogprobIndex`` (None: the chunked-eager head, or not made).
    """

    logprob_positions: str
    fused: bool
    rows: np.ndarray
    targets: np.ndarray
    entries: np.ndarray | None
    index: LogprobIndex | None

    def serves(self, cfg: ExecutionConfig) -> bool:
        """Whether a forward under ``cfg`` can use these (same positions, same head)."""
        return self.logprob_positions == cfg.logprob_positions and self.fused == cfg.use_fused_logprobs


def head_inputs(batch: RolloutBatch, layout: Layout | None, cfg: ExecutionConfig, vocab_size: int) -> HeadInputs:
    """``HeadInputs`` of ``batch`` under ``cfg`` (its ``logprob_positions`` and whether the head is
    fused); ``layout`` maps positions to compact physical rows (None: trajectory rows)."""
    pred, targets = batch.predicting_positions(), batch.next_token_targets()
    # "actions": the LM head runs only where the loss reads a log-prob (its largest cost)
    entries = batch.action_logprob_entries() if cfg.logprob_positions == "actions" else None
    if entries is not None:
        pred, targets = pred[entries], targets[entries]
    # a compact row shared by several selected positions is computed once (mapped_logprobs)
    rows = pred if layout is None else np.asarray(layout.semantic_to_phys)[pred]
    hidden_rows = batch.num_tokens if layout is None else layout.num_rows
    fused = cfg.use_fused_logprobs
    index = logprob_index(rows, targets, hidden_rows, vocab_size) if fused else None
    return HeadInputs(cfg.logprob_positions, fused, rows, targets, entries, index)


@dataclass(frozen=True)
class CompactInputs:
    """A batch prepared for compact execution: compaction, call plan, physical layout and the LM
    head's host inputs.

    Build once with ``HybridLM.prepare_compact`` and pass to ``model(inputs, mode="compact")``
    to keep planning out of a timed region; the model executes the fixed plan and never re-plans.
    """

    cb: CompactBatch
    plan: CallPlan
    layout: Layout
    no_replay: bool = False
    head: HeadInputs | None = None

    @property
    def batch(self) -> RolloutBatch:
        return self.cb.batch


@dataclass(frozen=True)
class TrajectoryInputs:
    """A batch prepared for trajectory-wise execution: the LM head's host inputs made ahead, as
    ``CompactInputs`` has them (``HybridLM.prepare_trajectory``), so that both modes leave the
    same host work out of the forward."""

    batch: RolloutBatch
    head: HeadInputs | None = None


#: what ``HybridLM.forward`` runs: inputs prepared for compact or trajectory-wise execution
ModelInputs = CompactInputs | TrajectoryInputs


def check_batch(config: HybridConfig, batch: RolloutBatch) -> None:
    """ValueError when ``batch`` holds a token id outside the vocabulary of ``config``."""
    top = int(batch.tokens.max())
    if top >= config.vocab_size:
        raise ValueError(f"batch has token id {top} but the model's vocab_size is {config.vocab_size}")


def prepare_compact(
    config: HybridConfig,
    batch: RolloutBatch | CompactBatch,
    execution: ExecutionConfig | None = None,
    *,
    plan: CallPlan | None = None,
) -> CompactInputs:
    """Compaction, call plan, layout and the LM head's host inputs of ``batch`` for a model of
    ``config`` (numpy only).

    ``execution.no_replay`` picks the layout (default: replay); ``plan``, when given, is
    ``batch``'s call plan already made (``plan_calls_many`` plans a step's microbatches at once).
    The head's inputs follow ``execution``'s ``logprob_positions`` and fused head (a forward run
    with other settings makes its own).
    """
    cfg = ExecutionConfig.of(execution, mode="compact")
    check_batch(config, batch.batch if isinstance(batch, CompactBatch) else batch)
    cb = batch if isinstance(batch, CompactBatch) else compact(batch)
    if plan is None:
        plan = plan_calls(cb.segment_trees, config.chunk_size)
    layout = build_layout(cb, plan, no_replay=cfg.no_replay)
    head = head_inputs(cb.batch, layout, cfg, config.vocab_size)
    return CompactInputs(cb=cb, plan=plan, layout=layout, no_replay=cfg.no_replay, head=head)


def prepare_trajectory(
    config: HybridConfig, batch: RolloutBatch, execution: ExecutionConfig | None = None
) -> TrajectoryInputs:
    """``batch`` with the LM head's host inputs made ahead for trajectory-wise execution under
    ``execution`` (numpy only): the trajectory-wise counterpart of ``prepare_compact``."""
    cfg = ExecutionConfig.of(execution, mode="trajectory")
    check_batch(config, batch)
    return TrajectoryInputs(batch=batch, head=head_inputs(batch, None, cfg, config.vocab_size))


def prepare_inputs(
    config: HybridConfig,
    inputs: RolloutBatch | CompactBatch | CompactInputs | TrajectoryInputs,
    execution: ExecutionConfig,
) -> ModelInputs:
    """``inputs`` as ``execution``'s mode runs them: prepared ones of that mode as they are
    (``check_prepared``), anything else prepared here, by its batch."""
    if execution.mode == "compact":
        if isinstance(inputs, CompactInputs):
            check_prepared(inputs, execution)
            return inputs
        source = inputs.batch if isinstance(inputs, TrajectoryInputs) else inputs
        return prepare_compact(config, source, execution)
    if execution.mode == "trajectory":
        if isinstance(inputs, TrajectoryInputs):
            return inputs
        batch = inputs.batch if isinstance(inputs, (CompactBatch, CompactInputs)) else inputs
        return prepare_trajectory(config, batch, execution)
    raise ValueError(f"mode must be 'trajectory' or 'compact', got {execution.mode!r}")


def check_prepared(inputs: ModelInputs, execution: ExecutionConfig) -> None:
    """``inputs`` are of ``execution``'s mode (TypeError) and, compact, laid out with its
    ``no_replay`` (ValueError: the model executes the plan it is given and never re-plans)."""
    want = CompactInputs if execution.mode == "compact" else TrajectoryInputs
    if execution.mode not in ("compact", "trajectory"):
        raise ValueError(f"mode must be 'trajectory' or 'compact', got {execution.mode!r}")
    if not isinstance(inputs, want):
        raise TypeError(
            f"HybridLM.forward runs {want.__name__} in {execution.mode} mode, got {type(inputs).__name__}: call the "
            "model (model(batch, config) prepares it) or prepare it with model.prepare_compact / prepare_trajectory"
        )
    if isinstance(inputs, CompactInputs) and inputs.no_replay != execution.no_replay:
        raise ValueError(
            f"these CompactInputs were prepared with no_replay={inputs.no_replay} but the forward "
            f"asks for no_replay={execution.no_replay}; prepare them with the same ExecutionConfig"
        )
