"""Sampling for Tinker's sampling clients, with harts' own sampler (``harts.rollout``).

A request's prompt runs once through the model (``extend``); the branch is forked
``num_samples`` times, sharing the prompt's caches, and every fork decodes with ``generate``
(temperature, top-p, max tokens, stop tokens), so a group of samples costs one prompt. Each
sampled token carries its log-prob under the distribution it was drawn from; at temperature 1
and top-p 1 that is the model's own log-prob, which a ``forward`` of the same tokens reproduces.
The worker runs a request in slices of decoding steps (``SampleRun``), so other runs' steps go
between them; a request's tokens (prompt + ``num_samples`` x ``max_tokens``) are bounded by
``--max-sample-tokens`` before it is queued.

Which weights: a sampling client made by ``save_weights_for_sampler`` samples the adapter
weights saved then. The server keeps those as a ``Snapshot`` of the run's trainable tensors (the
LoRA factors, small beside the model) and, for the sample, copies them into the run's own model
and back afterwards -- or not at all when the run has not changed since (``version``). A
sampling client of the base model, or of a checkpoint that is on disk but not in memory (after a
restart, or once its snapshot was dropped for newer ones), samples a model loaded for sampling
only (``SamplerEngines``).

This is a reference sampler for a CPU-sized model and for tests: a real deployment samples with
an inference engine (vLLM, SGLang) loaded from the ``save_weights_for_sampler`` export.
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from harts.rollout.decode import extend, new_branch
from harts.rollout.sampler import Decoding, SamplingConfig
from harts.serve.futures import Done
from harts.serve.wire import PROTO_MEDIA_TYPE, WireError, encode_sample_response, finite, prompt_tokens
from harts.serve.worker import Later, Step

if TYPE_CHECKING:
    from harts.trainer.engine import Engine

__all__ = [
    "SAMPLER_ENGINES",
    "SLICE_SECONDS",
    "SampleJob",
    "SampleRun",
    "SamplerEngines",
    "Snapshot",
    "Snapshots",
    "sample_job",
    "take_snapshot",
]


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The trainable tensors of a run at one moment (``version`` counts its weight updates)."""

    model_id: str
    version: int
    tensors: dict[str, torch.Tensor]


def take_snapshot(model_id: str, version: int, model: torch.nn.Module) -> Snapshot:
    """Copy every trainable tensor of ``model`` (its LoRA factors, or all weights without LoRA)."""
    with torch.no_grad():
        tensors = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return Snapshot(model_id, version, tensors)


class Snapshots:
    """Snapshots by id, the most recently used kept (at most ``limit``); thread-safe."""

    def __init__(self, limit: int) -> None:
        self._limit = max(1, limit)
        self._lock = threading.Lock()
        self._items: OrderedDict[str, Snapshot] = OrderedDict()

    def put(self, key: str, snap: Snapshot) -> None:
        with self._lock:
            self._items[key] = snap
            self._items.move_to_end(key)
            while len(self._items) > self._limit:
                self._items.popitem(last=False)

    def get(self, key: str) -> Snapshot | None:
        with self._lock:
            snap = self._items.get(key)
            if snap is not None:
                self._items.move_to_end(key)
            return snap

    def drop_run(self, model_id: str) -> None:
        """Forget every snapshot of run ``model_id`` (it was released)."""
        with self._lock:
            for key in [k for k, s in self._items.items() if s.model_id == model_id]:
                del self._items[key]


#: engines ``SamplerEngines`` keeps by default (``harts serve``'s memory check counts them)
SAMPLER_ENGINES = 2


class SamplerEngines:
    """Engines loaded for sampling only (the base model, checkpoints read from disk), the most
    recently used ``limit`` kept; used by the worker thread only."""

    def __init__(self, limit: int = SAMPLER_ENGINES) -> None:
        self._limit = max(1, limit)
        self._items: OrderedDict[str, Engine] = OrderedDict()

    def get(self, key: str, load: Callable[[], Engine]) -> Engine:
        engine = self._items.get(key)
        if engine is None:
            engine = load()
            self._items[key] = engine
        self._items.move_to_end(key)
        while len(self._items) > self._limit:
            self._items.popitem(last=False)
        return engine


