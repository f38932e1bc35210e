"""Sampling for Tinker's sampling clients, with harts' own sampler (``harts.rollout``).

A request's prompt runs once through the model (``extend``); the branch is forked
``num_samples`` times, sharing the prompt's caches, and every fork decodes with ``generate``
(temperature, 0 for greedy; top-k; top-p; max tokens; stop tokens, and stop strings matched on
the text the served tokenizer decodes, ``harts.serve.tokenizer``), so a group of samples costs one
prompt. Each sampled token carries its log-prob under the distribution it was drawn from; at
temperature 1 without top-k or top-p that is the model's own log-prob, which a ``forward`` of the
same tokens reproduces. A stop string ends a sample at the token that completes it, kept in the
sample (as a stop token is), with stop reason ``stop``; EOS stops a sample unless ``stop`` is
``[]``. Top-k log-probs (``topk_prompt_logprobs``, ``topk_sample_logprobs``) are the model's own
distribution's k most likely tokens, from the same prompt pass and decoding steps: the prompt's
first position (no context) and those before ``prompt_logprobs_last_n`` carry the SDK's sentinel.
The same prompt pass answers ``target_prompt_logprobs`` (the model's log-probs of the ids asked
for at each prompt position, dense or sparse as asked) and ``prompt_alt_tokens_k`` (k draws per
position at the request's temperature, with the model's log-probs).
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

On CUDA the prompt and the decoding steps run on the batched decoder (``harts.rollout.fast``:
chunked prefill, fused recurrent steps, slot caches the forks share, sampling on the device);
elsewhere on the reference decoder, with the same answers (``tests/serve/test_sampling_fast.py``).
There, concurrent requests of the same weights decode together in one batch (``SampleBatches``,
``SampleRun``): a request joins at the next step and leaves when done, each answering what it
answers alone.
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from harts.errors import UserError
from harts.rollout.decode import extend_hidden, new_branch
from harts.rollout.fast import DecodeBatch, FastDecoder, FastDecoding, fast_decoding_applies
from harts.rollout.sampler import Decoding, Detokenize, SamplingConfig, topk_logprobs
from harts.serve.futures import Done
from harts.serve.tokenizer import detokenizer
from harts.serve.wire import (
    PROTO_MEDIA_TYPE,
    WireError,
    encode_sample_response,
    finite,
    prompt_target_ids,
    prompt_tokens,
)
from harts.serve.worker import Later, Step

if TYPE_CHECKING:
    from harts.models.hybrid_lm import HybridLM
    from harts.trainer.engine import Engine

__all__ = [
    "MAX_TOPK_LOGPROBS",
    "SAMPLER_ENGINES",
    "SLICE_SECONDS",
    "SampleBatches",
    "SampleJob",
    "SampleRun",
    "SamplerEngines",
    "SharedBatch",
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
    #: return the model's k most likely tokens at every prompt position (0: none)
    topk_prompt_logprobs: int = 0
    #: ``target_prompt_logprobs``: [len(prompt) - 1, K] ids whose log-probs to return (-1: none),
    #: and the sparse request's (row pointers, column indices) to answer in its layout
    prompt_targets: np.ndarray | None = None
    prompt_targets_layout: tuple[np.ndarray, np.ndarray] | None = None
    #: ``prompt_alt_tokens_k``: draws per prompt position after the first (0: none)
    prompt_alt_tokens_k: int = 0

    @property
    def prompt_hidden(self) -> bool:
        """Whether the prompt pass keeps its final hidden states (a per-position prompt output
        beyond the plain log-probs was asked for)."""
        return bool(self.topk_prompt_logprobs or self.prompt_targets is not None or self.prompt_alt_tokens_k)

    #: the served tokenizer's decoding, when the request has stop strings
    detokenize: Detokenize | None = None


#: the most top-k log-probs one request may ask for per position (each costs 8 bytes per
#: position in the answer)
MAX_TOPK_LOGPROBS = 128
#: prompt rows whose logits one step of the prompt's top-k holds at once
PROMPT_ROWS = 256


#: how long one turn of a sampling job decodes before the worker lets the other lanes take theirs
SLICE_SECONDS = 0.05

#: ``weights()``: (engine, tensors to swap in) a sampling job samples with, looked up afresh for
#: every slice (the run may have trained, or the engine been reloaded, in between)
Weights = Callable[[], "tuple[Engine, dict[str, torch.Tensor] | None]"]


class SharedBatch:
    """The requests that sample one weights source on the batched decoder: one ``FastDecoder``,
    one ``DecodeBatch`` over all their samples, and the ``SampleRun`` of each decoding."""

    def __init__(self, key: Hashable, decoder: FastDecoder) -> None:
        self.key = key
        self.decoder = decoder
        self.batch = DecodeBatch(decoder)
        #: id of a member's ``FastDecoding`` -> its run
        self.runs: dict[int, SampleRun] = {}
        #: why the batch cannot go on (a step raised half-way through); None while it can
        self.failed: str | None = None

    def join(self, run: SampleRun, decoding: FastDecoding, generator: torch.Generator) -> None:
        """``decoding`` (its prompt run, forked) decodes from the next step on."""
        self.batch.add(decoding, generator)
        self.runs[id(decoding)] = run

    def step(self) -> list[SampleRun]:
        """One decoding step of every member: the runs that finished, their sequences closed."""
        finished = []
        for decoding in self.batch.step():
            finished.append(self.runs.pop(id(decoding)))
            self.decoder.close(decoding.ids)
        return finished

    def leave(self, decoding: FastDecoding) -> None:
        """``decoding`` stops before it is done: out of the batch, its sequences closed."""
        if self.runs.pop(id(decoding), None) is None:
            return
        self.batch.remove(decoding)
        if self.failed is None:
            self.decoder.close(decoding.ids)


class SampleBatches:
    """The ``SharedBatch`` of each weights source (``SampleRun``'s ``weights_key``): requests on
    the batched decoder that sample the same weights decode together, requests on different
    weights never do. A batch is dropped with its last member, and its caches with it. Used by
    the worker thread only."""

    def __init__(self) -> None:
        self._items: dict[Hashable, SharedBatch] = {}

    def sizes(self) -> dict[Hashable, tuple[int, int]]:
        """Per weights source with a batch: (requests decoding, sequences open in its decoder)."""
        return {k: (len(b.runs), int(b.decoder.cache.live.sum())) for k, b in self._items.items()}

    def get(self, key: Hashable, model: HybridLM) -> SharedBatch:
        """The batch of ``key`` (a new one if it has none), decoding with ``model`` this slice."""
        shared = self._items.get(key)
        if shared is None:
            shared = self._items[key] = SharedBatch(key, FastDecoder(model))
        shared.decoder.model = model
        return shared

    def release(self, shared: SharedBatch, failed: str | None = None) -> None:
        """Forget ``shared`` once it has no members, or at once when it ``failed`` (why)."""
        if failed is not None:
            shared.failed = failed
        if (failed is not None or not shared.runs) and self._items.get(shared.key) is shared:
            del self._items[shared.key]


class SampleRun:
    """One sampling request as the worker runs it, in slices (``harts.serve.worker.Later``): the
    prompt in the first, then decoding steps until ``slice_seconds`` have passed (or ten times
    the swap, when that is longer), the rest at the job's next turn. Every slice swaps the
    sampled weights in and back out, so whatever other lanes run in between sees its own
    weights; the caches of the prompt and of every sample stay here, and the decoding is
    ``generate``'s (``Decoding``), so the tokens and log-probs are the same however the work is
    sliced. ``on_done`` is told every sample's token count once they have all stopped (the
    server's log of sampled sequences, ``harts.serve.provenance``).

    With ``batches``, on the batched decoder, requests of the same ``weights_key`` (the source
    of their weights: a snapshot, a checkpoint, the base model) decode together (continuous
    batching): a request's first slice runs its prompt and joins its source's ``SharedBatch``,
    and every slice of any member steps all members' samples in one forward per step. Each
    request samples with its own generator, so its tokens and log-probs are those it samples
    alone (``tests/serve/test_sampling_batched.py``). Its slices rotate with its lane's other
    requests (``Later.rotate``), so they join too; one another's slice finished is handed to
    ``settle`` (the server resolves it at once), else answered at its next turn; a request the
    worker drops leaves the batch (``leave``). ``fast`` forces the batched decoder (True) or the
    reference (False); None: ``fast_decoding_applies``."""

    def __init__(
        self,
        job: SampleJob,
        weights: Weights,
        *,
        slice_seconds: float = SLICE_SECONDS,
        on_done: Callable[[list[int]], None] | None = None,
        batches: SampleBatches | None = None,
        weights_key: Hashable = None,
        fast: bool | None = None,
    ) -> None:
        self.job = job
        self.weights = weights
        self.slice_seconds = slice_seconds
        self.on_done = on_done
        self.batches, self.weights_key, self.fast = batches, weights_key, fast
        #: set by the server once the job is queued: resolves it when another's slice finished it
        self.settle: Callable[[Done], object] | None = None
        self._generator = torch.Generator().manual_seed(job.seed)
        self._decoding: Decoding | FastDecoding | None = None
        self._prompt_topk: tuple[np.ndarray, np.ndarray] | None = None
        self._prompt_targets: np.ndarray | None = None
        self._prompt_alt: tuple[np.ndarray, np.ndarray] | None = None
        self._prompt_lp: np.ndarray | None = None
        self._shared: SharedBatch | None = None
        self._result: Done | None = None

    def step(self) -> Step:
        """One slice: the result once every sample has stopped, else ``Later(self.step)``."""
        if self._result is not None:  # finished by another request's slice of the shared batch
            return self._result
        engine, tensors = self.weights()
        model = engine.model
        started = time.monotonic()
        with swapped(model, tensors):
            # a slice outlasts its swap tenfold (a run without LoRA swaps every weight)
            deadline = time.monotonic() + max(self.slice_seconds, 10 * (time.monotonic() - started))
            if self.batches is not None and self._is_fast(model):
                return self._shared_slice(engine, model, deadline)
            if self._decoding is None:
                self._decoding = self._start(model)
            decoding = self._decoding
            while not decoding.done:  # one step at least, however short the slice
                if isinstance(decoding, FastDecoding):
                    decoding.decoder.model = model
                    decoding.step(self._generator)
                else:
                    decoding.step(model, self._generator)
                if time.monotonic() >= deadline:
                    break
            if not decoding.done:
                return Later(self.step)
            self._prompt_lp = _prompt_logprobs(engine, self.job) if self.job.prompt_logprobs else None
        return self._answer()

    def leave(self) -> None:
        """Take this request's samples out of its shared batch (the worker dropped it: cancelled,
        or its session ended); nothing once it has finished."""
        shared, self._shared = self._shared, None
        if shared is None or not isinstance(self._decoding, FastDecoding):
            return
        shared.leave(self._decoding)
        assert self.batches is not None
        self.batches.release(shared)

    def _is_fast(self, model: HybridLM) -> bool:
        return fast_decoding_applies(model) if self.fast is None else self.fast

    def _shared_slice(self, engine: Engine, model: HybridLM, deadline: float) -> Step:
        """A slice on the shared batch of ``weights_key``: join it (first slice), then step all
        its members until this request has finished or ``deadline`` passed."""
        assert self.batches is not None
        if self._decoding is None:
            self._join(engine, model)
        shared = self._shared
        if shared is None:  # it left the batch: finished (its answer failed) or dropped
            raise RuntimeError("this request's samples left their batch without an answer")
        if shared.failed is not None:
            raise RuntimeError(f"the batch this request decoded in failed: {shared.failed}")
        # the same weights, though the engine holding them may have been loaded again
        shared.decoder.model = model
        while True:  # one step at least, however short the slice
            try:
                finished = shared.step()
            except Exception as err:  # half a step ran: no member can go on
                self.batches.release(shared, failed=f"{type(err).__name__}: {err}")
                raise
            for run in finished:
                run._shared = None
                run._result = run._answer()
                if run is not self and run.settle is not None:
                    run.settle(run._result)
            if self._result is not None:
                self.batches.release(shared)
                return self._result
            if time.monotonic() >= deadline:
                return Later(self.step, drop=self.leave, rotate=True)

    def _join(self, engine: Engine, model: HybridLM) -> None:
        """Run the prompt on the shared decoder of ``weights_key``, fork it ``num_samples`` times
        and join the batch (the prompt's log-probs and top-k now, with the same weights)."""
        assert self.batches is not None
        job = self.job
        self._prompt_lp = _prompt_logprobs(engine, job) if job.prompt_logprobs else None
        shared = self.batches.get(self.weights_key, model)
        decoder = shared.decoder
        (seq,) = decoder.open()
        try:
            hidden = decoder.extend([seq], [job.prompt], hidden=job.prompt_hidden)
            ids = decoder.fork(seq, job.num_samples)
        except Exception:
            decoder.close([seq])
            self.batches.release(shared)
            raise
        decoder.close([seq])  # the forks hold its slots
        if hidden is not None:
            self._prompt_outputs_from(model, hidden[0])
        self._generator = torch.Generator(decoder.device).manual_seed(job.seed)
        self._decoding = FastDecoding(decoder, ids, job.config, job.detokenize)
        shared.join(self, self._decoding, self._generator)
        self._shared = shared

    def _answer(self) -> Done:
        """The response of the finished decoding (``on_done`` told every sample's length)."""
        assert self._decoding is not None
        turns = self._decoding.turns
        if self.on_done is not None:
            self.on_done([len(t.tokens) for t in turns])
        sequences = [(t.tokens, t.logprobs, t.stopped) for t in turns]
        sample_topk = None
        if self.job.config.topk_logprobs:
            sample_topk = [(np.array(t.topk_ids), np.array(t.topk_logprobs)) for t in turns]
        body = encode_sample_response(
            sequences,
            self._prompt_lp,
            sample_topk=sample_topk,
            prompt_topk=self._prompt_topk,
            prompt_targets=self._prompt_targets,
            prompt_targets_layout=self.job.prompt_targets_layout,
            prompt_alt=self._prompt_alt,
        )
        return Done(body, PROTO_MEDIA_TYPE)

    def _start(self, model: HybridLM) -> Decoding | FastDecoding:
        """The prompt run once and forked into ``num_samples`` decodings: by the batched decoder
        (``harts.rollout.fast``, sampling on the device) on CUDA, by the reference elsewhere."""
        job = self.job
        if not self._is_fast(model):
            (branch,), (hidden_TD,) = extend_hidden(model, [new_branch(model)], [job.prompt])
            self._prompt_outputs_from(model, hidden_TD)
            return Decoding(branch.fork(job.num_samples), job.config, job.detokenize)
        decoder = FastDecoder(model)
        (seq,) = decoder.open()
        hidden = decoder.extend([seq], [job.prompt], hidden=job.prompt_hidden)
        if hidden is not None:
            self._prompt_outputs_from(model, hidden[0])
        self._generator = torch.Generator(decoder.device).manual_seed(job.seed)
        return FastDecoding(decoder, decoder.fork(seq, job.num_samples), job.config, job.detokenize)

    @torch.no_grad()
    def _prompt_outputs_from(self, model: HybridLM, hidden_TD: torch.Tensor) -> None:
        """The prompt's per-position outputs from its pass's final hidden states ``hidden_TD``
        (position i from the logits after token i - 1), a few rows of logits at a time:
        ``topk_prompt_logprobs`` (rows without any: id -1), ``target_prompt_logprobs``' log-probs
        (0.0 where nothing was asked) and ``prompt_alt_tokens_k``'s draws, at the request's
        temperature (greedy at 0: the argmax k times) from a generator of their own seeded with the
        request's seed, so the samples are the same with or without them; each with the model's
        own log-prob."""
        job, prompt = self.job, self.job.prompt
        k, targets, alt_k = job.topk_prompt_logprobs, job.prompt_targets, job.prompt_alt_tokens_k
        if not job.prompt_hidden:
            return
        n = len(prompt)
        first_topk = 1 if job.prompt_logprobs_last_n is None else n - job.prompt_logprobs_last_n
        top_ids = np.full((n, k), -1, dtype=np.int64)
        top_lps = np.zeros((n, k))
        target_lps = None if targets is None else np.zeros(targets.shape)
        alt_ids = np.zeros((n - 1, alt_k), dtype=np.int64)
        alt_lps = np.zeros((n - 1, alt_k))
        generator = torch.Generator(hidden_TD.device).manual_seed(job.seed) if alt_k else None
        temperature = job.config.temperature
        # a long prompt's [T, V] logits are never held at once
        for start in range(1, n, PROMPT_ROWS):
            stop = min(start + PROMPT_ROWS, n)
            logits = torch.nn.functional.linear(hidden_TD[start - 1 : stop - 1], model.lm_head_weight)
            if k and stop > first_topk:
                lo = max(start, first_topk)
                ids, lps = topk_logprobs(logits[lo - start :], k)
                top_ids[lo:stop], top_lps[lo:stop] = ids.numpy(), lps.numpy()
            if targets is None and not alt_k:
                continue
            logp = torch.log_softmax(logits.to(torch.float64 if logits.device.type == "cpu" else torch.float32), -1)
            if targets is not None and target_lps is not None:
                want = torch.as_tensor(targets[start - 1 : stop - 1], device=logp.device)
                got = logp.gather(1, want.clamp(min=0)).where(want >= 0, 0.0)
                target_lps[start - 1 : stop - 1] = got.cpu().numpy()
            if alt_k:
                if temperature == 0:
                    draws = logits.argmax(-1, keepdim=True).expand(-1, alt_k)
                else:
                    probs = torch.softmax(logits.to(logp.dtype) / temperature, -1)
                    draws = torch.multinomial(probs, alt_k, replacement=True, generator=generator)
                alt_ids[start - 1 : stop - 1] = draws.cpu().numpy()
                alt_lps[start - 1 : stop - 1] = logp.gather(1, draws).cpu().numpy()
        if k:
            self._prompt_topk = (top_ids, top_lps)
        self._prompt_targets = target_lps
        self._prompt_alt = (alt_ids, alt_lps) if alt_k else None


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
    tokenizer: str | None = None,
) -> SampleJob:
    """A ``SampleJob`` from tinker's validated ``SampleRequest``; every unsupported option refused by
    name (``WireError``). ``eos_tokens`` stop a sample unless the request's ``stop`` is ``[]``;
    ``max_sample_tokens`` bounds the prompt plus ``num_samples`` x ``max_tokens``; ``tokenizer``:
    the served tokenizer's directory, which string stop sequences need."""
    if not 1 <= req.num_samples <= max_samples:
        raise WireError(f"num_samples: {req.num_samples}; between 1 and {max_samples} (--max-samples)")
    limit = min(MAX_TOPK_LOGPROBS, vocab_size)
    for name, value in (
        ("topk_prompt_logprobs", req.topk_prompt_logprobs),
        ("topk_sample_logprobs", req.topk_sample_logprobs),
    ):
        if not 0 <= value <= limit:
            raise WireError(f"{name}: {value}; between 0 and {limit} (the vocabulary, or {MAX_TOPK_LOGPROBS})")
    if not 0 <= req.prompt_alt_tokens_k <= limit:
        raise WireError(
            f"prompt_alt_tokens_k: {req.prompt_alt_tokens_k}; between 0 and {limit} (the vocabulary, or "
            f"{MAX_TOPK_LOGPROBS})"
        )
    if req.record_stability_info:
        raise WireError(
            "record_stability_info: Tinker does not define the stability information, which only stable_reinforce "
            "reads, and harts serves no stable_reinforce; sample without it (every sequence still gets a sequence_id "
            "for a datum's provenance)"
        )
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
    if not finite(float(p.temperature), "sampling_params.temperature") >= 0:
        raise WireError(f"sampling_params.temperature: {p.temperature}; must be >= 0 (0: greedy)")
    if not 0 < finite(float(p.top_p), "sampling_params.top_p") <= 1:
        raise WireError(f"sampling_params.top_p: {p.top_p}; must be in (0, 1]")
    if p.top_k < -1:
        raise WireError(f"sampling_params.top_k: {p.top_k}; -1 (or 0) for no limit, else at least 1")
    targets, layout = None, None
    if req.target_prompt_logprobs is not None:
        targets, layout = prompt_target_ids(req.target_prompt_logprobs, len(prompt) - 1, vocab_size, MAX_TOPK_LOGPROBS)
    last_n = req.prompt_logprobs_last_n
    if last_n is not None and not (req.prompt_logprobs and 1 <= last_n < len(prompt)):
        raise WireError(f"prompt_logprobs_last_n: {last_n}; needs prompt_logprobs and 1 <= N < len(prompt)")
    seed = int(p.seed) if p.seed is not None else default_seed
    stop_tokens, stop_strings = _stop(p.stop, eos_tokens, vocab_size)
    detokenize = _detokenizer(tokenizer) if stop_strings else None
    return SampleJob(
        prompt=prompt,
        num_samples=req.num_samples,
        config=SamplingConfig(
            temperature=float(p.temperature),
            top_p=float(p.top_p),
            top_k=int(p.top_k) if 1 <= p.top_k < vocab_size else None,
            max_tokens=int(p.max_tokens),
            stop_tokens=stop_tokens,
            stop_strings=stop_strings,
            topk_logprobs=int(req.topk_sample_logprobs),
        ),
        seed=seed,
        prompt_logprobs=bool(req.prompt_logprobs),
        prompt_logprobs_last_n=last_n,
        topk_prompt_logprobs=int(req.topk_prompt_logprobs),
        prompt_targets=targets,
        prompt_targets_layout=layout,
        prompt_alt_tokens_k=int(req.prompt_alt_tokens_k),
        detokenize=detokenize,
    )


