"""``ExecutionConfig``: how a forward pass executes, never what it computes.

One frozen dataclass, one spelling, one default for every execution switch. ``HybridLM.forward``
takes it (or its fields as keyword overrides), ``HybridLM.prepare_compact`` reads
``no_replay`` from it, and ``TrainConfig``, ``run_step``, ``harts bench`` / ``harts compare`` /
``harts train`` pass one along. Every kernel choice is a name from ``harts.ops.registry`` (the
CLI's choices come from there too), so a backend added there works here without a change; the
old spelling "tree_linked" is mapped there, once, to "tree" with ``link_rounds``. What the
choices resolve to on one device, for one model, is the kernel record
(``harts.models.execution.backends.Backends``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from harts.errors import UserError
from harts.ops.attention.flex_tiles import FLEX_MAX_HEAD_DIM
from harts.ops.registry import ATTENTION_IMPLS, FAST_PATHS, canonical_linear_attn

__all__ = [
    "ATTENTION_IMPLS",
    "FAST_PATHS",
    "LOGPROB_POSITIONS",
    "MODES",
    "SKIPPABLE_CORES",
    "FLEX_MAX_HEAD_DIM",
    "FLEX_MIN_HEAD_DIM",
    "ExecutionConfig",
    "attention_head_dim_range",
    "check_recompute_skip",
]

MODES = ("compact", "trajectory")
LOGPROB_POSITIONS = ("all", "actions")
#: cores that ``ExecutionConfig.recompute_skip`` may name (region names of ``harts.models.regions``;
#: ``harts.models.recompute`` runs them)
SKIPPABLE_CORES = ("attention", "linear_attention", "moe")
#: FlexAttention (torch 2.11) lowers on CUDA only for query/key/value head dims of at least 16
FLEX_MIN_HEAD_DIM = 16


@dataclass(frozen=True, kw_only=True, slots=True)
class ExecutionConfig:
    """Execution switches of one forward pass (the same weights give the same results up to
    rounding under every setting; float64 tests hold them to 1e-9)."""

    #: "compact" (harts: every shared token once, paper §3.4) or "trajectory" (every
    #: root-to-leaf path packed separately: the baseline and oracle)
    mode: str = "compact"
    #: full attention: "gather" (one dense call per trajectory / ancestor-view branch), "mask"
    #: (one packed call under a tree or document-causal mask: FlexAttention on CUDA) or "auto"
    #: ("mask" on CUDA, "gather" elsewhere)
    attention: str = "auto"
    #: recompute every layer in the backward pass (activation checkpointing)
    recompute: bool = False
    #: with ``recompute``: cores not rerun in the backward, their forward outputs and saved
    #: tensors kept instead (``harts.models.recompute``): "attention", "linear_attention" and /
    #: or "moe" (the MoE block, its routed experts then keeping only their inputs)
    recompute_skip: tuple[str, ...] = ()
    #: with ``recompute``: how many decoder layers run under checkpoint, the first ones (None:
    #: all). The others keep their activations: less recomputation for more memory, as
    #: Megatron's ``--recompute-num-layers``. The first layers are the ones checkpointed because
    #: their recomputation runs last in the backward, when the kept layers' activations are
    #: already freed.
    recompute_layers: int | None = None
    #: with "moe" in ``recompute_skip`` (lean routed experts): how many MoE layers, the first
    #: ones, keep their gate/up GEMM output [T x K, 2I] for the backward instead of recomputing
    #: it there (one grouped GEMM fewer per layer for T x K x 2I half-precision entries: 1.07 GB
    #: per layer at 65,536 rows of ``ling3_tiny``); gradients unchanged. 0: none (default)
    moe_keep_gate_up: int = 0
    #: linear-attention core, one of ``harts.ops.registry.LINEAR_ATTN_BACKENDS`` ("reference":
    #: torch, any device; "auto": the tree kernel where fla-core runs the model's chunk size);
    #: the old name "tree_linked" is taken as "tree" with ``link_rounds=True``
    linear_attention_backend: str = "reference"
    #: compact execution with the tree kernel: a microbatch's rounds linked into one
    #: linear-attention op per layer (``linked_tree_linear_attn``; the same states). None: linked
    #: under "auto", one call per round under an explicit "tree" (the two sides of an A/B). With
    #: another operator (the reference, fla's split path) there is nothing to link: ignored
    link_rounds: bool | None = None
    #: the layers' fast paths in use, names from ``FAST_PATHS`` (every other one runs the code
    #: it replaces, its reference); a named path still runs only where it can (fla's gate needs
    #: CUDA and fla-core, the fused kernels fall back to torch where their kernel does not
    #: apply). None: the defaults, ``harts.models.execution.backends.default_fast_paths``
    fast_paths: tuple[str, ...] | None = None
    #: ablation: side branches start from the fork's exact state instead of replaying from the
    #: chunk anchor (a planning choice: ``prepare_compact`` builds the layout for it)
    no_replay: bool = False
    #: log-probs by ``mapped_logprobs`` (chunked, never [S, V]); None: in compact mode only
    #: (trajectory mode's plain log_softmax is the oracle; benchmarks pass True for both)
    fused_logprobs: bool | None = None
    #: where the LM head runs: "all" (every predicting position) or "actions" (only positions
    #: whose target is an action token, ``RolloutBatch.action_logprob_entries``: what an RL
    #: loss reads; the other log-prob entries are NaN). Both modes honour it.
    logprob_positions: str = "all"
    #: the LM head's backward: True keeps every logits chunk's softmax from the forward (one GEMM
    #: fewer per chunk; rows x V half-precision entries of memory until the backward), False
    #: recomputes the logits, None: on CUDA with half precision the first chunks whose softmax
    #: fits in ``lm_head_budget`` are kept, the others recomputed (``harts.ops.logprob.
    #: mapped_logprobs``' ``keep_probs``)
    keep_lm_head_probs: bool | None = None
    #: the chunked LM head's memory budget in bytes: one chunk's logits fit in it, and under
    #: ``keep_lm_head_probs=None`` so does the kept softmax; the head then never holds a
    #: whole-vocabulary softmax for all rows. None: ``harts.ops.logprob.mapped.head_budget`` (256
    #: MiB on the CPU, a sixteenth of the device's total memory on CUDA)
    lm_head_budget: int | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise UserError(f"mode must be 'trajectory' or 'compact', got {self.mode!r}")
        if self.attention not in ATTENTION_IMPLS:
            raise UserError(f"attention must be 'gather', 'mask' or 'auto', got {self.attention!r}")
        if self.link_rounds is not None and not isinstance(self.link_rounds, bool):
            raise UserError(f"link_rounds must be True, False or None, got {self.link_rounds!r}")
        self._canonical_linear_attention()
        _check_names("fast_paths", self.fast_paths, FAST_PATHS)
        check_recompute_skip(self.recompute_skip, self.recompute)
        if self.recompute_layers is not None:
            if isinstance(self.recompute_layers, bool) or not isinstance(self.recompute_layers, int):
                raise UserError(f"recompute_layers must be an integer or None, got {self.recompute_layers!r}")
            if self.recompute_layers < 0:
                raise UserError(f"recompute_layers must be >= 0, got {self.recompute_layers}")
            if not self.recompute:
                raise UserError(
                    f"recompute_layers={self.recompute_layers} needs recompute=True "
                    "(without recomputation no layer is checkpointed)"
                )
        if isinstance(self.moe_keep_gate_up, bool) or not isinstance(self.moe_keep_gate_up, int):
            raise UserError(f"moe_keep_gate_up must be an integer, got {self.moe_keep_gate_up!r}")
        if self.moe_keep_gate_up < 0:
            raise UserError(f"moe_keep_gate_up must be >= 0, got {self.moe_keep_gate_up}")
        if self.moe_keep_gate_up and "moe" not in self.recompute_skip:
            raise UserError(
                f"moe_keep_gate_up={self.moe_keep_gate_up} needs recompute=True with 'moe' in recompute_skip "
                "(only the lean routed experts of a kept MoE block recompute their gate/up output)"
            )
        if self.lm_head_budget is not None and (
            isinstance(self.lm_head_budget, bool) or not isinstance(self.lm_head_budget, int) or self.lm_head_budget < 1
        ):
            raise UserError(f"lm_head_budget must be a positive number of bytes or None, got {self.lm_head_budget!r}")
        if self.logprob_positions not in LOGPROB_POSITIONS:
            raise UserError(f"logprob_positions must be 'all' or 'actions', got {self.logprob_positions!r}")

    def _canonical_linear_attention(self) -> None:
        """The old spelling of a linear-attention backend replaced by its backend and
        ``link_rounds`` (the one mapping: ``harts.ops.registry.LINEAR_ATTN_ALIASES``)."""
        backend, link = canonical_linear_attn(self.linear_attention_backend)
        if link is None:
            return
        if self.link_rounds is not None and self.link_rounds != link:
            raise UserError(
                f"linear_attention_backend={self.linear_attention_backend!r} means {backend!r} with "
                f"link_rounds={link}, but link_rounds={self.link_rounds} was given"
            )
        # frozen: the normalized fields are set once, here, while the instance is made
        object.__setattr__(self, "linear_attention_backend", backend)
        object.__setattr__(self, "link_rounds", link)

    @classmethod
    def of(cls, config: ExecutionConfig | None = None, **fields: Any) -> ExecutionConfig:
        """``config`` (default: ``ExecutionConfig()``) with ``fields`` replaced; an unknown
        field name is a TypeError."""
        base = cls() if config is None else config
        return replace(base, **fields) if fields else base

    @property
    def use_fused_logprobs(self) -> bool:
        return self.mode == "compact" if self.fused_logprobs is None else self.fused_logprobs

    def checkpointed_layers(self, num_layers: int) -> int:
        """How many of a model's ``num_layers`` decoder layers (the first ones) run under
        checkpoint: 0 without ``recompute``; ValueError if ``recompute_layers`` exceeds them."""
        if not self.recompute:
            return 0
        if self.recompute_layers is None:
            return num_layers
        if self.recompute_layers > num_layers:
            raise UserError(f"recompute_layers={self.recompute_layers}, but the model has {num_layers} decoder layers")
        return self.recompute_layers

    def resolved_attention(
        self,
        device_type: str,
        min_head_dim: int | None = None,
        max_head_dim: int | None = None,
        *,
        flash_views: bool = False,
    ) -> str:
        """ "gather" or "mask": ``attention`` with "auto" decided for ``device_type`` and the
        model's smallest and largest attention head dims (``attention_head_dim_range``).

        ``flash_views``: every attention kind of the model runs on FlashAttention-2's varlen
        kernel here (``flash_views_run``). "auto" then gathers: on CUDA the gather path is one
        varlen call over ancestor views, which visits exactly the visible pairs; on Hopper it
        ran trees' forward + backward 1.8-2.0x faster than FlexAttention's tree mask at head dims
        128 and 256 (16 query over 2 KV heads; ``python -m benchmarks.ops.tree_mask_vs_causal``,
        docs/gpu.md has the figures; other head dims and head counts were not timed).

        On CUDA the mask path runs FlexAttention, which takes head dims ``FLEX_MIN_HEAD_DIM`` to
        ``FLEX_MAX_HEAD_DIM`` (16 to 256: below, it does not lower; above, no tile of
        ``harts.ops.attention.flex_tiles`` was tried); "auto" gathers outside that range, and an
        explicit "mask" there is a ``UserError`` naming the head dim, raised before any work."""
        why = _flex_refuses(device_type, min_head_dim, max_head_dim)
        if self.attention == "mask" and why is not None:
            raise UserError(f"attention='mask' {why}: use attention='gather' or 'auto'")
        if self.attention != "auto":
            return self.attention
        if device_type == "cuda" and flash_views:
            return "gather"
        # one FlexAttention call per layer on CUDA (launch-bound otherwise); per-branch dense
        # calls on CPU, where the dense tree mask costs more than the loop
        return "mask" if device_type == "cuda" and why is None else "gather"


def flash_views_run(head_dims: Mapping[str, tuple[int, int, bool]], device: Any, dtype: Any) -> bool:
    """Whether every attention kind of ``HybridConfig.attention_head_dims`` ({letter: (qk dim,
    v dim, grouped)}) runs on FlashAttention-2's varlen kernel (``flash_varlen_refusal``) on
    ``device`` in ``dtype``; False without full attention."""
    from harts.ops.attention.flash_varlen import flash_varlen_refusal

    if not head_dims or getattr(device, "type", device) != "cuda":
        return False
    return all(flash_varlen_refusal(device, dtype, qk, v) is None for qk, v, _ in head_dims.values())


def attention_head_dim_range(head_dims: Mapping[str, tuple[int, int, bool]]) -> tuple[int | None, int | None]:
    """(smallest, largest) query/key or value head dim of ``HybridConfig.attention_head_dims``
    ({letter: (qk dim, v dim, grouped)}); (None, None) without full attention."""
    dims = [d for qk, v, _ in head_dims.values() for d in (qk, v)]
    return (min(dims), max(dims)) if dims else (None, None)


def _flex_refuses(device_type: str, min_head_dim: int | None, max_head_dim: int | None) -> str | None:
    """Why the mask path cannot run these head dims on ``device_type`` (None: it can; the CPU's
    dense mask takes any)."""
    if device_type != "cuda":
        return None
    if min_head_dim is not None and min_head_dim < FLEX_MIN_HEAD_DIM:
        return (
            f"runs FlexAttention, which on CUDA needs attention head dims >= {FLEX_MIN_HEAD_DIM}; "
            f"this model's smallest is {min_head_dim}"
        )
    if max_head_dim is not None and max_head_dim > FLEX_MAX_HEAD_DIM:
        return (
            f"runs FlexAttention, which on CUDA takes attention head dims up to {FLEX_MAX_HEAD_DIM}; this model's "
            f"largest is {max_head_dim} (tried: the Triton kernel, whose tiles fit shared memory up to head dim "
            f"{FLEX_MAX_HEAD_DIM}, and FA4's flash backend, up to 256)"
        )
    return None


def _check_names(field: str, names: tuple[str, ...] | None, known: tuple[str, ...]) -> None:
    """ValueError naming the offending entry unless ``names`` is None or a tuple of distinct
    ``known`` names."""
    if names is None:
        return
    if not isinstance(names, tuple):
        raise UserError(f"{field} must be a tuple of names or None, got {names!r}")
    for name in names:
        if name not in known:
            raise UserError(f"{field}: unknown name {name!r}; known: {', '.join(known)}")
    if len(set(names)) != len(names):
        raise UserError(f"{field} names an entry twice: {names}")


def check_recompute_skip(skip: tuple[str, ...], recompute: bool) -> None:
    """Raise ValueError naming the offending entry unless ``skip`` lists distinct
    ``SKIPPABLE_CORES`` and recompute is on (without recomputation nothing is rerun)."""
    if isinstance(skip, str):
        raise UserError(f"recompute_skip must be a tuple of core names, got the string {skip!r}")
    for name in skip:
        if name not in SKIPPABLE_CORES:
            raise UserError(f"recompute_skip: unknown core {name!r}; known: {', '.join(SKIPPABLE_CORES)}")
    if len(set(skip)) != len(skip):
        raise UserError(f"recompute_skip names a core twice: {skip}")
    if skip and not recompute:
        raise UserError(f"recompute_skip={skip} needs recompute=True (without recomputation nothing is rerun)")