@contextmanager
def swapped(model: torch.nn.Module, tensors: dict[str, torch.Tensor] | None) -> Iterator[None]:
    """``model`` with ``tensors`` copied into its parameters, restored on exit."""
    if not tensors:
        yield
        return
    params = dict(model.named_parameters())
    with torch.no_grad():
        saved = {n: params[n].detach().clone() for n in tensors}
        for n, t in tensors.items():
            params[n].copy_(t)
    try:
        yield
    finally:
        with torch.no_grad():
            for n, t in saved.items():
                params[n].copy_(t)


@dataclass(frozen=True, slots=True)
class SampleJob:
    """One validated sampling request."""

    prompt: list[int]
    num_samples: int
    config: SamplingConfig
    seed: int
    #: return the prompt's log-probs (``[NaN, lp_1, ...]``), only the last N when set
    prompt_logprobs: bool = False
    prompt_logprobs_last_n: int | None = None


#: how long one turn of a sampling job decodes before the worker lets the other lanes take theirs
SLICE_SECONDS = 0.05

#: ``weights()``: (engine, tensors to swap in) a sampling job samples with, looked up afresh for
#: every slice (the run may have trained, or the engine been reloaded, in between)
Weights = Callable[[], "tuple[Engine, dict[str, torch.Tensor] | None]"]


class SampleRun:
    """One sampling request as the worker runs it, in slices (``harts.serve.worker.Later``): the
    prompt in the first, then decoding steps until ``slice_seconds`` have passed (or ten times
    the swap, when that is longer), the rest at the job's next turn. Every slice swaps the
    sampled weights in and back out, so whatever other lanes run in between sees its own
    weights; the caches of the prompt and of every sample stay here, and the decoding is
    ``generate``'s (``Decoding``), so the tokens and log-probs are the same however the work is
    sliced."""

    def __init__(self, job: SampleJob, weights: Weights, *, slice_seconds: float = SLICE_SECONDS) -> None:
        self.job = job
        self.weights = weights
        self.slice_seconds = slice_seconds
        self._generator = torch.Generator().manual_seed(job.seed)
        self._decoding: Decoding | None = None

    def step(self) -> Step:
        """One slice: the result once every sample has stopped, else ``Later(self.step)``."""
        engine, tensors = self.weights()
        model = engine.model
        started = time.monotonic()
        with swapped(model, tensors):
            # a slice outlasts its swap tenfold (a run without LoRA swaps every weight)
            deadline = time.monotonic() + max(self.slice_seconds, 10 * (time.monotonic() - started))
            if self._decoding is None:
                branch = extend(model, [new_branch(model)], [self.job.prompt])[0]
                self._decoding = Decoding(branch.fork(self.job.num_samples), self.job.config)
            decoding = self._decoding
            while not decoding.done:  # one step at least, however short the slice
                decoding.step(model, self._generator)
                if time.monotonic() >= deadline:
                    break
            if not decoding.done:
                return Later(self.step)
            prompt_lp = _prompt_logprobs(engine, self.job) if self.job.prompt_logprobs else None
        stop = set(self.job.config.stop_tokens)
        sequences = [(t.tokens, t.logprobs, bool(t.tokens) and t.tokens[-1] in stop) for t in decoding.turns]
        return Done(encode_sample_response(sequences, prompt_lp), PROTO_MEDIA_TYPE)


def _prompt_logprobs(engine: Engine, job: SampleJob) -> np.ndarray:
    out = np.full(len(job.prompt), math.nan)
    if len(job.prompt) > 1:
        out[1:] = engine.forward([{"tokens": job.prompt}])[0]
    if job.prompt_logprobs_last_n is not None:
        out[: len(out) - job.prompt_logprobs_last_n] = math.nan
    return out


