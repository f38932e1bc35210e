"""Backend choice for the linear-attention core: the torch reference, fla-core, or harts' tree kernel.

All implement one contract (``chunk_linear_attn``'s signature: packed sequences, initial
states, requested boundary states, all differentiable; the delta rule or, ``rule="plain"``, the
plain recurrence of Mamba-2's SSD), so executors pick by name (the names:
``harts.ops.registry.LINEAR_ATTN_BACKENDS``):

    "reference"  ``chunk_linear_attn`` (any device; the numerics every test checks)
    "fla"        ``fla_chunk_linear_attn`` (CUDA + fla-core; an error elsewhere): boundary
                 states by splitting sequences at requested chunk boundaries
    "tree"       ``tree_chunk_linear_attn`` (CUDA + fla-core + Triton): one packed call per
                 round, requested states exported and their gradients injected by harts' own
                 state scans (``tree_scan``); GDN and the plain rule (fla's simple_gla
                 kernels; a per-channel plain decay takes the "fla" path) train through it
                 too, on Hopper as well. The
                 compact executor can link a microbatch's rounds into one op per layer
                 (``ExecutionConfig.link_rounds``, ``linked_tree_linear_attn``: fla's
                 chunk-parallel kernels once, the scans per round, the backward's recomputed scan
                 once) wherever the layout's state requests are chunk-aligned; "auto" links them,
                 since linking saves the per-round splits and concatenations (a step both ways:
                 ``benchmarks/results/ling3-tiny_h200_2026-12-02_glue-fusions.md``)
    "auto"       "tree" on CUDA when fla-core imports and the chunk size is fla's 64, else
                 "reference" (a model with another chunk size, e.g. the tiny preset's 8, runs
                 the reference op; asking for "tree" or "fla" there is an error). The tree
                 kernel runs close to plain fla's time on the same rows without any state export,
                 and far below the split path's (``python -m benchmarks.ops.la --device cuda``)

The old name "tree_linked" is accepted here too and stands for "tree" (the linking is the
compact executor's part: ``harts.ops.registry.canonical_linear_attn``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from harts.ops.linear_attn.chunk import chunk_linear_attn
from harts.ops.linear_attn.fla import fla_available, fla_chunk_linear_attn
from harts.ops.registry import LINEAR_ATTN_BACKENDS, canonical_linear_attn

__all__ = ["LINEAR_ATTN_BACKENDS", "linear_attn_op", "resolve_linear_attn_backend"]

#: chunk sizes fla-core's chunked kernels run (KDA: 32 or 64; harts' tree kernel and GDN: 64)
FLA_CHUNK_SIZES = {"fla": (32, 64), "tree": (64,)}


def resolve_linear_attn_backend(backend: str, device: torch.device, chunk_size: int | None = None) -> str:
    """The operator name ("reference", "fla" or "tree") that ``backend`` stands for on
    ``device``: "auto" resolved (see the module docstring), an old spelling mapped, any other
    name checked and returned as it is. ``chunk_size``: the model's linear-attention chunk B,
    when known (None: not checked).

    Raises:
        ValueError: an unknown name, or a fla-core backend without CUDA and fla-core or at a
            chunk size fla-core's kernels do not run.
    """
    backend = canonical_linear_attn(backend)[0]
    if backend == "auto":
        fits = chunk_size is None or chunk_size in FLA_CHUNK_SIZES["tree"]
        return "tree" if device.type == "cuda" and fla_available() and fits else "reference"
    if backend == "reference":
        return backend
    if device.type != "cuda" or not fla_available():
        raise ValueError(
            f"linear-attention backend {backend!r} needs a CUDA device and fla-core (pip install harts[gpu])"
        )
    if chunk_size is not None and chunk_size not in FLA_CHUNK_SIZES[backend]:
        raise ValueError(
            f"linear-attention backend {backend!r} runs fla-core's kernels at chunk size "
            f"{' or '.join(map(str, FLA_CHUNK_SIZES[backend]))}; this model's chunk size is {chunk_size}"
        )
    return backend


def linear_attn_op(backend: str, device: torch.device, chunk_size: int | None = None) -> Callable:
    """The operator for ``backend`` on ``device`` (``resolve_linear_attn_backend``'s choice; the
    module docstring). Linking a compact microbatch's rounds is the compact executor's part."""
    backend = resolve_linear_attn_backend(backend, device, chunk_size)
    if backend == "reference":
        return chunk_linear_attn
    if backend == "tree":
        from harts.ops.linear_attn.tree_kernel import tree_chunk_linear_attn

        return tree_chunk_linear_attn
    return fla_chunk_linear_attn
