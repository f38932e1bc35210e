"""The names of every kernel choice, in one place and without torch.

``ExecutionConfig`` checks its fields against these tuples, ``harts.models.execution.backends``
resolves them into the kernel record (``Backends``), and the CLI builds its ``choices`` from them:
this module imports nothing, so ``harts --help`` stays instant.

Old spellings are accepted through ``LINEAR_ATTN_ALIASES`` only (``canonical_linear_attn``):
"tree_linked" was a backend name for what is now the tree kernel with the executor flag
``ExecutionConfig.link_rounds``.
"""

from __future__ import annotations

__all__ = [
    "ATTENTION_IMPLS",
    "CONV_IMPLS",
    "FAST_PATHS",
    "FLEX_BACKENDS",
    "KDA_FAST_PATHS",
    "LINEAR_ATTN_ALIASES",
    "LINEAR_ATTN_BACKENDS",
    "MOE_FAST_PATHS",
    "canonical_linear_attn",
    "linear_attn_choices",
]

#: the linear-attention core (``harts.ops.linear_attn.dispatch``): "reference" (torch, any
#: device), "fla" (fla-core's split path), "tree" (harts' tree kernel) or "auto" (resolved per
#: device and chunk size)
LINEAR_ATTN_BACKENDS = ("reference", "fla", "tree", "auto")
#: old linear-attention names -> (backend, ``link_rounds``) they stand for
LINEAR_ATTN_ALIASES: dict[str, tuple[str, bool]] = {"tree_linked": ("tree", True)}
#: full attention: "gather" (per branch), "mask" (one call under the tree mask), "auto"
ATTENTION_IMPLS = ("auto", "gather", "mask")
#: the short conv: "reference" (torch gathers) or "fla" (fla-core's varlen kernel over runs)
CONV_IMPLS = ("reference", "fla")
#: FlexAttention's backend on the mask path (``HARTS_FLEX_BACKEND``): "auto", "triton", "flash"
FLEX_BACKENDS = ("auto", "triton", "flash")
#: the linear-attention layers' fast paths (``harts.models.layers.kda`` / ``gdn``): "stacked_qkv"
#: and "stacked_gates" (one GEMM over stacked projection weights), "fused_qkv_norm" (the q / k / v
#: split and l2 norms in one kernel, KDA and GDN), "silu_in_split" (KDA's short-conv SiLU in that
#: kernel), "fla_gate" (KDA's log-decay by fla-core's fused gate)
KDA_FAST_PATHS = ("stacked_qkv", "stacked_gates", "fused_qkv_norm", "silu_in_split", "fla_gate")
#: the MoE's fast paths (``harts.models.layers.moe``): "router_split", "dispatch_reuse",
#: "permute_gather", "router_topk"
MOE_FAST_PATHS = ("router_split", "dispatch_reuse", "permute_gather", "router_topk")
#: every fast path a model's layers take; each keeps the code it replaces as its reference
FAST_PATHS = KDA_FAST_PATHS + MOE_FAST_PATHS


def linear_attn_choices() -> tuple[str, ...]:
    """Every name ``--la-backend`` takes: the backends, then the old spellings still accepted."""
    return (*LINEAR_ATTN_BACKENDS, *LINEAR_ATTN_ALIASES)


def canonical_linear_attn(name: str) -> tuple[str, bool | None]:
    """(backend, ``link_rounds`` the name implies, or None where it implies none) for a
    linear-attention name or old spelling; ValueError names an unknown one."""
    if name in LINEAR_ATTN_ALIASES:
        return LINEAR_ATTN_ALIASES[name]
    if name not in LINEAR_ATTN_BACKENDS:
        raise ValueError(f"linear-attention backend must be one of {linear_attn_choices()}, got {name!r}")
    return name, None
