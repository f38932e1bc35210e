"""Seeded synthetic agentic rollout trees shaped like the paper's SWE-bench workload.

The paper's workload (Table 2, Appendix A) comes from a Claude Code scaffold solving
SWE-bench tasks: per training step ~1,300-2,400 root-to-leaf paths, 35-59 M raw tokens and
5.7-9.7 M compact tokens. Its trees share a short chat-template header across tasks (the
3-token roots R1-R3 of Figures 6-8), then a task prompt, then long multi-turn agent
trajectories whose forks fall at turn boundaries anywhere relative to the 64-token chunk
grid: high fan-out clusters of short retries (1-15 tokens, Figure 7's E subtree), long side
explorations hanging off a main chain (Figure 8's G chain), tool outputs up to ~40 k tokens.

The generator reproduces those shapes from a handful of parameters (``WorkloadSpec``):
  * every trajectory starts with the same ``header_tokens``-token header;
  * a task = prompt (system + issue) + a trunk of alternating assistant / tool turns with
    log-normal lengths (assistant median ``assistant_median``, tool median ``tool_median``,
    clipped to ``max_tool``);
  * side explorations fork off the trunk at turn boundaries and run their own turns, and
    may fork again (``nest_prob``); retry clusters attach 2..``max_fanout`` short leaves at
    one boundary;
  * a fraction ``align_prob`` of forks is moved onto kB-1, kB or kB+1 exactly;
  * no path exceeds ``max_path_tokens``.
Siblings always start with distinct tokens, so the explicit tree equals the token trie.

``harts stats --workload NAME`` prints the calibration table; ``docs/workloads.md`` documents it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import numpy as np

from harts.errors import UserError
from harts.tree.batch import RolloutBatch
from harts.tree.rollout_tree import RolloutTree

__all__ = ["WorkloadSpec", "PRESETS", "generate", "load_workload", "steps", "workload_steps"]


@dataclass(frozen=True, kw_only=True)
class WorkloadSpec:
    """Parameters of one synthetic workload preset (lengths in tokens)."""

    name: str
    #: training steps in the preset (each step is one independent batch)
    steps: int
    #: tasks (rollout trees below the shared header) per step, uniform in [lo, hi]
    tasks: tuple[int, int]
    #: prompt (system + issue) length per task
    prompt: tuple[int, int]
    #: trunk length budget per task (tokens after the prompt)
    trunk: tuple[int, int]
    #: side explorations per trunk and their length budget
    explorations: tuple[int, int]
    exploration_len: tuple[int, int]
    #: retry clusters per trunk; each holds 2..max_fanout leaves of 1..15 tokens
    retry_clusters: tuple[int, int]
    max_fanout: int = 10
    #: probability that an exploration spawns its own nested forks
    nest_prob: float = 0.35
    assistant_median: float = 120.0
    tool_median: float = 600.0
    max_tool: int = 40_000
    max_path_tokens: int = 65_000
    header_tokens: int = 3
    vocab_size: int = 157_184
    #: chunk grid used to place forks exactly at kB - 1, kB, kB + 1
    chunk_size: int = 64
    align_prob: float = 0.2
    #: where trunk forks fall: 0 = uniform over turn boundaries; a > 0 draws the boundary
    #: index as n * u ** (1 / (1 + a)), so forks crowd toward the end of the trunk (agents
    #: explore and retry once they have built up context), raising prefix sharing
    late_forks: float = 0.0
    #: attach old/ref log-probs (costly at paper scale; on for CPU presets)
    with_logprobs: bool = False


PRESETS: dict[str, WorkloadSpec] = {
    # paper scale: ~1.3-2.4 k paths, ~35-59 M raw tokens per step
    # (calibrated so that harts' compact work AFTER partitioning at T = 65,536 matches the
    # paper's Table 2: most task trees fit one microbatch, as the paper's near-full slots imply)
    "swe": WorkloadSpec(
        name="swe",
        steps=10,
        tasks=(100, 180),
        prompt=(300, 3_000),
        trunk=(18_000, 40_000),
        explorations=(1, 3),
        exploration_len=(1_000, 9_000),
        retry_clusters=(1, 2),
        max_fanout=6,
        late_forks=2.0,
    ),
    # the same shapes at ~1/10 of the paths and ~1/3 of the lengths: planner demos
    "medium": WorkloadSpec(
        name="medium",
        steps=4,
        tasks=(8, 12),
        prompt=(100, 1_000),
        trunk=(8_000, 18_000),
        explorations=(4, 10),
        exploration_len=(300, 4_500),
        retry_clusters=(0, 2),
        max_fanout=8,
        assistant_median=60.0,
        tool_median=250.0,
        max_tool=12_000,
        max_path_tokens=32_000,
        with_logprobs=True,
    ),
    # CPU model runs: a few thousand compact tokens
    "small": WorkloadSpec(
        name="small",
        steps=3,
        tasks=(3, 4),
        prompt=(20, 120),
        trunk=(400, 1_200),
        explorations=(2, 4),
        exploration_len=(40, 300),
        retry_clusters=(1, 2),
        max_fanout=8,
        assistant_median=20.0,
        tool_median=60.0,
        max_tool=600,
        max_path_tokens=2_048,
        vocab_size=512,
        chunk_size=16,
        with_logprobs=True,
    ),
    # unit tests and the CPU demo: a few hundred compact tokens
    "tiny": WorkloadSpec(
        name="tiny",
        steps=2,
        tasks=(2, 2),
        prompt=(6, 20),
        trunk=(60, 140),
        explorations=(1, 3),
        exploration_len=(10, 50),
        retry_clusters=(1, 1),
        max_fanout=6,
        assistant_median=6.0,
        tool_median=12.0,
        max_tool=60,
        max_path_tokens=256,
        vocab_size=256,
        chunk_size=8,
        with_logprobs=True,
    ),
}


def generate(name: str | WorkloadSpec = "tiny", *, step: int = 0, seed: int = 0, **overrides: Any) -> RolloutBatch:
    """One step's rollout batch of preset ``name`` (deterministic in ``seed`` and ``step``).

    ``overrides`` replace WorkloadSpec fields, e.g. ``generate("swe", tasks=(10, 10))``.
    Trajectories carry ``group_ids`` and ``tree_ids`` = task index, per-trajectory
    group-normalized advantages, and an action mask over assistant tokens.
    """
    if isinstance(name, str) and name not in PRESETS:
        raise ValueError(f"unknown workload {name!r}; presets: {', '.join(PRESETS)}")
    spec = PRESETS[name] if isinstance(name, str) else name
    if overrides:
        spec = replace(spec, **overrides)
    rng = np.random.default_rng([seed, step, 0x4A475453])
    return _Builder(spec, rng).build()


def steps(name: str = "swe", *, seed: int = 0, num_steps: int | None = None) -> Iterator[RolloutBatch]:
    """Yield the preset's steps in order."""
    spec = PRESETS[name]
    for s in range(spec.steps if num_steps is None else num_steps):
        yield generate(name, step=s, seed=seed)