def _detokenizer(tokenizer: str | None) -> Detokenize:
    """The served tokenizer's decoding, which string stop sequences are matched on."""
    if tokenizer is None:
        raise WireError(
            "sampling_params.stop: string stop sequences need the served tokenizer, and this server has none "
            "(serve a checkpoint directory with tokenizer files, or pass --tokenizer DIR); pass token ids"
        )
    try:
        return detokenizer(tokenizer)
    except UserError as err:
        raise WireError(f"sampling_params.stop: {err}") from None


def _stop(stop: Any, eos_tokens: tuple[int, ...], vocab_size: int) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """(stop tokens, stop strings) of ``sampling_params.stop``: None stops at EOS only, ``[]`` at
    nothing, token ids or strings at those and at EOS (the SDK's ``SamplingParams.stop``)."""
    if stop is None:
        return eos_tokens, ()
    items = [stop] if isinstance(stop, str) else list(stop)
    strings = tuple(s for s in items if isinstance(s, str))
    if strings:
        if len(strings) != len(items):
            raise WireError("sampling_params.stop: token ids and strings mixed; pass one kind")
        if any(not s for s in strings):
            raise WireError("sampling_params.stop: an empty string (it would stop before any token)")
        return eos_tokens, strings
    if not items:
        return (), ()
    out = tuple(int(s) for s in items)
    bad = [s for s in out if not 0 <= s < vocab_size]
    if bad:
        raise WireError(f"sampling_params.stop: token {bad[0]} is outside the vocabulary [0, {vocab_size})")
    return tuple(dict.fromkeys(out + eos_tokens)), ()
