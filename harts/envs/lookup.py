"""ToolLookup: the built-in multi-turn task — call a tool, read its output, answer from it.

Each episode draws a private table ``db`` mapping every key to a random value and asks for one
key. The agent must (1) call the lookup tool with the key it was asked for, (2) read the value
in the tool's output and (3) answer with it. The table is new in every episode, so the value
cannot be memorized: it is only in the tool's output. One episode, in tokens::

    prompt      BOS ASK key                  (the question)
    agent       k                            the tool call: a key token
    tool        TOOL db[k]                   the tool's output    (a non-key call: ERR)
    agent       a                            the answer: reward 1 if a == db[key], else 0

A call that is not a key token is a tool error: the agent reads ``ERR`` and retries, up to
``max_calls`` calls (then the episode ends with reward 0). Calling a wrong key returns that
key's value, which is right only by chance. Every agent turn is one token.

Vocabulary: BOS, ASK, TOOL, ERR, then ``num_keys`` key tokens and ``num_values`` value tokens;
``vocab_size`` may be larger (a model may sample the unused ids; they are tool errors or wrong
answers). The task is sized for a tiny model on a CPU (``harts demo``).
"""

from __future__ import annotations

import numpy as np

from harts.envs.base import Environment, StepResult, TurnLimits

__all__ = ["ToolLookup"]

BOS, ASK, TOOL, ERR = 0, 1, 2, 3


class ToolLookup(Environment):
    def __init__(self, *, num_keys: int = 4, num_values: int = 4, max_calls: int = 2, vocab_size: int = 16) -> None:
        if num_keys < 1 or num_values < 2 or max_calls < 1:
            raise ValueError("ToolLookup needs num_keys >= 1, num_values >= 2 and max_calls >= 1")
        if vocab_size < 4 + num_keys + num_values:
            raise ValueError(f"vocab_size {vocab_size} is below the task's {4 + num_keys + num_values} tokens")
        self.num_keys, self.num_values, self.max_calls = num_keys, num_values, max_calls
        self.vocab_size = vocab_size
        self.limits = TurnLimits(max_tokens=1)
        self.key0, self.value0 = 4, 4 + num_keys
        self.db = np.zeros(num_keys, dtype=np.int64)
        self.asked = 0
        self.calls = 0
        self.answered = False
        self.last_error = False

    def reset(self, rng: np.random.Generator) -> list[int]:
        self.db = rng.integers(0, self.num_values, size=self.num_keys)
        self.asked = int(rng.integers(0, self.num_keys))
        self.calls, self.answered, self.last_error = 0, False, False
        return [BOS, ASK, self.key0 + self.asked]

    @property
    def target(self) -> int:
        """The token of the right answer."""
        return self.value0 + int(self.db[self.asked])

    def step(self, action: list[int]) -> StepResult:
        if self.answered or (self.last_error and self.calls >= self.max_calls):
            raise RuntimeError("step() after the episode ended")
        (tok,) = action
        if self.calls and not self.last_error:
            # the turn after a tool output is the answer
            self.answered = True
            correct = tok == self.target
            return StepResult([], float(correct), True, {"success": correct})
        self.calls += 1
        key = tok - self.key0
        self.last_error = not 0 <= key < self.num_keys
        if not self.last_error:
            return StepResult([TOOL, self.value0 + int(self.db[key])], 0.0, False, {"right_key": key == self.asked})
        if self.calls >= self.max_calls:
            return StepResult([], 0.0, True, {"tool_error": True, "success": False})
        return StepResult([ERR], 0.0, False, {"tool_error": True})

    def chance_reward(self) -> float:
        """Uniform sampling: the answer turn is reached once a call hits a key token, and a
        uniform answer is right with probability 1 / vocab_size."""
        p_call = self.num_keys / self.vocab_size
        return (1.0 - (1.0 - p_call) ** self.max_calls) / self.vocab_size
