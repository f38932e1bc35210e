"""The environment interface the rollout collector drives (``harts.rollout.collect``).

An environment is one episode of a multi-turn task, in token ids::

    prompt = env.reset(rng)              # the first observation (the task)
    result = env.step(agent_tokens)      # the agent's turn -> observation tokens, reward, done
    child  = env.clone()                 # an independent copy: a fork of the episode

``step`` gets the tokens the agent sampled for one turn and answers with the tokens the agent
reads next (a tool's output, an error message; empty when the episode ends), a reward for this
turn that a program can check (no learned judge), and whether the episode is over. The reward
of a trajectory is the sum of its turns' rewards. ``clone`` lets the collector branch an
episode at a turn boundary: each child continues from the same state on its own.

``sampling`` says how an agent turn is sampled in this environment (its stop tokens and most
tokens per turn); the collector takes temperature and top-p from its own configuration.
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["Environment", "StepResult", "TurnLimits"]


@dataclass
class StepResult:
    """What the environment answers to one agent turn."""

    #: tokens the agent reads next (empty when ``done``)
    observation: list[int]
    #: verifiable reward of this turn
    reward: float
    #: the episode is over
    done: bool
    #: plain facts for metrics (e.g. {"tool_error": True}); never read by the trainer
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class TurnLimits:
    """How an agent turn is cut: at a stop token (kept) or after ``max_tokens``."""

    max_tokens: int
    stop_tokens: tuple[int, ...] = ()


class Environment(ABC):
    """One episode of a task (module docstring)."""

    #: token ids the environment emits or expects are all below this
    vocab_size: int
    #: how an agent turn is sampled here
    limits: TurnLimits

    @abstractmethod
    def reset(self, rng: np.random.Generator) -> list[int]:
        """Start a new episode drawn from ``rng``; returns the prompt tokens."""

    @abstractmethod
    def step(self, action: list[int]) -> StepResult:
        """Apply the agent's turn ``action`` (its sampled tokens)."""

    def clone(self) -> Environment:
        """An independent copy of this episode's state (a fork)."""
        return copy.deepcopy(self)

    def chance_reward(self) -> float | None:
        """Expected reward of a policy that samples tokens uniformly, when known (for reports)."""
        return None
