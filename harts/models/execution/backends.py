"""The kernel record: which implementation of every choice one model runs on one device.

``ExecutionConfig`` holds what the user asked for ("auto" included); ``resolve_backends`` turns
it, once per (model, device), into a frozen ``Backends`` that names what actually runs:

    linear_attention  "reference", "fla" or "tree" (``harts.ops.linear_attn.dispatch``)
    link_rounds       the compact executor links a microbatch's rounds into one op per layer
    conv              the short conv: "reference" (torch gathers) or "fla" (fla-core over runs)
    attention         "gather" or "mask" (``ExecutionConfig.resolved_attention``)
    flex              on the CUDA mask path: FlexAttention's backend per full-attention layer kind
    fast_paths        the layers' fast paths in use (``harts.ops.registry.FAST_PATHS``)
    gdn               GDN layers on the one-pass tree operator: the KDA kernels or fla-core's GDN
                      kernels (``HARTS_GDN_NATIVE=1``: ``harts.ops.linear_attn.tree_kernel``)
    compile           the layer glue compiled by ``torch.compile`` (CUDA, unless ``HARTS_COMPILE=0``:
                      ``harts.ops.compiled``)

``HybridLM.backends`` caches it per model; the row contexts carry it (``RowContext.backends``)
and the layers read their fast paths from it, so both execution modes of one forward make the
same choices: the short conv follows the resolved linear-attention operator, never an unresolved
"auto" (which on CUDA at a chunk size fla-core does not run is the reference, not fla-core).
``harts bench`` prints ``describe()`` in its run header. The environment overrides it reads, each here and nowhere else
(``docs/ENVIRONMENT.md``): ``HARTS_KDA_SILU_IN_SPLIT`` and ``HARTS_KDA_FLA_GATE``, the defaults of
two fast paths; ``HARTS_FLEX_BACKEND`` through ``harts.ops.attention.tree_mask.flex_backend``;
``HARTS_GDN_NATIVE`` through ``tree_kernel.gdn_native_asked``; ``HARTS_COMPILE`` through
``harts.ops.compiled.compile_enabled``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from harts.models.execution.config import ExecutionConfig, attention_head_dim_range, flash_views_run
from harts.ops.compiled import compile_enabled, env_switch
from harts.ops.registry import FAST_PATHS

if TYPE_CHECKING:
    from harts.models.config import HybridConfig

__all__ = ["Backends", "FlexChoice", "default_fast_paths", "resolve_backends"]

#: the fast paths that run only where they pay: on CUDA (on the CPU the separate GEMMs are the
#: reference the CPU figures were measured with)
_CUDA_ONLY = frozenset({"stacked_qkv", "stacked_gates"})
#: GDN's layer letter (``harts.models.layers.gdn.SPEC.letter``: the layers import this module, so
#: it is spelled here, as ``HybridConfig``'s letters are; a test holds the two equal)
GDN_LETTER = "G"
#: fast paths with an environment override of their default: on unless set to 0/false/no/off
_ENV_SWITCHES = {"silu_in_split": "HARTS_KDA_SILU_IN_SPLIT", "fla_gate": "HARTS_KDA_FLA_GATE"}


@dataclass(frozen=True, kw_only=True, slots=True)
class FlexChoice:
    """FlexAttention's backend for one full-attention layer kind (its head shape)."""

    #: the layer kind's letter in the pattern ("M": MLA, "A": GQA)
    kind: str
    #: query/key head dim
    qk_dim: int
    #: value head dim
    v_dim: int
    #: grouped-query heads (fewer kv heads than query heads)
    gqa: bool
    #: the dtype of q / k / v it was chosen for (the model's parameters')
    dtype: torch.dtype
    #: "flash" (FA4 on the CuTe DSL) or "triton"
    backend: str


