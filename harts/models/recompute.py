"""Selective recomputation: row-coupling cores whose forward survives activation checkpointing.

With ``ExecutionConfig(recompute=True)`` every decoder layer runs under
``torch.utils.checkpoint`` (non-reentrant): the forward keeps only the layer's input, and the
backward reruns the whole layer to rebuild what its gradients need. ``recompute_skip`` names
cores that are not rerun (``harts.models.execution.config.SKIPPABLE_CORES``):

* ``"attention"``: the full-attention core (FlexAttention / SDPA), the costliest core to rerun
  on long contexts; at T = 65,536 rows an MLA layer keeps q, k (16 x 192), v, o (16 x 128) in bf16
  and the log-sum-exp, 1.35 GB by their shapes;
* ``"linear_attention"``: the chunkwise KDA / GDN core (fla-core or the tree kernel), whose
  saved tensors include float32 decays and per-chunk matrices. Keeping both kinds of core trades
  tens of GiB of peak memory for a few percent of step time on the full ``ling3_tiny``
  (``benchmarks/results/ling3-tiny_h200_2026-12-01_selective-recompute.md``).
* ``"moe"``: the whole MoE block (router, routed and shared experts, statistics). Its routed
  experts then run lean (``MoE.forward``'s ``lean``): they keep only their inputs and recompute
  the row gather, the gate/up GEMM and the SwiGLU inside their own backward, so the block keeps
  about its input and output rows, the shared expert's three [T, I_s] activations, the router's
  float32 [T, E] tensors and the dispatch's int64 [T K] indices (about 0.8 GB per layer at
  65,536 rows of ``ling3_tiny``, by their shapes) instead of the [T K, D + 3 I] the autograd
  path keeps. The recomputation then skips the whole block (about a quarter of a MoE layer's
  time under recomputation, ``python -m benchmarks.modules.moe --device cuda``) at the cost of one
  gather, one grouped GEMM and one SwiGLU pass in the backward.

A skipped core runs in the forward with its saved tensors kept (an identity
``saved_tensors_hooks`` inside checkpoint's, so checkpoint never sees them) and its output
stored on the row context, detached. When checkpoint reruns the layer, the core returns that
output instead of running: the rest of the layer recomputes from the very tensor the forward
used, so gradients are those of full recomputation, bit for bit. A second recomputation of the
same layer (``retain_graph`` and another backward) finds nothing stored and runs the core again
(kept out of checkpoint the same way), which is correct but not free.

Whatever ``recompute_skip`` says, each MoE layer's recomputation reuses the forward's expert
choice (``kept_routing``): the same routing by construction (a rerun cannot choose
differently, whatever its kernels do), and no second top-k.

Shapes and meaning of a core's arguments are its own (``RowContext.attention`` /
``RowContext.linear_attention``); this module only decides whether it runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import harts.models.regions as regions

__all__ = ["KeptSlot", "kept_routing", "run_core"]


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def run_core(
    ctx: Any, owner: torch.nn.Module, region: str, fn: Callable[..., Any], *args: torch.Tensor, **kwargs: Any
) -> Any:
    """``fn(*args, **kwargs)`` timed as ``region`` (``harts.models.regions``), or its stored
    forward output when checkpoint recomputes a layer whose ``region`` core is skipped.

    Args:
        ctx: the forward's ``RowContext``; ``ctx.recompute_skip`` holds the skipped cores
            (set by ``HybridLM.forward`` only while recomputation is on and grad is enabled; a
            context without the attribute skips nothing).
        owner: the module calling the core (one stored output per module and region).
        region: "attention", "linear_attention" or "moe".
        fn: the core; returns one tensor or a tuple of tensors (returned the same way).
    """
    skip = region in getattr(ctx, "recompute_skip", ()) and torch.is_grad_enabled()
    if skip and regions.recomputing():
        kept = ctx.kept_for_recompute.pop((id(owner), region), None)
        if kept is not None:
            # the forward's requires_grad: every op after the core builds (and saves for) the
            # same nodes as in the forward, as checkpoint's saved-tensor bookkeeping expects
            single, outs = kept
            restored = tuple(out.requires_grad_(requires_grad) for out, requires_grad in outs)
            return restored[0] if single else restored
    args = _through(regions.enter, region, args)
    if not skip:
        return _exit(region, fn(*args, **kwargs))
    with torch.autograd.graph.saved_tensors_hooks(_identity, _identity):
        out = _exit(region, fn(*args, **kwargs))
    if not regions.recomputing():
        single = isinstance(out, torch.Tensor)
        outs = (out,) if single else out
        ctx.kept_for_recompute[(id(owner), region)] = (single, tuple((o.detach(), o.requires_grad) for o in outs))
    return out


def _exit(region: str, out: Any) -> Any:
    """``regions.exit`` of a core's output, one tensor or a tuple, returned in the same form."""
    if isinstance(out, torch.Tensor):
        (out,) = _through(regions.exit, region, (out,))
        return out
    return _through(regions.exit, region, tuple(out))


def _through(mark: Callable[..., tuple[torch.Tensor, ...]], region: str, xs: tuple[Any, ...]) -> tuple[Any, ...]:
    """``mark(region, ...)`` (``regions.enter`` / ``regions.exit``) applied to the entries of
    ``xs`` that require grad, the others passed as they are: a timing mark on a tensor without
    grad (row weights, expert counts) would give it one, and the ops reading it would then save
    tensors in the forward that the recomputation (unmarked) does not."""
    picked = [i for i, x in enumerate(xs) if isinstance(x, torch.Tensor) and x.requires_grad]
    if not picked:
        _ = mark(region)  # the region still starts / stops
        return xs
    marked = mark(region, *(xs[i] for i in picked))
    out = list(xs)
    for i, m in zip(picked, marked):
        out[i] = m
    return tuple(out)


class KeptSlot:
    """One entry of ``ctx.kept_for_recompute``: ``put`` in a layer's forward, ``take`` (once) in
    checkpoint's recomputation of it."""

    def __init__(self, store: dict, key: tuple) -> None:
        self._store, self._key = store, key

    def take(self) -> Any:
        """What the forward put here (removed), or None."""
        return self._store.pop(self._key, None)

    def put(self, value: Any) -> None:
        self._store[self._key] = value


def kept_routing(ctx: Any, owner: torch.nn.Module) -> KeptSlot | None:
    """The slot where MoE layer ``owner`` leaves its expert choice for checkpoint's recomputation
    (``MoE.forward``'s ``routing``), or None when ``ctx`` does not checkpoint.

    The choice (top-k over the biased scores, under ``no_grad``) is integers that nothing
    differentiates: the recomputation takes the forward's instead of choosing again, which
    skips the router's top-k passes and cannot route a token differently, whatever the
    kernels' rounding. Its weights (``scores.gather``) are still recomputed, for their gradient.
    The slot also carries the choice's ``Dispatch`` (the pairs' sort by expert and its inverse)
    when the MoE made one, so the recomputation does not sort again. A layer recomputed twice
    (``retain_graph``) chooses again the second time.
    """
    if not getattr(ctx, "checkpointing", False) or not torch.is_grad_enabled():
        return None
    return KeptSlot(ctx.kept_for_recompute, (id(owner), "routing"))
