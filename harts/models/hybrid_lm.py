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

Input preparation is ``harts.models.execution.inputs``: calling the model prepares what it is
given for the mode (``prepare_inputs``), then ``forward`` executes the prepared inputs' fixed
plan; ``prepare_compact`` / ``prepare_trajectory`` make them ahead (a training step prepares
microbatch k + 1 while k runs).

``out.logprobs`` [S - N] is in original batch order: for trajectory j, entry
``offsets[j] - j + i`` is log p(x_j[i+1] | x_j[:i+1]). With ``logprob_positions="actions"``
only the entries whose target is an action token are computed; the others are NaN. ``out.moe_losses`` holds per-MoE-layer
router z-loss and load-balancing aux loss ([L_moe] each), ``out.expert_counts`` the
q-weighted top-k assignment counts [L_moe, E] (None without MoE layers).

Shapes: h_TD hidden rows (T = S or P); logits never exceed [S - N, V] (the plain head,
trajectory mode's oracle) or one chunk of ``ExecutionConfig.lm_head_budget`` bytes (the chunked
head, ``mapped_logprobs``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

import harts.models.regions as regions
from harts.models.config import HybridConfig
from harts.models.execution.backends import Backends, resolve_backends
from harts.models.execution.base import RowContext
from harts.models.execution.config import ExecutionConfig
from harts.models.execution.inputs import (
    CompactInputs,
    HeadInputs,
    ModelInputs,
    TrajectoryInputs,
    check_batch,
    check_prepared,
    head_inputs,
    prepare_compact,
    prepare_inputs,
    prepare_trajectory,
)
from harts.models.init import draw_seed, init_weights
from harts.models.layers import MLP, MoE
from harts.models.layers.norms import RMSNorm, add_rms_norm
from harts.models.layers.registry import mixer_spec
from harts.models.layers.spec import MixerSpec
from harts.models.recompute import kept_routing, run_core
from harts.plan.calls import CallPlan
from harts.tree.batch import RolloutBatch
from harts.tree.compact import CompactBatch

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


class DecoderLayer(nn.Module):
    """Pre-norm blocks: the mixer block ``h + mixer(input_layernorm h)``, then the FFN block
    ``h + ffn(post_attention_layernorm h)``. Either block may be absent (``layer_pattern`` "-",
    ``ffn_pattern`` "-"): Nemotron-H's layers are one block each. The mixer is the registry's
    (``harts.models.layers.registry``), held under its spec's attribute (``linear_attn``,
    ``self_attn``, ``mamba``); ``mlp`` is None without an FFN."""

    def __init__(self, config: HybridConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.letter = config.layer_pattern[layer_idx]
        spec = self.spec
        if spec is not None:
            setattr(self, spec.attribute, spec.module(config))
        self.is_moe = config.is_moe_layer(layer_idx)
        #: Granite's scale of each block's output before its residual add (1.0: none)
        self.residual_multiplier = config.residual_multiplier
        self.mlp: nn.Module | None = None
        if config.has_ffn(layer_idx):
            self.mlp = (
                MoE(config) if self.is_moe else MLP(config.hidden_size, config.intermediate_size, config.hidden_act)
            )
        eps, off = config.rms_norm_eps, config.norm_unit_offset
        if spec is not None:
            self.input_layernorm = RMSNorm(config.hidden_size, eps, unit_offset=off)
        if self.mlp is not None:
            self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, unit_offset=off)

    @property
    def spec(self) -> MixerSpec | None:
        """The mixer's registry entry (``harts.models.layers.registry``); None without a mixer."""
        return mixer_spec(self.letter)

    @property
    def mixer(self) -> nn.Module | None:
        """The token mixer, None in an FFN-only layer."""
        spec = self.spec
        return None if spec is None else getattr(self, spec.attribute)

    def forward(self, h_TD: torch.Tensor, ctx: RowContext) -> tuple[torch.Tensor, ...]:
        """Returns ``(h,)`` for a dense FFN or none, ``(h, z_loss, aux_loss, counts_E)`` for MoE."""
        mixer, mlp = self.mixer, self.mlp
        if mixer is None:
            x = self.post_attention_layernorm(h_TD)
        else:
            out = self._scaled(mixer(self.input_layernorm(h_TD), ctx))
            if mlp is None:
                return (h_TD + out,)
            norm = self.post_attention_layernorm  # the residual add and this norm in one pass
            h_TD, x = add_rms_norm(h_TD, out, norm.weight, norm.eps, norm.unit_offset)
        assert mlp is not None  # HybridConfig refuses a layer with neither block
        if not self.is_moe:
            return (h_TD + self._scaled(mlp(x)),)
        y, z_loss, aux_loss, counts = run_core(
            ctx, self, "moe", functools.partial(self._moe, ctx=ctx), x, ctx.row_weight
        )
        return h_TD + self._scaled(y), z_loss, aux_loss, counts

    def _scaled(self, y_TD: torch.Tensor) -> torch.Tensor:
        """A block's output times ``residual_multiplier`` (untouched at 1.0)."""
        return y_TD if self.residual_multiplier == 1.0 else y_TD * self.residual_multiplier

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
        assert self.mlp is not None  # only MoE layers run this
        return self.mlp(x_TD, w_T, routing=routing, lean=kept, keep_gate_up=keep_gate_up, fast=fast)


def _recompute_timed(layer: nn.Module) -> Any:  # noqa: ANN401
    """``layer`` as checkpoint's function: its recomputation, when a region timer runs, inside
    ``regions.recompute_span`` (the layer's recomputed work outside its core regions timed as
    its own, not inside the backward region that triggered it); the forward unchanged."""

    def run(h_TD: torch.Tensor, ctx: Any) -> Any:  # noqa: ANN401
        with regions.recompute_span():
            return layer(h_TD, ctx)

    return run


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
        """``harts.models.execution.inputs.prepare_compact`` for this model (numpy only, no model
        state): compaction, call plan, layout and the LM head's host inputs of ``batch``."""
        return prepare_compact(self.config, batch, config, plan=plan)

    def prepare_trajectory(self, batch: RolloutBatch, config: ExecutionConfig | None = None) -> TrajectoryInputs:
        """``harts.models.execution.inputs.prepare_trajectory`` for this model (numpy only)."""
        return prepare_trajectory(self.config, batch, config)

    def __call__(
        self,
        inputs: RolloutBatch | CompactBatch | CompactInputs | TrajectoryInputs,
        config: ExecutionConfig | None = None,
        **fields: Any,
    ) -> ModelOutput:
        """``forward`` of ``inputs`` prepared for ``config``'s mode (``prepare_inputs``: a batch is
        compacted and planned here, before the forward; prepared inputs of that mode pass as they
        are); ``fields`` override ``config``'s fields, e.g. ``mode="trajectory"``."""
        cfg = ExecutionConfig.of(config, **fields)
        return super().__call__(prepare_inputs(self.config, inputs, cfg), cfg)

    # ------------------------------------------------------------------ forward
    def forward(self, inputs: ModelInputs, config: ExecutionConfig | None = None) -> ModelOutput:
        """Run prepared ``inputs`` as ``config`` says (module docstring); the model executes the
        plan it is given and never plans (call the model to prepare a batch first).

        Args:
            inputs: ``CompactInputs`` (``prepare_compact``) in compact mode, ``TrajectoryInputs``
                (``prepare_trajectory``) trajectory-wise.
            config: ``ExecutionConfig`` (default ``ExecutionConfig()``: compact, attention auto).

        Returns:
            ``ModelOutput``: ``logprobs`` [S - N] in batch order (module docstring). With
            ``logprob_positions="actions"`` only the entries ``batch.action_logprob_entries()``
            are computed (the LM head runs on those positions only) and every other entry is
            NaN, never a silent 0; gradients flow into the computed entries only.
            ``info["logit_positions"]`` is the number of positions the LM head computed.

        Raises:
            TypeError: inputs prepared for the other mode, or not prepared.
            ValueError: ``CompactInputs`` prepared with another ``no_replay`` than ``config``'s.
        """
        cfg = ExecutionConfig.of(config)
        check_prepared(inputs, cfg)
        check_batch(self.config, inputs.batch)
        ctx, tokens, info = self._context(inputs, cfg)
        h = self.embed_tokens(tokens)
        if self.config.embedding_multiplier != 1.0:
            h = h * self.config.embedding_multiplier
        h, moe = self._layers(h, ctx, cfg, info)
        logprobs = self._head(self.norm(h), inputs, cfg, info)
        if moe is None:
            return ModelOutput(logprobs=logprobs, info=info)
        z_loss, aux_loss, counts = moe
        return ModelOutput(
            logprobs=logprobs, moe_losses={"z_loss": z_loss, "aux_loss": aux_loss}, expert_counts=counts, info=info
        )

    def _context(self, inputs: ModelInputs, cfg: ExecutionConfig) -> tuple[RowContext, torch.Tensor, dict[str, Any]]:
        """The layers' row context of ``inputs``, the token ids of its rows [T] on the model's
        device, and the execution facts (``ModelOutput.info``)."""
        device = self.embed_tokens.weight.device
        backends = self.backends(cfg)
        if isinstance(inputs, TrajectoryInputs):
            from harts.models.execution.trajectory import TrajectoryContext

            batch = inputs.batch
            ctx: RowContext = TrajectoryContext(batch, self.config.chunk_size, device, backends)
            tokens = torch.as_tensor(batch.tokens).to(device, non_blocking=True)
            info: dict[str, Any] = {"mode": "trajectory", "rows": batch.num_tokens, "calls": 1, "replay_rows": 0}
        else:
            from harts.models.execution.compact import CompactContext

            ctx = CompactContext(inputs.layout, device=device, backends=backends)
            tokens = torch.as_tensor(inputs.layout.tokens).to(device, non_blocking=True)
            info = {
                "mode": "compact",
                "rows": ctx.num_rows,
                "compact_rows": inputs.cb.num_compact_tokens,
                "calls": ctx.num_calls,
                "replay_rows": ctx.num_replay_rows,
                "boundary_states": ctx.num_boundary_states,
                "attention": backends.attention,
                "no_replay": cfg.no_replay,
            }
        info["recompute"] = cfg.recompute
        info["recompute_skip"] = list(cfg.recompute_skip)
        return ctx, tokens, info

    def _layers(
        self, h_TD: torch.Tensor, ctx: RowContext, cfg: ExecutionConfig, info: dict[str, Any]
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None]:
        """Every decoder layer on the rows ``h_TD``, the first ``cfg.checkpointed_layers``
        recomputed in the backward; returns the last hidden rows and, with MoE layers, their
        z-losses [L_moe], aux losses [L_moe] and expert counts [L_moe, E]."""
        n_ckpt = cfg.checkpointed_layers(len(self.layers)) if torch.is_grad_enabled() else 0
        n_moe = sum(1 for layer in self.layers if layer.is_moe)
        if cfg.moe_keep_gate_up > n_moe:
            raise ValueError(f"moe_keep_gate_up={cfg.moe_keep_gate_up}, but the model has {n_moe} MoE layers")
        info["checkpointed_layers"] = n_ckpt
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
                    outs = checkpoint(_recompute_timed(layer), h_TD, ctx, use_reentrant=False)
            else:
                outs = layer(h_TD, ctx)
            h_TD = outs[0]
            if len(outs) > 1:
                z_losses.append(outs[1])
                aux_losses.append(outs[2])
                counts.append(outs[3])
        # checkpoint's recomputations (in the backward) rerun the first n_ckpt layers only
        ctx.checkpointing = n_ckpt > 0
        ctx.recompute_skip = cfg.recompute_skip if n_ckpt else ()
        if not z_losses:
            return h_TD, None
        return h_TD, (torch.stack(z_losses), torch.stack(aux_losses), torch.stack(counts))

    def _head(
        self, h_TD: torch.Tensor, inputs: ModelInputs, cfg: ExecutionConfig, info: dict[str, Any]
    ) -> torch.Tensor:
        """Log-probs [S - N] in batch order from the final hidden rows ``h_TD`` (module docstring)."""
        batch = inputs.batch
        head = inputs.head
        if head is None or not head.serves(cfg):
            layout = inputs.layout if isinstance(inputs, CompactInputs) else None
            head = head_inputs(batch, layout, cfg, self.config.vocab_size)
        entries = head.entries
        info["logit_positions"] = int(head.rows.size)
        # host tensors: the head's index plan lives on the host (no device sync)
        rows, targets = torch.as_tensor(head.rows), torch.as_tensor(head.targets)
        if self.config.logits_scaling != 1.0:  # logits / s, as (h / s) W^T: the head is linear
            h_TD = h_TD / self.config.logits_scaling
        h_TD, head_weight = regions.enter("lm_head", h_TD, self.lm_head_weight)
        if cfg.use_fused_logprobs:
            from harts.ops.logprob import mapped_logprobs

            logprobs = mapped_logprobs(
                h_TD,
                head_weight,
                rows,
                targets,
                budget=cfg.lm_head_budget,
                keep_probs=cfg.keep_lm_head_probs,
                index=head.index,
            )
        else:
            device = h_TD.device
            rows, targets = rows.to(device, non_blocking=True), targets.to(device, non_blocking=True)
            logits = torch.nn.functional.linear(h_TD[rows], head_weight)
            logprobs = torch.log_softmax(logits, dim=-1).gather(1, targets[:, None])[:, 0]
        (logprobs,) = regions.exit("lm_head", logprobs)
        if entries is not None:
            # NaN where nothing was computed, so that any use of those entries is loud; the
            # out-of-place index_copy sends gradients to the computed entries only
            index = torch.as_tensor(entries).to(logprobs.device, non_blocking=True)
            logprobs = logprobs.new_full((batch.num_logprobs,), float("nan")).index_copy(0, index, logprobs)
        return logprobs

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