def workload_steps(
    spec: str, steps: int | None = None, *, seed: int = 0
) -> list[tuple[str, Callable[[], RolloutBatch]]]:
    """``(label, make_batch)`` per step of ``spec``, a preset name or a batch file: the preset's
    steps (``steps`` of them, default all; generated when made), or the file ``steps`` times
    (default once; read once). The one workload loader of the commands and benchmarks.

    Raises ``UserError`` when ``spec`` is neither a preset nor a file.
    """
    if spec in PRESETS:
        n = PRESETS[spec].steps if steps is None else steps
        return [(f"{spec}[{s}]", partial(generate, spec, step=s, seed=seed)) for s in range(n)]
    if os.path.exists(spec) or spec.endswith((".jsonl", ".parquet")):
        cache: list[RolloutBatch] = []

        def load() -> RolloutBatch:
            if not cache:
                cache.append(RolloutBatch.load(spec))
            return cache[0]

        return [(spec, load)] * (1 if steps is None else steps)
    raise UserError(f"--workload {spec!r} is neither a preset ({', '.join(PRESETS)}) nor an existing file")


def load_workload(spec: str, *, step: int = 0, seed: int = 0) -> RolloutBatch:
    """Step ``step`` of preset ``spec``, or the batch file ``spec`` (see ``workload_steps``)."""
    if spec in PRESETS:
        return generate(spec, step=step, seed=seed)
    return workload_steps(spec, 1, seed=seed)[0][1]()


