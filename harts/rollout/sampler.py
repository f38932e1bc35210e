"""Batched sampling across live branches: temperature (0: greedy), top-k, top-p, max tokens,
stop tokens and stop strings, and the model's top-k log-probs at every sampled position.

``generate`` decodes one turn for many branches at once: every decoding step runs one
``extend`` over the branches still live (each feeding the token it sampled last), samples one
token per branch from its logits and records that token's log-probability under the
distribution it was drawn from (after temperature, top-k and top-p). With temperature 1, top-k
off and top-p 1 that is the model's own log-prob, which the training forward must reproduce (the
train/inference consistency check; ``harts.trainer.online`` reports the gap every step). At
temperature 0 the token is the argmax and its log-prob is the model's own: the point mass it was
drawn from has log-prob 0 and says nothing.

A branch stops at a stop token (kept, as the end of its turn), at the first token after which
the decoded turn contains a stop string (kept too, however the string splits over tokens) or
after ``max_tokens``. Its last token stays ``pending``: the next ``extend`` (the environment's
observation, or the next turn) runs it first, so no token is run twice and none is skipped.

Randomness comes only from the ``torch.Generator`` passed in (on the host): the same generator
state and the same weights sample the same tokens in any execution mode.

Shapes: logits_BV for B live branches and vocabulary V; k the top-k log-probs asked for.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch

from harts.models.hybrid_lm import HybridLM
from harts.rollout.decode import Branch, extend

__all__ = [
    "Decoding",
    "Detokenize",
    "SamplingConfig",
    "Turn",
    "TurnSampler",
    "generate",
    "sample_on_device",
    "sample_tokens",
    "topk_logprobs",
]

#: token ids -> their text, as the served tokenizer decodes them (special tokens kept)
Detokenize = Callable[[Sequence[int]], str]
#: ``sample_tokens`` or ``sample_on_device``: (logits [B, V], config, generator) -> (tokens, log-probs)
Sampler = Callable[["torch.Tensor", "SamplingConfig", "torch.Generator"], "tuple[torch.Tensor, torch.Tensor]"]


@dataclass(frozen=True, kw_only=True, slots=True)
class SamplingConfig:
    """How one agent turn is sampled."""

    #: softmax temperature (>= 0); 1 samples from the model's distribution, 0 takes the argmax
    temperature: float = 1.0
    #: nucleus sampling: keep the smallest set of tokens whose probability reaches top_p
    top_p: float = 1.0
    #: sample among the k most likely tokens only (applied before top_p); None: no limit
    top_k: int | None = None
    #: most tokens per turn
    max_tokens: int = 16
    #: tokens that end a turn (kept as the turn's last token)
    stop_tokens: tuple[int, ...] = field(default_factory=tuple)
    #: strings that end a turn once the decoded turn contains one (``Decoding`` needs a detokenizer)
    stop_strings: tuple[str, ...] = field(default_factory=tuple)
    #: record the model's k most likely tokens and their log-probs at every sampled position
    topk_logprobs: int = 0

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1 (or None), got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if any(not s for s in self.stop_strings):
            raise ValueError("stop_strings must not hold an empty string")
        if self.topk_logprobs < 0:
            raise ValueError(f"topk_logprobs must be >= 0, got {self.topk_logprobs}")


@dataclass
class Turn:
    """What ``generate`` sampled for one branch: tokens, their sampling log-probs, and the
    model's top-k at each position (``topk_ids`` / ``topk_logprobs``, one list of k per token,
    when ``SamplingConfig.topk_logprobs`` asks for them)."""

    tokens: list[int]
    logprobs: list[float]
    #: it ended at a stop token or stop string (False: at ``max_tokens``)
    stopped: bool = False
    topk_ids: list[list[int]] = field(default_factory=list)
    topk_logprobs: list[list[float]] = field(default_factory=list)


def sample_tokens(
    logits_BV: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row and its log-prob under the sampling distribution (float64, host):
    ``sample_on_device`` of the logits brought to the host in float64."""
    return sample_on_device(logits_BV.detach().to("cpu", torch.float64), cfg, generator)


