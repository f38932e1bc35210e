"""Rollout trees from the policy itself: episodes of an environment, forked at turn boundaries.

For every task of a step the collector resets a fresh environment, prefills its prompt once and
forks the prompt's cache into ``group_size`` first turns (the GRPO group). Then, turn after
turn, for all live paths of all tasks at once:

1. ``generate`` samples the agent's turn (one batched ``extend`` per decoded token);
2. the path's environment ``step``s on it: reward, done, and the observation (a tool's output,
   an error to retry after);
3. paths that go on read their observation (one batched ``extend`` for all of them) and, at
   this turn boundary, fork into ``fork_width`` paths (caches shared, environment cloned) while
   the task has fewer than ``max_leaves`` paths.

Every prompt, agent turn and observation becomes one node of the task's rollout tree; shared
turns are shared nodes, so the trees branch where the sampler forked and nowhere else. Agent
turns carry ``action_mask`` and the sampler's log-probs (``logprobs``; one value per predicted
token, so a root's lists are one shorter than its tokens, as in batch files); a leaf carries its
path's summed reward turned into a group-relative advantage (``group_advantages`` over the
task's leaves; ``group_id`` = task). ``RolloutBatch.from_tree`` makes the training batch.

Shapes: rewards float64 [N] in trajectory (leaf) order.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from harts.envs.base import Environment
from harts.models.hybrid_lm import HybridLM
from harts.rl.grpo import group_advantages
from harts.rollout.decoders import rollout_paths
from harts.rollout.sampler import SamplingConfig
from harts.tree.batch import RolloutBatch

__all__ = ["RolloutConfig", "Rollouts", "collect"]


@dataclass(kw_only=True, slots=True)
class RolloutConfig:
    """How many episodes a step samples and where they fork."""

    #: tasks (environment episodes, one tree each) per step
    tasks: int = 8
    #: first turns sampled from each prompt (the GRPO group's root fork)
    group_size: int = 4
    #: paths each path forks into at every later turn boundary (1: no more forks)
    fork_width: int = 2
    #: forking stops once a task has this many paths
    max_leaves: int = 8
    #: a path ends after this many agent turns even if the environment goes on
    max_turns: int = 8
    temperature: float = 1.0
    top_p: float = 1.0


@dataclass
class Rollouts:
    """One step's rollout trees as a training batch plus what the environments reported."""

    batch: RolloutBatch
    #: float64 [N] summed reward of each trajectory
    rewards: np.ndarray
    #: per trajectory: the environments' ``info`` merged over its turns
    infos: list[dict[str, Any]]
    #: tool errors the agent got to retry after
    retries: int
    sample_seconds: float


@dataclass
class _Path:
    task: int
    env: Environment
    #: the path's decoding state (a handle of ``rollout_paths``)
    branch: Any
    node: int
    reward: float = 0.0
    turns: int = 0
    info: dict[str, Any] = field(default_factory=dict)


def collect(
    model: HybridLM,
    make_env: Callable[[], Environment],
    cfg: RolloutConfig,
    task_rng: np.random.Generator,
    generator: torch.Generator,
    *,
    fast: bool | None = None,
) -> Rollouts:
    """Sample one step's rollout trees (module docstring); deterministic in the two RNGs.
    ``fast``: decode with the batched decoder (``harts.rollout.fast``; default: on CUDA) or the
    reference (``harts.rollout.decode``), the same trees either way."""
    t0 = time.perf_counter()
    paths = rollout_paths(model, fast)
    nodes: list[dict[str, Any]] = []

    def add(parent: int | None, tokens: list[int], logprobs: list[float] | None) -> int:
        action = logprobs is not None
        values = logprobs if logprobs is not None else [0.0] * len(tokens)
        first = 1 if parent is None else 0  # nothing predicts a root's first token
        nodes.append(
            {
                "id": len(nodes),
                "parent": parent,
                "tokens": tokens,
                "action_mask": [action] * (len(tokens) - first),
                "logprobs": values[first:],
            }
        )
        return len(nodes) - 1

    envs = [make_env() for _ in range(cfg.tasks)]
    prompts = [env.reset(task_rng) for env in envs]
    roots = paths.prompts(prompts)
    live: list[_Path] = []
    for t, (env, root, prompt) in enumerate(zip(envs, roots, prompts)):
        node = add(None, prompt, None)
        live += [
            _Path(t, env if i == 0 else env.clone(), b, node) for i, b in enumerate(paths.fork(root, cfg.group_size))
        ]
    paths_of = [cfg.group_size] * cfg.tasks
    limits = envs[0].limits
    sampling = SamplingConfig(
        temperature=cfg.temperature, top_p=cfg.top_p, max_tokens=limits.max_tokens, stop_tokens=limits.stop_tokens
    )
    finished: list[_Path] = []
    retries = 0
    while live:
        branches, turns = paths.turn([p.branch for p in live], sampling, generator)
        reading: list[tuple[_Path, list[int]]] = []
        for p, branch, turn in zip(live, branches, turns):
            p.branch, p.turns = branch, p.turns + 1
            p.node = add(p.node, turn.tokens, turn.logprobs)
            result = p.env.step(turn.tokens)
            p.reward += result.reward
            p.info = {**p.info, **result.info}
            retries += bool(result.info.get("tool_error")) and not result.done
            if result.done or p.turns >= cfg.max_turns:
                finished.append(p)
            elif result.observation:
                p.node = add(p.node, result.observation, None)
                reading.append((p, result.observation))
            else:
                reading.append((p, []))
        fed = [(p, obs) for p, obs in reading if obs]
        if fed:
            for (p, _), b in zip(fed, paths.extend([p.branch for p, _ in fed], [obs for _, obs in fed])):
                p.branch = b
        # a turn boundary: fork while the task has room for more paths
        live = []
        for p, _ in reading:
            width = cfg.fork_width if paths_of[p.task] + cfg.fork_width - 1 <= cfg.max_leaves else 1
            paths_of[p.task] += width - 1
            p.branch, *rest = paths.fork(p.branch, width)
            live.append(p)
            live += [_Path(p.task, p.env.clone(), b, p.node, p.reward, p.turns, dict(p.info)) for b in rest]

    paths.close([p.branch for p in finished])
    # trajectories are numbered in leaf-node order (RolloutTree); a finished path's node is its leaf
    finished.sort(key=lambda p: p.node)
    rewards = np.array([p.reward for p in finished], dtype=np.float64)
    groups = np.array([p.task for p in finished], dtype=np.int64)
    for p, adv in zip(finished, group_advantages(rewards, groups)):
        nodes[p.node]["advantage"] = float(adv)
        nodes[p.node]["reward"] = float(p.reward)
        nodes[p.node]["group_id"] = p.task
    batch = RolloutBatch.from_tree(nodes, vocab_size=model.config.vocab_size)
    return Rollouts(
        batch=batch,
        rewards=rewards,
        infos=[p.info for p in finished],
        retries=retries,
        sample_seconds=time.perf_counter() - t0,
    )
