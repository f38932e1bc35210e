"""HybridLM: one hybrid-attention LM, executed trajectory-wise or compactly on the same weights.

    out = model(batch, ExecutionConfig(mode="compact", attention="auto", recompute=False, ...))
    out = model(batch, mode="trajectory")          # the same, fields given as overrides

Every execution switch is a field of ``ExecutionConfig`` (``models/execution/config.py``): one
spelling, one default.

``trajectory``: every trajectory is packed as its own sequence (the baseline and oracle);
its attention runs one causal call per trajectory ("gather") or one call over the packed rows
under a document-causal mask ("mask": FlexAttention on CUDA; one packed call, as a
production trainer's varlen attention makes).
``compact``: ``compact(batch) -> plan_calls -> build_layout``; every layer reads and writes
the P physical rows of that layout (paper §3.4), MoE weights its statistics by multiplicity
q, and log-probs come from ``mapped_logprobs`` (logsumexp once per compact row, §3.5).

``out.logprobs`` [S - N] is in original batch order: for trajectory j, entry
``offsets[j] - j + i`` is log p(x_j[i+1] | x_j[:i+1]). With ``logprob_positions="actions"``
only the entries whose target is an action token are computed; the others are NaN. ``out.moe_losses`` holds per-MoE-layer
router z-loss and load-balancing aux loss ([L_moe] each), ``out.expert_counts`` the
q-weighted top-k assignment counts [L_moe, E] (None without MoE layers).

Shapes: h_TD hidden rows (T = S or P); logits never exceed [S - N, V] (trajectory) or
[row_chunk, V] (compact).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

import harts.models.regions as regions
from harts.models.config import LAYER_TYPES, HybridConfig
from harts.models.execution.backends import Backends, resolve_backends
from harts.models.execution.base import RowContext
from harts.models.execution.config import ExecutionConfig
from harts.models.init import draw_seed, init_weights
from harts.models.layers import MLP, GatedAttention, GatedDeltaNet, KimiDeltaAttention, MoE, MultiheadLatentAttention
from harts.models.layers.norms import RMSNorm, add_rms_norm
from harts.models.recompute import kept_routing, run_core
from harts.ops.logprob.mapped import LogprobIndex, logprob_index
from harts.plan.calls import CallPlan, plan_calls
from harts.plan.layout import Layout, build_layout
from harts.tree.batch import RolloutBatch
from harts.tree.compact import CompactBatch, compact

__all__ = [
    "HybridLM",
    "ModelOutput",
    "CompactInputs",
    "TrajectoryInputs",
    "HeadInputs",
    "head_inputs",
    "DecoderLayer",
    "ExecutionConfig",
]

_MIXERS = {"K": KimiDeltaAttention, "G": GatedDeltaNet, "M": MultiheadLatentAttention, "A": GatedAttention}


@dataclass
class ModelOutput:
    """What one forward returns; see the module docstring."""

    #: [S - N] in batch order; NaN at the entries not computed (``logprob_positions="actions"``:
    #: every entry whose target is not an action token)
    logprobs: torch.Tensor
    moe_losses: dict[str, torch.Tensor] | None = None
    expert_counts: torch.Tensor | None = None
    #: execution facts: mode, rows, calls, replay rows, ... (plain numbers)
    info: dict[str, Any] = field(default_factory=dict)

    def moe_objective(self, z_loss_coef: float, aux_loss_coef: float) -> torch.Tensor | float:
        """``z_coef * sum(z_loss) + aux_coef * sum(aux_loss)`` over MoE layers (0.0 without MoE)."""
        if not self.moe_losses:
            return 0.0
        return z_loss_coef * self.moe_losses["z_loss"].sum() + aux_loss_coef * self.moe_losses["aux_loss"].sum()


@dataclass(frozen=True)
class HeadInputs:
    """The LM head's host inputs for one batch under one ``logprob_positions`` setting: which
    hidden row and target each computed log-prob reads, and the fused head's index bookkeeping.

    ``HybridLM.prepare_compact`` / ``prepare_trajectory`` make them ahead of the forward (numpy
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


class DecoderLayer(nn.Module):
    """Pre-norm block: ``h + mixer(norm h)``, then ``h + ffn(norm h)``."""

    def __init__(self, config: HybridConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.letter = config.layer_pattern[layer_idx]
        mixer = _MIXERS[self.letter](config)
        if LAYER_TYPES[self.letter][0] == "linear":
            self.linear_attn = mixer
        else:
            self.self_attn = mixer
        self.is_moe = config.is_moe_layer(layer_idx)
        self.mlp = MoE(config) if self.is_moe else MLP(config.hidden_size, config.intermediate_size)
        eps, off = config.rms_norm_eps, config.norm_unit_offset
        self.input_layernorm = RMSNorm(config.hidden_size, eps, unit_offset=off)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, unit_offset=off)

    @property
    def mixer(self) -> nn.Module:
        return self.linear_attn if hasattr(self, "linear_attn") else self.self_attn

    def forward(self, h_TD: torch.Tensor, ctx: RowContext) -> tuple[torch.Tensor, ...]:
        """Returns ``(h,)`` for a dense FFN, ``(h, z_loss, aux_loss, counts_E)`` for MoE."""
        norm = self.post_attention_layernorm  # the residual add and this norm in one pass
        h_TD, x = add_rms_norm(
            h_TD, self.mixer(self.input_layernorm(h_TD), ctx), norm.weight, norm.eps, norm.unit_offset
        )
        if not self.is_moe:
            return (h_TD + self.mlp(x),)
        y, z_loss, aux_loss, counts = run_core(
            ctx, self, "moe", functools.partial(self._moe, ctx=ctx), x, ctx.row_weight
        )
        return h_TD + y, z_loss, aux_loss, counts

    def _moe(
        self, x_TD: torch.Tensor, w_T: torch.Tensor, ctx: RowContext
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The MoE block on rows ``x_TD`` (``MoE.forward``). Kept through checkpoint's
        recomputation (``recompute_skip`` has "moe"), it never reruns: its routed experts run
        lean and its expert choice needs no slot."""
        kept = "moe" in getattr(ctx, "recompute_skip", ())
        routing = None if kept else kept_routing(ctx, self)
        keep_gate_up = kept and ctx.moe_keep_gate_up
        fast = ctx.backends.fast_paths
        return self.mlp(x_TD, w_T, routing=routing, lean=kept, keep_gate_up=keep_gate_up, fast=fast)


class HybridLM(nn.Module):
    #: the transformers model type and config a converted model came from (``integrations.hf``)
    hf_source: dict[str, Any] | None = None

    def __init__(self, config: HybridConfig, *, seed: int | None = None) -> None:
        """Build ``config``'s layers and initialise every tensor from ``seed`` (``models/init.py``:
        per tensor name, so a model built on the meta device and sharded gets the same values).
        ``seed=None`` draws it from torch's global generator. Under ``torch.device("meta")`` the
        tensors stay without storage (``harts.parallel.build`` initialises the shards)."""
        super().__init__()
        config.validate()
        self.config = config
        seed = draw_seed() if seed is None else seed
        # the structure on the meta device, then storage where the caller builds (the default
        # device, ``with torch.device(...)`` included) and every tensor's seeded value: the
        # layers' own default inits would draw every parameter once more in float32, only to
        # be overwritten (minutes for the full ling3_tiny)
        target = torch.get_default_device()
        with torch.device("meta"):
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
            self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, unit_offset=config.norm_unit_offset)
            self.lm_head = (
                None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
            )
            self.to(config.torch_dtype())
        if target.type != "meta":
            self.to_empty(device=target)
            init_weights(self, seed)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def backends(self, config: ExecutionConfig | None = None) -> Backends:
        """The kernel record this model runs under ``config`` on its parameters' device and dtype
        (``harts.models.execution.backends``), resolved on first use and kept: one per choice of
        the config's kernel fields, device and dtype (the environment overrides it reads are
        read then). Raises what ``resolve_backends`` raises."""
        cfg = ExecutionConfig() if config is None else config
        weight = self.embed_tokens.weight
        # deterministic algorithms keep FlexAttention off FA4 (its backward uses atomics)
        deterministic = torch.are_deterministic_algorithms_enabled()
        fields = (cfg.attention, cfg.linear_attention_backend, cfg.link_rounds, cfg.fast_paths)
        key = (*fields, weight.device, weight.dtype, deterministic)
        records = self.__dict__.setdefault("_backends", {})
        if key not in records:
            records[key] = resolve_backends(cfg, self.config, weight.device, weight.dtype)
        return records[key]

    # ------------------------------------------------------------------ inputs
    def prepare_compact(
        self, batch: RolloutBatch | CompactBatch, config: ExecutionConfig | None = None, *, plan: CallPlan | None = None
    ) -> CompactInputs:
        """Compaction, call plan, layout and the LM head's host inputs for ``batch`` (numpy only,
        no model state).

        ``config.no_replay`` picks the layout (default: replay); ``plan``, when given, is
        ``batch``'s call plan already made (``plan_calls_many`` plans a step's microbatches at once).
        The head's inputs follow ``config``'s ``logprob_positions`` and fused head (a forward run
        with other settings makes its own).
        """
        cfg = ExecutionConfig.of(config, mode="compact")
        self._check_batch(batch.batch if isinstance(batch, CompactBatch) else batch)
        cb = batch if isinstance(batch, CompactBatch) else compact(batch)
        if plan is None:
            plan = plan_calls(cb.segment_trees, self.config.chunk_size)
        layout = build_layout(cb, plan, no_replay=cfg.no_replay)
        head = head_inputs(cb.batch, layout, cfg, self.config.vocab_size)
        return CompactInputs(cb=cb, plan=plan, layout=layout, no_replay=cfg.no_replay, head=head)

    def prepare_trajectory(self, batch: RolloutBatch, config: ExecutionConfig | None = None) -> TrajectoryInputs:
        """``batch`` with the LM head's host inputs made ahead for trajectory-wise execution under
        ``config`` (numpy only): the trajectory-wise counterpart of ``prepare_compact``."""
        cfg = ExecutionConfig.of(config, mode="trajectory")
        self._check_batch(batch)
        return TrajectoryInputs(batch=batch, head=head_inputs(batch, None, cfg, self.config.vocab_size))

    def _check_batch(self, batch: RolloutBatch) -> None:
        top = int(batch.tokens.max())
        if top >= self.config.vocab_size:
            raise ValueError(f"batch has token id {top} but the model's vocab_size is {self.config.vocab_size}")

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        inputs: RolloutBatch | CompactBatch | CompactInputs | TrajectoryInputs,
        config: ExecutionConfig | None = None,
        **fields: Any,
    ) -> ModelOutput:
        """Run ``inputs`` as ``config`` says (module docstring); ``fields`` override its fields.

        Args:
            inputs: a ``RolloutBatch`` or ``CompactBatch`` (compact mode prepares it here), or
                ``CompactInputs`` from ``prepare_compact`` / ``TrajectoryInputs`` from
                ``prepare_trajectory`` (planning kept out of a timed region). Either mode takes
                the other's prepared inputs by their batch.
            config: ``ExecutionConfig`` (default ``ExecutionConfig()``: compact, attention auto).
            **fields: ``ExecutionConfig`` fields, e.g. ``mode="trajectory"``.

        Returns:
            ``ModelOutput``: ``logprobs`` [S - N] in batch order (module docstring). With
            ``logprob_positions="actions"`` only the entries ``batch.action_logprob_entries()``
            are computed (the LM head runs on those positions only) and every other entry is
            NaN, never a silent 0; gradients flow into the computed entries only.
            ``info["logit_positions"]`` is the number of positions the LM head computed.

        Raises:
            ValueError: ``CompactInputs`` prepared with another ``no_replay`` than ``config``'s
                (the model executes the plan it is given and never re-plans).
        """
        cfg = ExecutionConfig.of(config, **fields)
        mode, recompute, no_replay = cfg.mode, cfg.recompute, cfg.no_replay
        device = self.embed_tokens.weight.device
        backends = self.backends(cfg)
        attention = backends.attention
        if mode == "trajectory":
            from harts.models.execution.trajectory import TrajectoryContext

            batch = inputs.batch if isinstance(inputs, (CompactBatch, CompactInputs, TrajectoryInputs)) else inputs
            prepared_head = inputs.head if isinstance(inputs, TrajectoryInputs) else None
            self._check_batch(batch)
            ctx: RowContext = TrajectoryContext(batch, self.config.chunk_size, device, backends)
            tokens = torch.as_tensor(batch.tokens).to(device, non_blocking=True)
            info: dict[str, Any] = {"mode": "trajectory", "rows": batch.num_tokens, "calls": 1, "replay_rows": 0}
        elif mode == "compact":
            from harts.models.execution.compact import CompactContext

            if isinstance(inputs, TrajectoryInputs):
                inputs = self.prepare_compact(inputs.batch, cfg)
            elif not isinstance(inputs, CompactInputs):
                inputs = self.prepare_compact(inputs, cfg)
            elif inputs.no_replay != no_replay:
                raise ValueError(
                    f"these CompactInputs were prepared with no_replay={inputs.no_replay} but the forward "
                    f"asks for no_replay={no_replay}; prepare them with the same ExecutionConfig"
                )
            batch = inputs.batch
            prepared_head = inputs.head
            self._check_batch(batch)
            ctx = CompactContext(inputs.layout, device=device, backends=backends)
            tokens = torch.as_tensor(inputs.layout.tokens).to(device, non_blocking=True)
            info = {
                "mode": "compact",
                "rows": ctx.num_rows,
                "compact_rows": inputs.cb.num_compact_tokens,
                "calls": ctx.num_calls,
                "replay_rows": ctx.num_replay_rows,
                "boundary_states": ctx.num_boundary_states,
                "attention": attention,
                "no_replay": no_replay,
            }
        else:
            raise ValueError(f"mode must be 'trajectory' or 'compact', got {mode!r}")
        info["recompute"] = recompute

        info["recompute_skip"] = list(cfg.recompute_skip)
        n_ckpt = cfg.checkpointed_layers(len(self.layers)) if torch.is_grad_enabled() else 0
        n_moe = sum(1 for layer in self.layers if layer.is_moe)
        if cfg.moe_keep_gate_up > n_moe:
            raise ValueError(f"moe_keep_gate_up={cfg.moe_keep_gate_up}, but the model has {n_moe} MoE layers")
        info["checkpointed_layers"] = n_ckpt

        h = self.embed_tokens(tokens)
        z_losses, aux_losses, counts = [], [], []
        moe_seen = 0
        for i, layer in enumerate(self.layers):
            # what a layer's cores read (``harts.models.recompute``): whether it checkpoints
            checkpointing = i < n_ckpt
            ctx.checkpointing = checkpointing
            ctx.recompute_skip = cfg.recompute_skip if checkpointing else ()
            # the first ``moe_keep_gate_up`` MoE layers keep their gate/up output (lean experts)
            is_moe = bool(layer.is_moe)
            ctx.moe_keep_gate_up = is_moe and moe_seen < cfg.moe_keep_gate_up
            moe_seen += is_moe
            if checkpointing:
                # a kept MoE block (the layer's last saving op) must still be reached by the
                # recomputation, which takes its stored output: no early stop then
                with set_checkpoint_early_stop("moe" not in cfg.recompute_skip):
                    outs = checkpoint(layer, h, ctx, use_reentrant=False)
            else:
                outs = layer(h, ctx)
            h = outs[0]
            if len(outs) > 1:
                z_losses.append(outs[1])
                aux_losses.append(outs[2])
                counts.append(outs[3])
        # checkpoint's recomputations (in the backward) rerun the first n_ckpt layers only
        ctx.checkpointing = n_ckpt > 0
        ctx.recompute_skip = cfg.recompute_skip if n_ckpt else ()
        h = self.norm(h)

        head = prepared_head
        if head is None or not head.serves(cfg):
            layout = inputs.layout if mode == "compact" and isinstance(inputs, CompactInputs) else None
            head = head_inputs(batch, layout, cfg, self.config.vocab_size)
        entries = head.entries
        info["logit_positions"] = int(head.rows.size)
        # host tensors: the head's index plan lives on the host (no device sync)
        rows, targets = torch.as_tensor(head.rows), torch.as_tensor(head.targets)
        h, head_weight = regions.enter("lm_head", h, self.lm_head_weight)
        if cfg.use_fused_logprobs:
            from harts.ops.logprob import mapped_logprobs

            logprobs = mapped_logprobs(
                h, head_weight, rows, targets, keep_probs=cfg.keep_lm_head_probs, index=head.index
            )
        else:
            rows, targets = rows.to(device, non_blocking=True), targets.to(device, non_blocking=True)
            logits = torch.nn.functional.linear(h[rows], head_weight)
            logprobs = torch.log_softmax(logits, dim=-1).gather(1, targets[:, None])[:, 0]
        (logprobs,) = regions.exit("lm_head", logprobs)
        if entries is not None:
            # NaN where nothing was computed, so that any use of those entries is loud; the
            # out-of-place index_copy sends gradients to the computed entries only
            index = torch.as_tensor(entries).to(logprobs.device, non_blocking=True)
            logprobs = logprobs.new_full((batch.num_logprobs,), float("nan")).index_copy(0, index, logprobs)

        if not z_losses:
            return ModelOutput(logprobs=logprobs, info=info)
        return ModelOutput(
            logprobs=logprobs,
            moe_losses={"z_loss": torch.stack(z_losses), "aux_loss": torch.stack(aux_losses)},
            expert_counts=torch.stack(counts),
            info=info,
        )

    # ------------------------------------------------------------------ MoE balancing
    @torch.no_grad()
    def update_expert_bias(self, expert_counts: torch.Tensor, rate: float = 1e-3) -> None:
        """Aux-loss-free balancing (DeepSeek-V3): ``bias += rate * sign(mean(counts) - counts)``.

        ``expert_counts`` [L_moe, E] is ``ModelOutput.expert_counts`` (q-weighted in compact mode,
        so the update equals the trajectory-wise one).
        """
        moe = [layer.mlp for layer in self.layers if isinstance(layer.mlp, MoE)]
        if expert_counts.shape[0] != len(moe):
            raise ValueError(f"expert_counts has {expert_counts.shape[0]} rows for {len(moe)} MoE layers")
        for m, c in zip(moe, expert_counts):
            b = m.gate.e_score_correction_bias
            assert isinstance(b, torch.Tensor)
            b += rate * torch.sign(c.mean() - c).to(b.dtype)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
