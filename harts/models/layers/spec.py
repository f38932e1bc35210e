"""MixerSpec: everything harts needs to know about one kind of token mixer, in one record.

Each mixer module (``harts.models.layers.<mixer>``) ends with its ``SPEC``; the registry
(``harts.models.layers.registry``) maps layer letters to them. The floors that apply plans ask
the spec and never switch on letters: the decoder layer builds ``spec.module``, the memory
estimate and the FLOP model read its counts, tensor and context parallelism its plans and
divisors, LoRA its targets. A spec declares; it imports nothing from those floors, so its plans
are plain data (style names, not the parallel styles themselves).

Counts are per decoder layer of the mixer kind; ``c`` is the model's ``HybridConfig`` and ``dev``
"cpu" or "cuda" (the CPU runs harts' torch reference cores, CUDA fla-core's and FlexAttention).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from torch import nn

    from harts.models.config import HybridConfig

__all__ = ["MixerSpec", "TensorParallelPlan", "all_linears", "chunk_state_elements", "fla_core_row_elements"]

#: a tensor-parallel plan of one mixer instance: ({submodule name relative to the mixer ("" the
#: mixer itself): "columns" | "rows" | ("heads", parameter names)}, the short conv's channel blocks
#: [q, k, v] split over tp or None). ``tp_plan`` also sets the mixer's head counts to one rank's.
TensorParallelPlan = tuple[dict[str, "str | tuple[str, tuple[str, ...]]"], "tuple[int, ...] | None"]


@dataclass(frozen=True, kw_only=True, slots=True)
class MixerSpec:
    """One mixer kind (module docstring). Every field is required (None only where it says so):
    the registry test asserts that every registered letter has them all."""

    #: the layer letter in ``HybridConfig.layer_pattern``
    letter: str
    #: "linear" (a chunkwise linear-attention core, a short conv) or "full" (softmax attention)
    family: Literal["linear", "full"]
    #: one line for users
    description: str
    #: the module class, built as ``module(config)``; it runs as ``module(x_TD, ctx)``
    module: type[nn.Module]
    #: the decoder layer's attribute (and state-dict name) holding it: "linear_attn" or "self_attn"
    attribute: str
    #: the recompute region of its core (``harts.models.recompute``): "linear_attention" | "attention"
    core_region: str
    #: its parameters, counted from the config
    parameters: Callable[[HybridConfig], int]
    #: (elements kept per row outside the core, inside it; the post-mixer add-and-norm included)
    row_elements: Callable[[HybridConfig, str], tuple[float, float]]
    #: (full attention: K and V elements one gathered ancestor-view row holds; 0 for linear mixers)
    view_row_elements: Callable[[HybridConfig, str], int]
    #: forward FLOPs of the core: (per visible attention pair, per row), matmul parameters aside
    core_flops: Callable[[HybridConfig], tuple[float, float]]
    #: full attention: (query/key head dim, value head dim, grouped-query), None for linear mixers
    attention_dims: Callable[[HybridConfig], tuple[int, int, bool] | None]
    #: the tensor-parallel plan of a built mixer at degree tp (``TensorParallelPlan``); None:
    #: tensor parallelism does not split this kind (``check_tensor_parallel`` says so)
    tp_plan: Callable[[nn.Module, int], TensorParallelPlan] | None
    #: (what, count) that tensor parallelism must divide
    tp_divisors: Callable[[HybridConfig], list[tuple[str, int]]]
    #: (what, count, rule) that context parallelism of one tp rank must split: rule "divides" or
    #: "divides_or_multiple" (cp a multiple of the count is fine too: key-value heads); None:
    #: context parallelism does not split this kind (``check_context_parallel`` says so)
    cp_divisors: Callable[[HybridConfig, int], list[tuple[str, int, str]]] | None
    #: LoRA targets of a built mixer: (name relative to the mixer, ``nn.Linear``)
    lora_targets: Callable[[nn.Module], list[tuple[str, nn.Module]]]


def all_linears(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every ``nn.Linear`` of ``module`` by relative name: the LoRA targets of every mixer
    (each adapts all of its projections)."""
    from torch import nn

    return [(n, m) for n, m in module.named_modules() if isinstance(m, nn.Linear)]


def chunk_state_elements(h: int, k: int, v: int, b: int) -> float:
    """Elements per row of a reference linear-attention core's chunk transitions and start
    states (one [K, K + V] pair of each of ``h`` heads per chunk of ``b`` rows)."""
    return h * k * (k + v) / b


def fla_core_row_elements(h: int, k: int, v: int, b: int) -> float:
    """Elements per row fla-core's chunked core keeps (CUDA): q, k, v, g, beta, the in-chunk
    matrices [B] and the chunk states; ``h`` heads of key dim ``k`` and value dim ``v``, chunk ``b``."""
    return 3 * h * k + h * v + h + 2 * h * b + h * k * v / b
