"""RowContext: what a layer may ask about the rows it runs on.

Layers are written once and never see trees or trajectories. Every decoder layer reads
and writes ``T`` rows (semantic positions in trajectory mode, physical rows in compact
mode) and delegates the three operations that couple rows to its context:

    short_conv         causal depthwise conv over each row's true predecessors
    linear_attention   the chunkwise linear-attention core: the delta rule (KDA / GDN) or the
                       plain decayed recurrence (Mamba-2's SSD), ``rule``
    attention          causal softmax attention (full-attention layers)

It also carries the kernel record (``backends``: which implementation of every choice runs,
``harts.models.execution.backends``), from which the layers read their fast paths; plus two
per-row inputs: ``position`` (RoPE id inside the original trajectory) and
``row_weight`` (semantic multiplicity q; 1 per row in trajectory mode, 0 for padding),
which MoE uses to weight its router losses and expert counts.

Shapes: ``x_TD`` rows x features, ``q_THK`` rows x heads x dim.
"""

from __future__ import annotations

import torch

from harts.models.execution.backends import Backends
from harts.ops.row_gather import RowGatherPlan

__all__ = ["RowContext"]


class RowContext:
    """Abstract base; ``TrajectoryContext`` and ``CompactContext`` implement it."""

    #: T, the number of rows every layer reads and writes
    num_rows: int
    #: int64 [T] RoPE position id of each row
    position: torch.Tensor
    #: float [T] semantic multiplicity of each row (MoE loss/count weights)
    row_weight: torch.Tensor
    #: linear-attention chunk size B
    chunk_size: int
    #: the kernel record this forward runs (``HybridLM.backends``); the default: the CPU's
    backends: Backends = Backends()
    #: whether the layer running now is under activation checkpointing (``HybridLM.forward``
    #: sets it per layer, then to whether any layer is, for the backward's recomputations)
    checkpointing: bool = False
    #: cores whose forward survives recomputation (``harts.models.recompute``); set by
    #: ``HybridLM.forward`` while recomputation is on
    recompute_skip: tuple[str, ...] = ()
    #: whether the MoE layer running now keeps its lean experts' gate/up output
    #: (``ExecutionConfig.moe_keep_gate_up``); set by ``HybridLM.forward`` per layer
    moe_keep_gate_up: bool = False

    @property
    def kept_for_recompute(self) -> dict:
        """What a layer's forward leaves for checkpoint's recomputation of it, taken by that
        recomputation (``harts.models.recompute``): ``{(id(module), region): (detached output,
        requires_grad)}`` of skipped cores and ``{(id(module), "routing"): (topk_idx, Dispatch or
        None)}`` of MoE layers."""
        return self.__dict__.setdefault("_kept_for_recompute", {})

    def rope(self, rotary_dim: int, theta: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin ``[T, rotary_dim]`` for ``position``, computed once per (dim, theta, dtype)."""
        from harts.models.layers.rope import rope_cos_sin

        cache = self.__dict__.setdefault("_rope_cache", {})
        key = (rotary_dim, theta, dtype)
        if key not in cache:
            cache[key] = rope_cos_sin(self.position, rotary_dim, theta, dtype)
        return cache[key]

    def short_conv(
        self, x_TD: torch.Tensor, weight_DW: torch.Tensor, bias_D: torch.Tensor | None, activation: str | None
    ) -> torch.Tensor:
        raise NotImplementedError

    def la_input_rows(self) -> RowGatherPlan | None:
        """The rows the linear attention reads, as a row gather over this context's rows (compact
        execution: every round's, replayed rows again), or None: the rows as they are. A layer
        may hand ``linear_attention`` q / k / v already gathered (``qkv_gathered=True``)."""
        return None

    def linear_attention(
        self,
        q_THK: torch.Tensor,
        k_THK: torch.Tensor,
        v_THV: torch.Tensor,
        g: torch.Tensor,
        beta_TH: torch.Tensor | None,
        *,
        rule: str = "delta",
        scale: float | None = None,
        qkv_gathered: bool = False,
    ) -> torch.Tensor:
        """[T, H, V] output rows of the linear-attention core over this context's rows.

        q / k [T, H, K] (grouped keys expanded to the heads), v [T, H, V], g [T, H, K]
        per-channel or [T, H] scalar log-decay (<= 0). ``rule``: "delta" (beta [T, H] the write
        strength: KDA, GDN) or "plain" (beta None: S = exp(g_t) S + k_t v_t^T, Mamba-2's SSD);
        ``harts.ops.linear_attn.utils`` gives both recurrences. ``qkv_gathered``: q / k / v are
        already ``la_input_rows``'s rows (g and beta are not)."""
        raise NotImplementedError

    def attention(self, q_THD: torch.Tensor, k_TGD: torch.Tensor, v_TGE: torch.Tensor, *, scale: float) -> torch.Tensor:
        raise NotImplementedError
