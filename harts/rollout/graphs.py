"""Decode steps at fixed shapes over static buffers, captured in CUDA graphs on CUDA.

A decode step of B sequences (one token each) runs at a bucketed shape: B padded to a power of
two, the keys every attention layer reads padded to a multiple of ``KEY_BLOCK``. Its inputs
(token, sequence, position, new slot, last visible key per row) live in one static buffer that
every step of that shape reuses, so the step has no host work inside it and on CUDA is captured
once per shape (``torch.cuda.graph``) and replayed. Padding rows belong to a scratch sequence
with a scratch slot of their own: what they compute and write goes nowhere any live sequence
reads. The warm-up and the capture run on that scratch sequence too, so no live cache is
written twice.

A graph holds the addresses of the cache's tensors; when the cache allocates or grows one
(``SlotCache.version``), the graphs are dropped and captured again at the next step.

On the CPU the same static path runs eagerly when asked for (``FastDecoder.static_steps``):
the tests hold it to the reference decoder as they hold the eager step.

Shapes: B rows (padded), M keys per row (padded), V vocab.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from harts.models.execution.backends import Backends
from harts.models.hybrid_lm import HybridLM
from harts.rollout.cache import SlotCache
from harts.rollout.context import FastContext

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE

__all__ = ["KEY_BLOCK", "MAX_GRAPH_BATCH", "StaticSteps"]

#: keys per attention row are padded to a multiple of this (one graph per multiple reached)
KEY_BLOCK = 256
#: the largest padded batch a graph is captured for; larger steps run eagerly
MAX_GRAPH_BATCH = 256


class _StaticContext(FastContext):
    """``FastContext`` of a step whose row inputs are views of a static buffer (no host work)."""

    def __init__(self, cache: SlotCache, inputs_5B: torch.Tensor, keys: int, backends: Backends, chunk: int) -> None:
        self.cache, self.backends, self.chunk_size = cache, backends, chunk
        self.ids_B, self.position, self.slots_T, limit_B = inputs_5B[1], inputs_5B[2], inputs_5B[3], inputs_5B[4]
        self.num_rows = self.n_max = inputs_5B.shape[1]
        self.n_max = 1
        self.is_step, self.fresh = True, False
        self.row_weight = torch.ones(self.num_rows, dtype=torch.float64, device=cache.device)
        self.key_len, self.limit_BN = keys, limit_B[:, None]
        self.layer = -1

    def rope(self, rotary_dim: int, theta: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``rope_cos_sin``'s values from a device-resident frequency table (nothing uploaded
        inside a captured step)."""
        cache = self.__dict__.setdefault("_rope_cache", {})
        key = (rotary_dim, theta, dtype)
        if key not in cache:
            freq = self.__dict__.setdefault("_inv_freq", {})
            if (rotary_dim, theta) not in freq:
                inv = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
                freq[(rotary_dim, theta)] = inv.to(self.position.device)
            freqs = self.position.to(torch.float64)[:, None] * freq[(rotary_dim, theta)][None, :]
            emb = torch.cat([freqs, freqs], dim=-1)
            cache[key] = (emb.cos().to(dtype), emb.sin().to(dtype))
        return cache[key]


class _Step:
    """One bucketed shape: its static inputs, context, output and (on CUDA) graph."""

    def __init__(self, model: HybridLM, cache: SlotCache, rows: int, keys: int, backends: Backends) -> None:
        self.model = model
        #: rows: token, sequence, position, new slot, last visible key
        self.inputs_5B = torch.zeros(5, rows, dtype=torch.int64, device=cache.device)
        self.ctx = _StaticContext(cache, self.inputs_5B, keys, backends, model.config.chunk_size)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits_BV: torch.Tensor | None = None

    def run(self) -> torch.Tensor:
        model, ctx = self.model, self.ctx
        ctx.__dict__.pop("_rope_cache", None)  # positions change from step to step
        h = model.embed_tokens(self.inputs_5B[0])
        if model.config.embedding_multiplier != 1.0:  # Granite's scalings, as HybridLM.forward
            h = h * model.config.embedding_multiplier
        for i, layer in enumerate(model.layers):
            ctx.layer = i
            h = layer(h, ctx)[0]
        h = model.norm(h)
        if model.config.logits_scaling != 1.0:  # logits / s, as (h / s) W^T: the head is linear
            h = h / model.config.logits_scaling
        return F.linear(h, model.lm_head_weight)

    def capture(self, scratch: int, scratch_slot: int, pool: _POOL_HANDLE) -> None:
        """Warm up (kernels compiled and tuned) and capture into memory ``pool``, all rows on
        the scratch sequence."""
        self.inputs_5B.zero_()
        self.inputs_5B[1], self.inputs_5B[3] = scratch, scratch_slot
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.run()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.logits_BV = self.run()

    def __call__(self) -> torch.Tensor:
        if self.graph is None:
            return self.run()
        self.graph.replay()
        assert self.logits_BV is not None
        return self.logits_BV


class StaticSteps:
    """The bucketed steps of one ``FastDecoder`` (module docstring); ``capture``: CUDA graphs."""

    def __init__(self, model: HybridLM, cache: SlotCache, backends: Backends, *, capture: bool) -> None:
        self.model, self.cache, self.backends, self.capture = model, cache, backends, capture
        self._steps: dict[tuple[int, int], _Step] = {}
        self._version = -1
        self._scratch: tuple[int, int] | None = None
        # one memory pool for every shape's graph: steps never run concurrently and each step's
        # output is copied out before the next, so their temporaries can share memory
        self._pool: _POOL_HANDLE | None = None

    def applies(self, batch: int) -> bool:
        return batch <= MAX_GRAPH_BATCH

    def _scratch_ids(self) -> tuple[int, int]:
        """The scratch sequence and its slot (opened once, never closed)."""
        if self._scratch is None:
            (seq,) = self.cache.open(1)
            slot = int(self.cache.append([seq], [1])[0])
            self._scratch = (seq, slot)
        return self._scratch

    @torch.no_grad()
    def step(self, ids: Sequence[int], tokens: Sequence[int]) -> torch.Tensor:
        """One token for each sequence ``ids`` (each has consumed at least one); returns the
        next-token logits [B, V] (a view the next step of this shape overwrites)."""
        cache, b = self.cache, len(ids)
        scratch, scratch_slot = self._scratch_ids()
        rows = 1 << max(0, (b - 1).bit_length())
        lengths = cache.lengths[list(ids)]
        keys = -(-(int(lengths.max()) + 1) // KEY_BLOCK) * KEY_BLOCK
        cache.reserve(0, b, keys)
        slots = cache.append(ids, [1] * b)
        if cache.version != self._version:
            self._steps.clear()
            self._version = cache.version
        step = self._steps.get((rows, keys))
        if step is None:
            step = self._steps[(rows, keys)] = _Step(self.model, cache, rows, keys, self.backends)
            if self.capture:
                if self._pool is None:
                    self._pool = torch.cuda.graph_pool_handle()
                step.capture(scratch, scratch_slot, self._pool)
        host = np.zeros((5, rows), dtype=np.int64)
        host[1], host[3] = scratch, scratch_slot
        host[0, :b], host[1, :b], host[2, :b], host[4, :b] = tokens, ids, lengths, lengths
        step.inputs_5B.copy_(torch.as_tensor(host))
        step.inputs_5B[3, :b] = slots
        logits = step()
        cache.advance(ids, [1] * b)
        return logits[:b]
