"""The batched decoder: the model's own layers over preallocated caches, prompts through the
chunked kernels, one token per live sequence per step, many requests and their forks at once.

``harts.rollout.decode`` is the reference this is held to (float64 log-probs equal to ~1e-12,
``tests/rollout/test_fast.py``). Both run the decoder layers of the training forward; they
differ only in the ``RowContext`` that serves the three row-coupling operations:

    short_conv        prefill: a varlen conv (fla-core's kernel where the model runs it) over
                      each sequence's cached W-1 inputs packed before its new rows;
                      step: the conv-state update of one token (state rolled by one row)
    linear_attention  prefill: the model's chunked operator (``linear_attn_op``: fla-core's
                      chunk kernels on CUDA, the chunked reference elsewhere) started from each
                      sequence's cached state, whose final states it hands back;
                      step: fla-core's fused recurrent kernel on CUDA (KDA, GDN), the same
                      recurrence in torch elsewhere
    attention         keys and values written once into token slots (``SlotCache``); a fresh
                      prompt attends causally among its own rows (varlen), any other call over
                      its sequence's slots under a mask of valid positions (SDPA)

A sequence is an id in the decoder's ``SlotCache``; ``fork`` gives children that share their
parent's key/value slots and copy its (small) recurrent states. ``FastDecoding`` samples one turn
of one request (``Decoding``'s results: ``Turn``), on the device (``sample_on_device``); a
``DecodeBatch`` steps the live sequences of every request it holds in one forward, requests
joining and leaving between steps (continuous batching). With ``cuda_graphs`` the steps run at
bucketed shapes over static buffers, captured in CUDA graphs (``harts.rollout.graphs``); a prefill
past ``PREFILL_TOKENS`` runs in groups of sequences.

Shapes: B sequences in a call, n_max their most new tokens, T = sum of new tokens (rows),
C conv channels, W conv width, H heads, K/V/D/E head dims, G kv heads, L positions, V vocab.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from harts.models.hybrid_lm import HybridLM
from harts.rollout.cache import SlotCache
from harts.rollout.context import FastContext
from harts.rollout.graphs import StaticSteps
from harts.rollout.sampler import Detokenize, SamplingConfig, TurnSampler, sample_on_device

__all__ = ["PREFILL_TOKENS", "DecodeBatch", "FastDecoder", "FastDecoding", "fast_decoding_applies"]

#: new tokens one forward of ``FastDecoder.extend`` runs at most (more are split by sequence):
#: bounds the activations of a large batch of long prompts
PREFILL_TOKENS = 32768


def fast_decoding_applies(model: HybridLM) -> bool:
    """Whether ``harts serve``'s sampling and ``collect`` decode ``model`` with this module: on
    CUDA, where its kernels and its batching pay; the reference decoder on the CPU (the same
    results, ``tests/rollout/test_fast.py``)."""
    return model.embed_tokens.weight.is_cuda


class FastDecoder:
    """Sequences of one model decoded over a ``SlotCache`` (module docstring). A sequence's
    sampled token is ``pending`` until the next call runs it (``Branch``'s convention)."""

    def __init__(self, model: HybridLM, *, cuda_graphs: bool = False) -> None:
        self.model = model
        self.device = model.embed_tokens.weight.device
        self.cache = SlotCache(self.device)
        self.backends = model.backends()
        #: decode steps at bucketed shapes over static buffers (``harts.rollout.graphs``), captured
        #: in CUDA graphs: on with ``cuda_graphs`` on CUDA (a no-op elsewhere); the tests turn the
        #: static path on on the CPU, where it runs eagerly
        self.static_steps = cuda_graphs and self.device.type == "cuda"
        self._static: StaticSteps | None = None
        #: per sequence: tokens sampled but not yet run
        self.pending: dict[int, list[int]] = {}
        #: per sequence: [V] next-token logits after its consumed tokens
        self.logits: dict[int, torch.Tensor] = {}

    def open(self, count: int = 1) -> list[int]:
        """``count`` empty sequences."""
        ids = self.cache.open(count)
        for n in ids:
            self.pending[n] = []
        return ids

    def fork(self, seq: int, count: int) -> list[int]:
        """``count`` children of ``seq`` sharing its caches, logits and pending tokens."""
        ids = self.cache.fork(seq, count)
        for n in ids:
            self.pending[n] = list(self.pending[seq])
            if seq in self.logits:
                self.logits[n] = self.logits[seq]
        return ids

    def close(self, ids: Sequence[int]) -> None:
        """Free sequences ``ids`` (their slots once no fork holds them)."""
        self.cache.close(ids)
        for n in ids:
            del self.pending[n]
            self.logits.pop(n, None)

    def length(self, seq: int) -> int:
        """Tokens ``seq`` has consumed (pending ones not counted)."""
        return int(self.cache.lengths[seq])

    @torch.no_grad()
    def extend(
        self, ids: Sequence[int], tokens: Sequence[Sequence[int]], *, hidden: bool = False
    ) -> list[torch.Tensor] | None:
        """Feed sequence ``ids[b]`` its pending tokens and then ``tokens[b]``, all in one forward;
        afterwards ``logits[n]`` holds each one's next-token logits. With ``hidden``, returns each
        sequence's final hidden states (after the last norm) at every fed token, [n_b, D]."""
        if len(ids) != len(tokens):
            raise ValueError(f"{len(ids)} sequences but {len(tokens)} token lists")
        feeds = [self.pending[n] + [int(t) for t in toks] for n, toks in zip(ids, tokens)]
        empty = [n for n, f in zip(ids, feeds) if not f]
        if empty:
            raise ValueError(f"sequence {empty[0]} has no token to extend with")
        model, counts = self.model, [len(f) for f in feeds]
        if len(ids) > 1 and sum(counts) > PREFILL_TOKENS:
            return self._extend_in_groups(ids, tokens, counts, hidden)
        if self.static_steps and not hidden and max(counts) == 1 and self.cache.lengths[list(ids)].min() > 0:
            if self._static is None:
                self._static = StaticSteps(model, self.cache, self.backends, capture=self.device.type == "cuda")
            if self._static.applies(len(ids)):
                # a copy: the step's output buffer is the next step's too
                logits_BV = self._static.step(ids, [f[0] for f in feeds]).clone()
                for b, n in enumerate(ids):
                    self.pending[n] = []
                    self.logits[n] = logits_BV[b]
                return None
        ctx = FastContext(self.cache, ids, counts, self.backends, model.config.chunk_size)
        flat = torch.as_tensor([t for f in feeds for t in f], dtype=torch.int64).to(self.device)
        h = model.embed_tokens(flat)
        if model.config.embedding_multiplier != 1.0:  # Granite's scalings, as HybridLM.forward
            h = h * model.config.embedding_multiplier
        for i, layer in enumerate(model.layers):
            ctx.layer = i
            h = layer(h, ctx)[0]
        self.cache.advance(ids, counts)
        last = torch.as_tensor(np.cumsum(counts) - 1).to(self.device)
        h_TD = model.norm(h) if hidden else None
        h_last = h_TD[last] if h_TD is not None else model.norm(h[last])
        if model.config.logits_scaling != 1.0:  # logits / s, as (h / s) W^T: the head is linear
            h_TD = None if h_TD is None else h_TD / model.config.logits_scaling
            h_last = h_last / model.config.logits_scaling
        logits_BV = F.linear(h_last, model.lm_head_weight)
        for b, n in enumerate(ids):
            self.pending[n] = []
            self.logits[n] = logits_BV[b]
        return None if h_TD is None else list(h_TD.split(counts))

    def _extend_in_groups(
        self, ids: Sequence[int], tokens: Sequence[Sequence[int]], counts: list[int], hidden: bool
    ) -> list[torch.Tensor] | None:
        """``extend`` over consecutive groups of sequences of at most ``PREFILL_TOKENS`` new
        tokens each (a sequence with more is a group of its own)."""
        out: list[torch.Tensor] = []
        start = 0
        while start < len(ids):
            stop, total = start + 1, counts[start]
            while stop < len(ids) and total + counts[stop] <= PREFILL_TOKENS:
                total += counts[stop]
                stop += 1
            part = self.extend(ids[start:stop], tokens[start:stop], hidden=hidden)
            out += part or []
            start = stop
        return out if hidden else None


class FastDecoding(TurnSampler):
    """One turn of sequences ``ids`` of a ``FastDecoder`` (``Decoding``'s contract: ``step``
    until ``done``, then read ``turns``; the last sampled token stays pending). Sampling runs
    on the logits' device with ``generator`` (on that device)."""

    def __init__(
        self, decoder: FastDecoder, ids: Sequence[int], cfg: SamplingConfig, detokenize: Detokenize | None = None
    ) -> None:
        for n in ids:
            if n not in decoder.logits or decoder.pending[n]:
                raise ValueError(f"sequence {n} must have consumed its context before a turn is sampled")
        super().__init__(len(ids), cfg, detokenize)
        self.decoder, self.ids = decoder, list(ids)

    def needs_run(self) -> list[int]:
        """The live sequences whose sampled token the model has not run yet."""
        return [self.ids[i] for i in self._live if self.decoder.pending[self.ids[i]]]

    def step(self, generator: torch.Generator) -> None:
        """Run the live sequences' pending tokens and sample one more token for each."""
        need = self.needs_run()
        if need:
            self.decoder.extend(need, [[] for _ in need])
        self.sample(generator)

    def sample(self, generator: torch.Generator) -> None:
        """Sample one token for every live sequence from its current logits."""
        logits = torch.stack([self.decoder.logits[self.ids[i]] for i in self._live])
        for i, tok in self._sample(logits, generator, sample_on_device):
            self.decoder.pending[self.ids[i]] = [tok]


class DecodeBatch:
    """Continuous batching: the turns of many requests on one ``FastDecoder``, one forward per
    step over the live sequences of all of them; a request joins with ``add`` (its prompt
    already run) and leaves when ``step`` returns it, done."""

    def __init__(self, decoder: FastDecoder) -> None:
        self.decoder = decoder
        self.jobs: list[tuple[FastDecoding, torch.Generator]] = []

    def add(self, decoding: FastDecoding, generator: torch.Generator) -> None:
        if decoding.decoder is not self.decoder:
            raise ValueError("a decoding joins the batch of its own decoder")
        self.jobs.append((decoding, generator))

    def remove(self, decoding: FastDecoding) -> None:
        """``decoding`` leaves before it is done (its request was dropped); its sequences stay
        open in the decoder (the caller closes them)."""
        self.jobs = [(d, g) for d, g in self.jobs if d is not decoding]

    def step(self) -> list[FastDecoding]:
        """One decoding step of every request; returns those that finished (and left)."""
        need = [n for d, _ in self.jobs for n in d.needs_run()]
        if need:
            self.decoder.extend(need, [[] for _ in need])
        for d, gen in self.jobs:
            if not d.done:
                d.sample(gen)
        done = [d for d, _ in self.jobs if d.done]
        self.jobs = [(d, g) for d, g in self.jobs if not d.done]
        return done