def sample_job(
    req: Any,
    *,
    vocab_size: int,
    eos_tokens: tuple[int, ...],
    capacity: int,
    max_samples: int,
    default_seed: int,
    max_sample_tokens: int | None = None,
) -> SampleJob:
    """A ``SampleJob`` from tinker's validated ``SampleRequest``; every unsupported option refused by
    name (``WireError``). ``eos_tokens`` stop a sample when the request names no ``stop``;
    ``max_sample_tokens`` bounds the prompt plus ``num_samples`` x ``max_tokens``."""
    if not 1 <= req.num_samples <= max_samples:
        raise WireError(f"num_samples: {req.num_samples}; between 1 and {max_samples} (--max-samples)")
    for name, value in (
        ("topk_prompt_logprobs", req.topk_prompt_logprobs),
        ("topk_sample_logprobs", req.topk_sample_logprobs),
        ("prompt_alt_tokens_k", req.prompt_alt_tokens_k),
    ):
        if value:
            raise WireError(f"{name}: {value}; harts serve returns no top-k or alternative tokens (use 0)")
    if req.target_prompt_logprobs is not None:
        raise WireError("target_prompt_logprobs: not supported by harts serve")
    if req.record_stability_info:
        raise WireError("record_stability_info: not supported by harts serve (it serves no stable_reinforce)")
    prompt = prompt_tokens(req.prompt.chunks, "prompt", vocab_size)
    if not prompt:
        raise WireError("prompt: empty (sampling needs at least one prompt token)")
    p = req.sampling_params
    if p.max_tokens is None or p.max_tokens < 1:
        raise WireError(f"sampling_params.max_tokens: {p.max_tokens}; give the most tokens to sample (>= 1)")
    if len(prompt) + p.max_tokens > capacity:
        raise WireError(
            f"sampling_params.max_tokens: prompt ({len(prompt)}) + max_tokens ({p.max_tokens}) is over "
            f"the server's {capacity} tokens (--capacity)"
        )
    budget = len(prompt) + p.max_tokens * req.num_samples
    if max_sample_tokens is not None and budget > max_sample_tokens:
        raise WireError(
            f"num_samples x sampling_params.max_tokens: prompt ({len(prompt)}) + {req.num_samples} x "
            f"{p.max_tokens} = {budget} tokens; this server samples at most {max_sample_tokens} tokens per "
            "request (--max-sample-tokens): ask for fewer samples or fewer tokens, or split the request"
        )
    if not finite(float(p.temperature), "sampling_params.temperature") > 0:
        raise WireError(f"sampling_params.temperature: {p.temperature}; must be > 0 (harts samples, no greedy)")
    if not 0 < finite(float(p.top_p), "sampling_params.top_p") <= 1:
        raise WireError(f"sampling_params.top_p: {p.top_p}; must be in (0, 1]")
    if p.top_k not in (-1, 0) and p.top_k < vocab_size:
        raise WireError(f"sampling_params.top_k: {p.top_k}; harts serve samples with top_k = -1 only")
    last_n = req.prompt_logprobs_last_n
    if last_n is not None and not (req.prompt_logprobs and 1 <= last_n < len(prompt)):
        raise WireError(f"prompt_logprobs_last_n: {last_n}; needs prompt_logprobs and 1 <= N < len(prompt)")
    seed = int(p.seed) if p.seed is not None else default_seed
    return SampleJob(
        prompt=prompt,
        num_samples=req.num_samples,
        config=SamplingConfig(
            temperature=float(p.temperature),
            top_p=float(p.top_p),
            max_tokens=int(p.max_tokens),
            stop_tokens=_stop_tokens(p.stop, eos_tokens, vocab_size),
        ),
        seed=seed,
        prompt_logprobs=bool(req.prompt_logprobs),
        prompt_logprobs_last_n=last_n,
    )


def _stop_tokens(stop: Any, eos_tokens: tuple[int, ...], vocab_size: int) -> tuple[int, ...]:
    if stop is None:
        return eos_tokens
    if isinstance(stop, str) or any(isinstance(s, str) for s in stop):
        raise WireError("sampling_params.stop: string stop sequences are not supported; pass token ids")
    out = tuple(int(s) for s in stop)
    bad = [s for s in out if not 0 <= s < vocab_size]
    if bad:
        raise WireError(f"sampling_params.stop: token {bad[0]} is outside the vocabulary [0, {vocab_size})")
    return out
