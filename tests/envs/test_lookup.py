"""The built-in ToolLookup environment: its rules, rewards, retries and chance level."""

from __future__ import annotations

import numpy as np

from harts.envs import ToolLookup
from harts.envs.lookup import ERR, TOOL


def _episode(seed: int = 0) -> tuple[ToolLookup, list[int]]:
    env = ToolLookup()
    return env, env.reset(np.random.default_rng(seed))


def test_call_read_answer_gets_reward() -> None:
    env, prompt = _episode()
    r = env.step([prompt[-1]])  # call with the asked key
    assert r.observation == [TOOL, env.target] and not r.done and r.reward == 0
    r = env.step([r.observation[1]])  # answer with the value read
    assert r.done and r.reward == 1.0 and r.info["success"]


def test_wrong_answer_and_wrong_key() -> None:
    env, prompt = _episode(3)
    env.step([prompt[-1]])
    wrong = env.value0 + (env.target - env.value0 + 1) % env.num_values
    assert env.step([wrong]).reward == 0.0
    env, prompt = _episode(3)
    other = env.key0 + (prompt[-1] - env.key0 + 1) % env.num_keys
    r = env.step([other])
    assert r.info["right_key"] is False and r.observation[1] == env.value0 + env.db[other - env.key0]


def test_tool_error_then_retry_then_give_up() -> None:
    env, _ = _episode()
    r = env.step([ERR])
    assert r.observation == [ERR] and not r.done and r.info["tool_error"]
    clone = env.clone()
    r = env.step([0])
    assert r.done and r.reward == 0.0 and r.observation == []
    # the clone forked before the second call still has its retry
    r = clone.step([clone.key0 + clone.asked])
    assert r.observation == [TOOL, clone.target]


def test_chance_reward_matches_a_uniform_policy() -> None:
    rng = np.random.default_rng(0)
    total, n = 0.0, 20_000
    for _ in range(n):
        env = ToolLookup()
        env.reset(rng)
        done = False
        while not done:
            r = env.step([int(rng.integers(env.vocab_size))])
            done, total = r.done, total + r.reward
    p = env.chance_reward()
    assert abs(total / n - p) < 4 * np.sqrt(p * (1 - p) / n)