class _Builder:
    """Grows one step: a header root, then one subtree per task."""

    def __init__(self, spec: WorkloadSpec, rng: np.random.Generator) -> None:
        self.spec = spec
        self.rng = rng
        self.node_tokens: list[np.ndarray] = []
        self.node_mask: list[np.ndarray] = []
        self.node_parent: list[int] = []
        self.leaf_task: dict[int, int] = {}

    # ---------------------------------------------------------------- turns
    def _lognormal(self, median: float, sigma: float, hi: int) -> int:
        return int(np.clip(round(self.rng.lognormal(np.log(median), sigma)), 1, hi))

    def _turns(self, budget: int) -> list[tuple[int, bool]]:
        """Alternating (assistant, tool) turns totalling about ``budget`` tokens."""
        s = self.spec
        out: list[tuple[int, bool]] = []
        used = 0
        while used < budget:
            a = self._lognormal(s.assistant_median, 1.0, 4_000)
            t = self._lognormal(s.tool_median, 1.3, s.max_tool)
            out.append((a, True))
            out.append((t, False))
            used += a + t
        return out

    # ---------------------------------------------------------------- nodes
    def _node(self, parent: int, length: int, action_from: int = 0, action: bool = True) -> int:
        toks = self.rng.integers(1, self.spec.vocab_size, size=length, dtype=np.int64)
        mask = np.zeros(length, dtype=bool)
        mask[action_from:] = action
        self.node_tokens.append(toks)
        self.node_mask.append(mask)
        self.node_parent.append(parent)
        return len(self.node_tokens) - 1

    def _chain(self, parent: int, start: int, turns: list[tuple[int, bool]], task: int, depth: int) -> None:
        """Lay ``turns`` below ``parent`` (at absolute position ``start``) with side branches."""
        s = self.spec
        # cap the chain so every path through it stays within max_path_tokens
        room = s.max_path_tokens - start - 16
        lengths: list[int] = []
        kinds: list[bool] = []
        for length, is_action in turns:
            length = min(length, room - sum(lengths))
            if length <= 0:
                break
            lengths.append(length)
            kinds.append(is_action)
        if not lengths:
            lengths, kinds = [1], [True]
        bounds = np.cumsum(lengths)  # turn ends, relative to start
        n_b = len(bounds) - 1  # internal turn boundaries available for forks
        forks: dict[int, list[str]] = {}
        if n_b > 0:
            if depth == 0:
                n_exp = int(self.rng.integers(s.explorations[0], s.explorations[1] + 1))
                n_retry = int(self.rng.integers(s.retry_clusters[0], s.retry_clusters[1] + 1))
            else:
                nest = self.rng.random() < s.nest_prob
                n_exp = int(self.rng.integers(0, 2)) if nest and depth < 3 else 0
                n_retry = 1 if nest else 0
            for kind, count in (("explore", n_exp), ("retry", n_retry)):
                for b in self._fork_boundaries(n_b, count, depth):
                    forks.setdefault(int(b), []).append(kind)
            self._align(lengths, sorted(forks), start)
            bounds = np.cumsum(lengths)
        # split the chain into nodes at fork boundaries and hang the side branches there
        node = parent
        prev_end = 0
        turn_start = np.concatenate([[0], bounds[:-1]])
        for b in sorted(forks) + [len(lengths) - 1]:
            end = int(bounds[b])
            node = self._span_node(node, prev_end, end, turn_start, bounds, kinds)
            prev_end = end
            for kind in forks.get(b, []):
                pos = start + end
                if kind == "retry":
                    fan = int(self.rng.integers(2, s.max_fanout + 1))
                    for _ in range(fan):
                        leaf = self._node(node, int(self.rng.integers(1, 16)))
                        self.leaf_task[leaf] = task
                else:
                    budget = int(self.rng.integers(s.exploration_len[0], s.exploration_len[1] + 1))
                    self._chain(node, pos, self._turns(budget), task, depth + 1)
        # the chain's last node never gets children: forks sit at internal boundaries
        self.leaf_task[node] = task

    def _fork_boundaries(self, n_b: int, count: int, depth: int) -> np.ndarray:
        """``count`` turn-boundary indices in [0, n_b) for forks (see ``late_forks``)."""
        late = self.spec.late_forks
        if late <= 0.0 or depth > 0:
            return self.rng.integers(0, n_b, size=count)
        u = self.rng.random(count) ** (1.0 / (1.0 + late))
        return np.minimum((u * n_b).astype(np.int64), n_b - 1)

    def _span_node(self, parent, lo, hi, turn_start, bounds, kinds) -> int:
        node = self._node(parent, hi - lo, action=False)
        mask = self.node_mask[node]
        for i, is_action in enumerate(kinds):
            if is_action:
                a, b = max(turn_start[i], lo), min(bounds[i], hi)
                if a < b:
                    mask[a - lo : b - lo] = True
        return node

    def _align(self, lengths: list[int], fork_turns: list[int], start: int) -> None:
        """Move a fraction of forks onto kB - 1, kB, kB + 1 by stretching the turn before it."""
        s = self.spec
        for b in fork_turns:
            if self.rng.random() >= s.align_prob:
                continue
            pos = start + int(np.sum(lengths[: b + 1]))
            target = (pos // s.chunk_size + 1) * s.chunk_size + int(self.rng.integers(-1, 2))
            if target + 16 < s.max_path_tokens - (sum(lengths) - sum(lengths[: b + 1])):
                lengths[b] += target - pos

    # ---------------------------------------------------------------- build
    def build(self) -> RolloutBatch:
        s = self.spec
        header = self._node(-1, s.header_tokens, action=False)
        n_tasks = int(self.rng.integers(s.tasks[0], s.tasks[1] + 1))
        for task in range(n_tasks):
            plen = int(self.rng.integers(s.prompt[0], s.prompt[1] + 1))
            prompt = self._node(header, plen, action=False)
            budget = int(self.rng.integers(s.trunk[0], s.trunk[1] + 1))
            self._chain(prompt, s.header_tokens + plen, self._turns(budget), task, depth=0)
        self._distinct_sibling_starts()
        nodes = [
            # a root's lists skip its first token, which nothing predicts
            {"id": i, "parent": None if p < 0 else p, "tokens": t, "action_mask": m if p >= 0 else m[1:]}
            for i, (t, m, p) in enumerate(zip(self.node_tokens, self.node_mask, self.node_parent))
        ]
        tree = RolloutTree.from_nodes(nodes)
        batch = RolloutBatch.from_tree(tree, vocab_size=s.vocab_size)
        leaf_task = np.array([self.leaf_task[int(v)] for v in tree.leaves], dtype=np.int64)
        adv = self._group_advantages(leaf_task)
        extra: dict[str, Any] = {}
        if s.with_logprobs:
            n = batch.num_tokens
            extra["old_logprobs"] = -self.rng.exponential(1.0, size=n)
            # a log-probability is <= 0 (batch files reject positive ones)
            extra["ref_logprobs"] = np.minimum(extra["old_logprobs"] + self.rng.normal(0.0, 0.05, size=n), 0.0)
        return replace(
            batch, group_ids=leaf_task, tree_ids=leaf_task, advantages=np.repeat(adv, batch.lengths), **extra
        )

    def _distinct_sibling_starts(self) -> None:
        """Give siblings distinct first tokens so the explicit tree is the token trie."""
        kids: dict[int, list[int]] = {}
        for v, p in enumerate(self.node_parent):
            kids.setdefault(p, []).append(v)
        for group in kids.values():
            if len(group) > 1:
                firsts = self.rng.choice(np.arange(1, self.spec.vocab_size), size=len(group), replace=False)
                for v, f in zip(group, firsts):
                    self.node_tokens[v][0] = f

    def _group_advantages(self, task: np.ndarray) -> np.ndarray:
        """GRPO-style: a binary reward per path, normalized within its task group."""
        reward = (self.rng.random(task.size) < 0.4).astype(np.float64)
        adv = np.zeros(task.size)
        for t in np.unique(task):
            sel = task == t
            r = reward[sel]
            adv[sel] = (r - r.mean()) / (r.std() + 1e-6)
        return adv