def sample_on_device(
    logits_BV: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row and its log-prob under the sampling distribution, computed where the
    logits are (``generator`` on their device; half-precision logits in float32).

    Temperature 0 takes each row's argmax (the first of equal maxima) with the model's own
    log-prob and draws nothing from ``generator``. Otherwise the logits are divided by the
    temperature, cut to the ``top_k`` largest (exactly k tokens, ties broken by index), then to
    the ``top_p`` nucleus, renormalized after each cut. Returns (tokens int64 [B], logprobs [B])
    on the logits' device, the log-probs in the logits' dtype (at least float32).
    """
    logits = logits_BV.detach()
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    if cfg.temperature == 0:
        tokens = logits.argmax(dim=-1)
        return tokens, torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None])[:, 0]
    logp = torch.log_softmax(logits / cfg.temperature, dim=-1)
    if cfg.top_k is not None and cfg.top_k < logp.shape[-1]:
        keep = torch.zeros_like(logp, dtype=torch.bool).scatter(1, logp.topk(cfg.top_k, dim=-1).indices, True)
        logp = torch.log_softmax(logp.masked_fill(~keep, -torch.inf), dim=-1)
    if cfg.top_p < 1.0:
        sorted_lp, order = logp.sort(dim=-1, descending=True)
        # keep a token while the mass before it is below top_p (the first token always stays)
        before = sorted_lp.exp().cumsum(-1) - sorted_lp.exp()
        drop = torch.zeros_like(logp, dtype=torch.bool).scatter(1, order, before >= cfg.top_p)
        logp = torch.log_softmax(logp.masked_fill(drop, -torch.inf), dim=-1)
    tokens = torch.multinomial(logp.exp(), 1, generator=generator)[:, 0]
    return tokens, logp.gather(1, tokens[:, None])[:, 0]


def topk_logprobs(logits_BV: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's k most likely tokens per row and their log-probs (``log_softmax`` of the raw
    logits in float64, no temperature or truncation), most likely first.

    Returns (ids int64 [B, k], logprobs float64 [B, k]) on the host; k is capped at V. Logits on
    a device are reduced there (in at least float32), so only [B, k] comes to the host."""
    logits = logits_BV.detach()
    dtype = torch.float64 if logits.device.type == "cpu" else torch.promote_types(logits.dtype, torch.float32)
    logp = torch.log_softmax(logits.to(dtype), dim=-1)
    top = logp.topk(min(k, logp.shape[-1]), dim=-1)
    return top.indices.cpu(), top.values.to("cpu", torch.float64)


def generate(
    model: HybridLM,
    branches: Sequence[Branch],
    cfg: SamplingConfig,
    generator: torch.Generator,
    detokenize: Detokenize | None = None,
) -> tuple[list[Branch], list[Turn]]:
    """Sample one turn for every branch (module docstring); returns the branches after it
    (last token pending) and what each sampled.

    Every branch must have ``logits`` (it has consumed its prompt) and no pending tokens;
    ``detokenize`` (token ids -> text) is needed when ``cfg`` has stop strings.
    """
    decoding = Decoding(branches, cfg, detokenize)
    while not decoding.done:
        decoding.step(model, generator)
    return decoding.branches, decoding.turns


class TurnSampler:
    """One turn of many paths as far as it is sampled: the turns, which paths are still live, and
    one step's sampling from their logits with the stop rules. ``Decoding`` and the batched
    decoder's ``FastDecoding`` (``harts.rollout.fast``) are it over their own caches."""

    def __init__(self, count: int, cfg: SamplingConfig, detokenize: Detokenize | None) -> None:
        if cfg.stop_strings and detokenize is None:
            raise ValueError("stop strings need a detokenizer (token ids -> text)")
        self.cfg = cfg
        self.detokenize = detokenize
        self.turns = [Turn([], []) for _ in range(count)]
        self._live = list(range(count))
        self._stop = set(cfg.stop_tokens)

    @property
    def done(self) -> bool:
        """Every path has stopped."""
        return not self._live

    @property
    def live(self) -> int:
        """Paths still sampling."""
        return len(self._live)

    def _stops(self, turn: Turn) -> bool:
        """``turn`` ends here: its last token is a stop token, or its text now holds a stop
        string (the first token that completes one ends the turn, so it was not there before)."""
        if turn.tokens[-1] in self._stop:
            return True
        if not self.cfg.stop_strings:
            return False
        assert self.detokenize is not None
        text = self.detokenize(turn.tokens)
        return any(s in text for s in self.cfg.stop_strings)

    def _sample(self, logits_BV: torch.Tensor, generator: torch.Generator, sample: Sampler) -> list[tuple[int, int]]:
        """Sample one token for each live path from its row of ``logits_BV`` with ``sample``
        (``sample_tokens`` or ``sample_on_device``) and record it; returns (path, token) of
        every path sampled, and keeps live those that did not stop."""
        live = self._live
        tokens, logprobs = sample(logits_BV, self.cfg, generator)
        if self.cfg.topk_logprobs:
            ids_BK, lps_BK = topk_logprobs(logits_BV, self.cfg.topk_logprobs)
            for i, ids, lps in zip(live, ids_BK.tolist(), lps_BK.tolist()):
                self.turns[i].topk_ids.append(ids)
                self.turns[i].topk_logprobs.append(lps)
        still = []
        # one copy of [B] tokens and log-probs to the host: the stop rules and the turns need them
        sampled = list(zip(live, tokens.tolist()))
        for (i, tok), lp in zip(sampled, logprobs.double().tolist()):
            turn = self.turns[i]
            turn.tokens.append(tok)
            turn.logprobs.append(lp)
            if self._stops(turn):
                turn.stopped = True
            elif len(turn.tokens) < self.cfg.max_tokens:
                still.append(i)
        self._live = still
        return sampled


class Decoding(TurnSampler):
    """``generate`` one decoding step at a time, for callers that interleave other work between
    steps (a server's scheduler): ``step`` until ``done``, then read ``branches`` and ``turns``.
    The steps are ``generate``'s own, so the same generator samples the same tokens either way,
    however the steps are spread out, as long as the model's weights are the same at each step."""

    def __init__(self, branches: Sequence[Branch], cfg: SamplingConfig, detokenize: Detokenize | None = None) -> None:
        self.branches = list(branches)
        for i, b in enumerate(self.branches):
            if b.logits is None or b.pending:
                raise ValueError(f"branch {i} must have consumed its context before a turn is sampled")
        super().__init__(len(self.branches), cfg, detokenize)

    def step(self, model: HybridLM, generator: torch.Generator) -> None:
        """Run the pending tokens of the live branches and sample one more token for each."""
        branches, live = self.branches, self._live
        need = [i for i in live if branches[i].pending]
        if need:
            for i, b in zip(need, extend(model, [branches[i] for i in need], [[] for _ in need])):
                branches[i] = b
        logits = torch.stack([branches[i].logits for i in live])  # type: ignore[misc]
        for i, tok in self._sample(logits, generator, sample_tokens):
            branches[i] = replace(branches[i], pending=(tok,))