@dataclass(frozen=True, kw_only=True, slots=True)
class Backends:
    """What runs, resolved (no "auto" left); the defaults are what ``resolve_backends`` gives on
    the CPU under ``ExecutionConfig()`` with no environment override: torch reference ops and the
    fast paths that run anywhere."""

    #: the linear-attention operator: "reference", "fla" or "tree"
    linear_attention: str = "reference"
    #: compact execution links a microbatch's rounds into one op per layer ("tree" only)
    link_rounds: bool = False
    #: the short conv: "reference" or "fla" (fla-core's varlen kernel beside a fla-core core)
    conv: str = "reference"
    #: full attention: "gather" or "mask"
    attention: str = "gather"
    #: the gather path runs FlashAttention-2's varlen kernel (CUDA, half precision, heads it takes)
    flash_views: bool = False
    #: FlexAttention's backend per full-attention layer kind; empty off the CUDA mask path
    flex: tuple[FlexChoice, ...] = ()
    #: the layers' fast paths in use (each keeps its reference; a kernel that cannot run the
    #: tensors it gets still falls back to it)
    fast_paths: frozenset[str] = frozenset(FAST_PATHS) - _CUDA_ONLY - {"fla_gate"}
    #: GDN layers on the one-pass tree operator: "kda" (the KDA kernels with the decay broadcast,
    #: the default) or "gdn" (``HARTS_GDN_NATIVE=1``: fla-core's GDN kernels, each head shape
    #: checked against the KDA kernels at its first call and kept on them where the two differ;
    #: ``tree_kernel.gdn_kernels()`` tells after a run); "" where no GDN layer runs on it
    gdn: str = ""
    #: the layers' element-wise glue runs compiled by ``torch.compile`` (``harts.ops.compiled``:
    #: CUDA tensors, unless ``HARTS_COMPILE=0``; the LM head's fused passes are compiled on CUDA
    #: either way)
    compile: bool = False

    def fast(self, path: str) -> bool:
        """Whether fast path ``path`` (a name of ``FAST_PATHS``) is in use."""
        assert path in FAST_PATHS, path
        return path in self.fast_paths

    def flex_backend(self, q_THD: torch.Tensor, k_TGD: torch.Tensor, v_TGE: torch.Tensor) -> str | None:
        """The recorded FlexAttention backend for heads like these, or None where none was
        recorded (another head shape or dtype: ``tree_mask_attention`` then chooses by itself)."""
        key = (q_THD.shape[2], v_TGE.shape[2], k_TGD.shape[1] != q_THD.shape[1], q_THD.dtype)
        for choice in self.flex:
            if (choice.qk_dim, choice.v_dim, choice.gqa, choice.dtype) == key:
                return choice.backend
        return None

    def describe(self) -> str:
        """One line naming each choice, e.g. ``linear attention tree (rounds linked, GDN on the
        KDA kernels); conv fla; attention mask (FlexAttention M flash); fast paths: all;
        torch.compile glue: on``."""
        notes = ["rounds linked"] if self.link_rounds else []
        if self.gdn:
            notes.append(_GDN_NOTES[self.gdn])
        linked = f" ({', '.join(notes)})" if notes else ""
        flex = ", ".join(f"{c.kind} {c.backend}" for c in self.flex)
        off = [p for p in FAST_PATHS if p not in self.fast_paths]
        fast = "all" if not off else "none" if len(off) == len(FAST_PATHS) else f"all but {', '.join(off)}"
        return (
            f"linear attention {self.linear_attention}{linked}; conv {self.conv}; "
            f"attention {self.attention}{f' (FlexAttention {flex})' if flex else ''}"
            f"{' (FlashAttention-2 varlen views)' if self.flash_views and self.attention == 'gather' else ''}; "
            f"fast paths: {fast}; torch.compile glue: {'on' if self.compile else 'off'}"
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain data for a JSON report."""
        return {
            "linear_attention": self.linear_attention,
            "link_rounds": self.link_rounds,
            "conv": self.conv,
            "attention": self.attention,
            "flash_views": self.flash_views and self.attention == "gather",
            "flex": {c.kind: c.backend for c in self.flex},
            "fast_paths": [p for p in FAST_PATHS if p in self.fast_paths],
            "gdn": self.gdn or None,
            "compile": self.compile,
        }


#: ``Backends.gdn`` as ``describe`` says it
_GDN_NOTES = {"kda": "GDN on the KDA kernels", "gdn": "GDN on fla-core's GDN kernels, checked per head shape"}


def default_fast_paths(device: torch.device) -> frozenset[str]:
    """The fast paths ``ExecutionConfig(fast_paths=None)`` uses on ``device``: all, but the stacked
    GEMMs on CUDA only, and "silu_in_split" / "fla_gate" unless ``HARTS_KDA_SILU_IN_SPLIT`` /
    ``HARTS_KDA_FLA_GATE`` is 0/false/no/off (for A/B timing of one process against another);
    "fla_gate" also needs CUDA and fla-core."""
    on = set(FAST_PATHS)
    if device.type != "cuda":
        on -= _CUDA_ONLY
    on -= {path for path, name in _ENV_SWITCHES.items() if not env_switch(name)}
    return _runnable(frozenset(on), device)


def _runnable(paths: frozenset[str], device: torch.device) -> frozenset[str]:
    """``paths`` without fla-core's gate where it cannot run (not CUDA, or no fla-core)."""
    if "fla_gate" not in paths:
        return paths
    from harts.ops.linear_attn.fla import fla_available

    return paths if device.type == "cuda" and fla_available() else paths - {"fla_gate"}


def resolve_backends(
    execution: ExecutionConfig, config: HybridConfig, device: torch.device, dtype: torch.dtype
) -> Backends:
    """The kernel record of a model with ``config`` and parameters of ``dtype`` on ``device``
    under ``execution`` (module docstring): every "auto" decided, every name checked.

    Raises:
        ValueError: a linear-attention backend that cannot run here (fla-core's without CUDA and
            fla-core, or at a chunk size its kernels do not run).
        UserError: ``attention="mask"`` at head dims FlexAttention does not take on CUDA.
        RuntimeError: ``HARTS_FLEX_BACKEND=flash`` where FA4 cannot run these heads.
    """
    from harts.ops.conv import conv_uses_fla
    from harts.ops.linear_attn.dispatch import resolve_linear_attn_backend

    linear = resolve_linear_attn_backend(execution.linear_attention_backend, device, config.chunk_size)
    link = execution.link_rounds
    if link is None:
        link = execution.linear_attention_backend == "auto"
    dims = config.attention_head_dims
    views = flash_views_run(dims, device, dtype)
    attention = execution.resolved_attention(device.type, *attention_head_dim_range(dims), flash_views=views)
    fast = default_fast_paths(device) if execution.fast_paths is None else frozenset(execution.fast_paths)
    return Backends(
        linear_attention=linear,
        link_rounds=link and linear == "tree",
        conv="fla" if conv_uses_fla(linear, device) else "reference",
        attention=attention,
        flash_views=views,
        flex=_flex_choices(dims, device, dtype) if attention == "mask" and device.type == "cuda" else (),
        fast_paths=_runnable(fast, device),
        gdn=_gdn_kernels(config, linear),
        compile=device.type == "cuda" and compile_enabled(),
    )


def _gdn_kernels(config: HybridConfig, linear: str) -> str:
    """``Backends.gdn`` of a model with ``config`` on linear-attention operator ``linear``."""
    if linear != "tree" or GDN_LETTER not in config.layer_pattern:
        return ""
    from harts.ops.linear_attn.tree_kernel import gdn_native_asked

    return "gdn" if gdn_native_asked() else "kda"


def _flex_choices(dims: dict[str, tuple[int, int, bool]], device: torch.device, dtype: torch.dtype) -> tuple:
    """FlexAttention's backend for each full-attention kind of ``dims``
    ({letter: (qk dim, v dim, grouped)}); FLASH's probe runs here, once per head shape."""
    from harts.ops.attention.tree_mask import flex_backend

    return tuple(
        FlexChoice(
            kind=k, qk_dim=qk, v_dim=v, gqa=gqa, dtype=dtype, backend=flex_backend(device, dtype, qk, v, gqa=gqa)
        )
        for k, (qk, v, gqa) in dims.items()
    )
