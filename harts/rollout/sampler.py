"""Batched sampling across live branches: temperature, top-p, max tokens, stop tokens.

``generate`` decodes one turn for many branches at once: every decoding step runs one
``extend`` over the branches still live (each feeding the token it sampled last), samples one
token per branch from its logits and records that token's log-probability under the
distribution it was drawn from (after temperature and top-p). With temperature 1 and top-p 1
that is the model's own log-prob, which the training forward must reproduce (the
train/inference consistency check; ``harts.trainer.online`` reports the gap every step).

A branch stops at a stop token (kept, as the end of its turn) or after ``max_tokens``. Its
last token stays ``pending``: the next ``extend`` (the environment's observation, or the next
turn) runs it first, so no token is run twice and none is skipped.

Randomness comes only from the ``torch.Generator`` passed in (on the host): the same generator
state and the same weights sample the same tokens in any execution mode.

Shapes: logits_BV for B live branches and vocabulary V.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from harts.models.hybrid_lm import HybridLM
from harts.rollout.decode import Branch, extend

__all__ = ["Decoding", "SamplingConfig", "Turn", "generate", "sample_tokens"]


@dataclass(frozen=True, kw_only=True, slots=True)
class SamplingConfig:
    """How one agent turn is sampled."""

    #: softmax temperature (> 0); 1 samples from the model's distribution
    temperature: float = 1.0
    #: nucleus sampling: keep the smallest set of tokens whose probability reaches top_p
    top_p: float = 1.0
    #: most tokens per turn
    max_tokens: int = 16
    #: tokens that end a turn (kept as the turn's last token)
    stop_tokens: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")


@dataclass
class Turn:
    """What ``generate`` sampled for one branch: tokens and their sampling log-probs."""

    tokens: list[int]
    logprobs: list[float]


def sample_tokens(
    logits_BV: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row and its log-prob under the sampling distribution (float64, host).

    Returns (tokens int64 [B], logprobs float64 [B]).
    """
    logp = torch.log_softmax(logits_BV.detach().to("cpu", torch.float64) / cfg.temperature, dim=-1)
    if cfg.top_p < 1.0:
        sorted_lp, order = logp.sort(dim=-1, descending=True)
        # keep a token while the mass before it is below top_p (the first token always stays)
        before = sorted_lp.exp().cumsum(-1) - sorted_lp.exp()
        drop = torch.zeros_like(logp, dtype=torch.bool).scatter(1, order, before >= cfg.top_p)
        logp = torch.log_softmax(logp.masked_fill(drop, -torch.inf), dim=-1)
    tokens = torch.multinomial(logp.exp(), 1, generator=generator)[:, 0]
    return tokens, logp.gather(1, tokens[:, None])[:, 0]


def generate(
    model: HybridLM, branches: Sequence[Branch], cfg: SamplingConfig, generator: torch.Generator
) -> tuple[list[Branch], list[Turn]]:
    """Sample one turn for every branch (module docstring); returns the branches after it
    (last token pending) and what each sampled.

    Every branch must have ``logits`` (it has consumed its prompt) and no pending tokens.
    """
    decoding = Decoding(branches, cfg)
    while not decoding.done:
        decoding.step(model, generator)
    return decoding.branches, decoding.turns


class Decoding:
    """``generate`` one decoding step at a time, for callers that interleave other work between
    steps (a server's scheduler): ``step`` until ``done``, then read ``branches`` and ``turns``.
    The steps are ``generate``'s own, so the same generator samples the same tokens either way,
    however the steps are spread out, as long as the model's weights are the same at each step."""

    def __init__(self, branches: Sequence[Branch], cfg: SamplingConfig) -> None:
        self.branches = list(branches)
        for i, b in enumerate(self.branches):
            if b.logits is None or b.pending:
                raise ValueError(f"branch {i} must have consumed its context before a turn is sampled")
        self.cfg = cfg
        self.turns = [Turn([], []) for _ in self.branches]
        self._live = list(range(len(self.branches)))
        self._stop = set(cfg.stop_tokens)

    @property
    def done(self) -> bool:
        """Every branch has stopped."""
        return not self._live

    @property
    def live(self) -> int:
        """Branches still sampling."""
        return len(self._live)

    def step(self, model: HybridLM, generator: torch.Generator) -> None:
        """Run the pending tokens of the live branches and sample one more token for each."""
        branches, live = self.branches, self._live
        need = [i for i in live if branches[i].pending]
        if need:
            for i, b in zip(need, extend(model, [branches[i] for i in need], [[] for _ in need])):
                branches[i] = b
        logits = torch.stack([branches[i].logits for i in live])  # type: ignore[misc]
        tokens, logprobs = sample_tokens(logits, self.cfg, generator)
        still = []
        for i, tok, lp in zip(live, tokens.tolist(), logprobs.tolist()):
            self.turns[i].tokens.append(tok)
            self.turns[i].logprobs.append(lp)
            branches[i] = replace(branches[i], pending=(tok,))
            if tok not in self._stop and len(self.turns[i].tokens) < self.cfg.max_tokens:
                still.append(i)
        self._live = still
