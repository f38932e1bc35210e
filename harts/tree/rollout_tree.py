"""Explicit rollout trees: nodes holding token spans and a parent id.

Every root-to-leaf path is one trajectory; trajectories are numbered by the order in
which their leaf nodes appear in the input. A node is a dict::

    {"id": "n3", "parent": "n1" | None, "tokens": [..],          # required, non-empty span
     "action_mask": [..], "logprobs": [..], "ref_logprobs": [..],
     "loss_weights": [..], "advantages": [..],                   # optional, per predicted token
     "advantage": 0.5, "group_id": 7, "reward": 1.0}             # optional, leaves only

A node's lists hold one value per predicted token, as batch files (``harts.tree.io``),
``harts.Engine`` and Tinker's datums do: a root's first token is predicted by nothing, so a
root's lists have ``len(tokens) - 1`` entries and every other node's ``len(tokens)``; the
sampler's log-probs are ``logprobs``. The older form -- a root's lists one per token (entry 0
unused) and ``old_logprobs`` -- is still read, with one ``BatchFormatWarning`` per tree.

Per-token metadata on a shared node describes its tokens for every trajectory that passes
through it; per-trajectory advantages (the GRPO case) sit on leaves as ``advantage``, and
scalar rewards (reported, not used by the loss) as ``reward`` on every leaf or none.
Several roots form a forest; each root's tree gets its own ``tree_id``.

Shapes (Nn = nodes, N = leaves = trajectories):
    parent        int64 [Nn]  (-1 for roots)
    offsets       int64 [Nn + 1] into ``tokens``
    leaves        int64 [N]   node index of each trajectory's leaf, in trajectory order
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from harts.errors import BatchValidationError
from harts.tree.io import BatchFormatWarning

__all__ = ["RolloutTree"]

#: a node's lists by their name on nodes -> the ``RolloutBatch`` field they fill
_NODE_TOKEN_FIELDS = {
    "action_mask": "action_mask",
    "advantages": "advantages",
    "logprobs": "old_logprobs",
    "ref_logprobs": "ref_logprobs",
    "loss_weights": "loss_weights",
}
#: the older name of a node field, still read (``BatchFormatWarning``)
_OLD_NAMES = {"old_logprobs": "logprobs"}


@dataclass(frozen=True, eq=False)
class RolloutTree:
    """A validated rollout forest in flat arrays (node order = input order)."""

    node_ids: list[Any]
    parent: np.ndarray
    offsets: np.ndarray
    tokens: np.ndarray
    leaves: np.ndarray
    root_of: np.ndarray
    roots: np.ndarray
    #: per-token node metadata by node field name (flat over node tokens; a root's first
    #: token's entry 0 / False), None where no node gave it
    token_meta: dict[str, np.ndarray | None]
    leaf_advantage: np.ndarray | None
    leaf_group: np.ndarray | None
    leaf_reward: np.ndarray | None = None

    @property
    def num_nodes(self) -> int:
        return len(self.node_ids)

    def path(self, leaf_node: int) -> list[int]:
        """Node indices from the root to ``leaf_node``."""
        out = []
        v = int(leaf_node)
        while v >= 0:
            out.append(v)
            v = int(self.parent[v])
        return out[::-1]

    @classmethod
    def from_nodes(cls, nodes: Sequence[dict[str, Any]]) -> RolloutTree:
        if len(nodes) == 0:
            raise BatchValidationError("a rollout tree needs at least one node")
        index: dict[Any, int] = {}
        for i, node in enumerate(nodes):
            if "id" not in node:
                raise BatchValidationError(f"node #{i} has no 'id'")
            nid = node["id"]
            if nid in index:
                raise BatchValidationError(f"duplicate node id {nid!r} (nodes #{index[nid]} and #{i})")
            index[nid] = i
        nn = len(nodes)
        parent = np.full(nn, -1, dtype=np.int64)
        spans = []
        for i, node in enumerate(nodes):
            nid = node["id"]
            p = node.get("parent")
            if p is not None:
                if p not in index:
                    raise BatchValidationError(f"node {nid!r}: parent {p!r} does not exist")
                parent[i] = index[p]
            toks = np.asarray(node.get("tokens", []))
            if toks.ndim != 1 or toks.size == 0:
                raise BatchValidationError(f"node {nid!r} has an empty token span")
            if not np.issubdtype(toks.dtype, np.integer):
                raise BatchValidationError(f"node {nid!r}: token ids must be integers, got {toks.dtype}")
            spans.append(toks.astype(np.int64))
        root_of = _roots_or_cycle(parent, [n["id"] for n in nodes])
        lengths = np.array([s.size for s in spans], dtype=np.int64)
        offsets = np.zeros(nn + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        tokens = np.concatenate(spans)

        old_forms: set[str] = set()
        nodes = [_current_names(node, old_forms) for node in nodes]
        token_meta = {name: _node_lists(nodes, name, offsets, parent, old_forms) for name in _NODE_TOKEN_FIELDS}
        if old_forms:
            warnings.warn(_old_form_line(old_forms), BatchFormatWarning, stacklevel=3)

        has_child = np.zeros(nn, dtype=bool)
        has_child[parent[parent >= 0]] = True
        leaves = np.flatnonzero(~has_child)
        leaf_adv = None
        leaf_group = None
        for name in ("advantage", "group_id", "reward"):
            for i, node in enumerate(nodes):
                if name in node and has_child[i]:
                    raise BatchValidationError(
                        f"node {node['id']!r}: '{name}' is per trajectory and belongs on a leaf, "
                        "but this node has children"
                    )
        leaf_list = leaves.tolist()
        if any("advantage" in nodes[i] for i in leaf_list):
            leaf_adv = np.zeros(leaves.size, dtype=np.float64)
            for k, i in enumerate(leaf_list):
                v = float(nodes[i].get("advantage", 0.0))
                if not np.isfinite(v):
                    raise BatchValidationError(f"node {nodes[i]['id']!r}: advantage is {v} (must be finite)")
                leaf_adv[k] = v
        if any("group_id" in nodes[i] for i in leaf_list):
            leaf_group = np.array([int(nodes[i].get("group_id", -1)) for i in leaf_list], dtype=np.int64)
        leaf_reward = None
        if any("reward" in nodes[i] for i in leaf_list):
            missing = [i for i in leaf_list if "reward" not in nodes[i]]
            if missing:
                raise BatchValidationError(
                    f"leaf {nodes[missing[0]]['id']!r} has no 'reward' but other leaves do (every leaf or none)"
                )
            leaf_reward = np.zeros(leaves.size, dtype=np.float64)
            for k, i in enumerate(leaf_list):
                v = nodes[i]["reward"]
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not np.isfinite(float(v)):
                    raise BatchValidationError(f"node {nodes[i]['id']!r}: reward is {v!r} (must be a finite number)")
                leaf_reward[k] = float(v)
        roots = np.flatnonzero(parent < 0)
        return cls(
            node_ids=[n["id"] for n in nodes],
            parent=parent,
            offsets=offsets,
            tokens=tokens,
            leaves=leaves,
            root_of=root_of,
            roots=roots,
            token_meta=token_meta,
            leaf_advantage=leaf_adv,
            leaf_group=leaf_group,
            leaf_reward=leaf_reward,
        )

    def leaf_paths(self) -> list[np.ndarray]:
        """Per trajectory, int64 node indices from root to leaf."""
        return [np.asarray(self.path(v), dtype=np.int64) for v in self.leaves]

    def batch_fields(self) -> dict[str, Any]:
        """Every root-to-leaf path expanded into a trajectory (metadata carried along): the
        ``RolloutBatch`` fields (``RolloutBatch.from_tree`` builds the batch from them).

        Returns tokens int64 [S], offsets int64 [N + 1], action_mask bool [S], advantages
        float64 [S], the optional per-token metadata float64 [S] | None, group_ids and tree_ids
        int64 [N] | None, rewards float64 [N] | None.
        """
        paths = self.leaf_paths()
        node_len = np.diff(self.offsets)
        gathers = []
        for p in paths:
            starts = self.offsets[p]
            lens = node_len[p]
            total = int(lens.sum())
            g = np.arange(total) - np.repeat(np.cumsum(lens) - lens - starts, lens)
            gathers.append(g)
        lengths = np.array([g.size for g in gathers], dtype=np.int64)
        gather = np.concatenate(gathers)
        offsets = np.zeros(len(paths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])

        mask_src = self.token_meta["action_mask"]
        if mask_src is None:
            mask = np.ones(gather.size, dtype=bool)
            mask[offsets[:-1]] = False
        else:
            mask = mask_src[gather]
        if self.leaf_advantage is not None:
            adv = np.repeat(self.leaf_advantage, lengths)
        elif self.token_meta["advantages"] is not None:
            adv = self.token_meta["advantages"][gather]
        else:
            adv = np.zeros(gather.size, dtype=np.float64)

        def meta(name: str) -> np.ndarray | None:
            src = self.token_meta[name]
            return None if src is None else src[gather]

        root_rank = np.full(self.num_nodes, -1, dtype=np.int64)
        root_rank[self.roots] = np.arange(self.roots.size)
        return dict(
            tokens=self.tokens[gather],
            offsets=offsets,
            action_mask=mask,
            advantages=adv,
            old_logprobs=meta("logprobs"),
            ref_logprobs=meta("ref_logprobs"),
            loss_weights=meta("loss_weights"),
            group_ids=self.leaf_group,
            tree_ids=root_rank[self.root_of[self.leaves]],
            rewards=self.leaf_reward,
        )


def _current_names(node: dict[str, Any], old_forms: set[str]) -> dict[str, Any]:
    """``node`` with its fields' older names (``_OLD_NAMES``) replaced, each noted in ``old_forms``."""
    if not any(old in node for old in _OLD_NAMES):
        return node
    node = dict(node)
    for old, name in _OLD_NAMES.items():
        if old not in node:
            continue
        if name in node:
            raise BatchValidationError(f"node {node.get('id')!r}: has both {name!r} and its older name {old!r}")
        old_forms.add(f"name:{old}")
        node[name] = node.pop(old)
    return node


def _node_lists(
    nodes: Sequence[dict[str, Any]], name: str, offsets: np.ndarray, parent: np.ndarray, old_forms: set[str]
) -> np.ndarray | None:
    """Field ``name`` of every node, flat over the nodes' tokens (float64 or bool [T]); None when
    no node gives it. A node without it contributes 0 (an action mask: True, but a root's first
    token False). A root's list has one entry per predicted token (``len(tokens) - 1``) or, in
    the older form noted in ``old_forms``, one per token."""
    if not any(name in n for n in nodes):
        return None
    dtype: type = bool if name == "action_mask" else np.float64
    flat: np.ndarray = np.zeros(int(offsets[-1]), dtype=dtype)
    if name == "action_mask":
        flat[:] = True
        flat[offsets[:-1][parent < 0]] = False
    for i, node in enumerate(nodes):
        if name not in node:
            continue
        arr: np.ndarray = np.asarray(node[name], dtype=dtype)
        n = int(offsets[i + 1] - offsets[i])
        root = bool(parent[i] < 0)
        start = int(offsets[i])
        if root and arr.shape == (n - 1,):
            start += 1  # the predicted-token form: the root's first token has no entry
        elif arr.shape != (n,):
            want = f"{n - 1} (one per predicted token: a root's first token is not predicted)" if root else f"{n}"
            raise BatchValidationError(
                f"node {node['id']!r}: {name} has {arr.size} values for {n} tokens; expected {want}"
            )
        elif root:
            old_forms.add(name)
            if name == "action_mask" and arr[0]:
                raise BatchValidationError(
                    f"node {node['id']!r}: action_mask marks the root's first token as an action, but nothing "
                    "predicts a first token (it has no log-prob)"
                )
        if dtype is np.float64 and not np.all(np.isfinite(arr)):
            bad = int(np.flatnonzero(~np.isfinite(arr))[0])
            raise BatchValidationError(f"node {node['id']!r}: {name}[{bad}] is {arr[bad]} (must be finite)")
        flat[start : int(offsets[i + 1])] = arr
        if root and name != "action_mask":
            flat[int(offsets[i])] = 0.0  # never read: nothing predicts a first token
    return flat


def _old_form_line(old_forms: set[str]) -> str:
    """The one line of ``BatchFormatWarning`` for a tree given in the older form (``old_forms``:
    ``name:OLD`` for a field's older name, else a field whose root lists are one per token)."""
    what = [
        f"{old!r} for {_OLD_NAMES[old]!r}" for old in sorted(f.removeprefix("name:") for f in old_forms if ":" in f)
    ]
    per_token = sorted(f for f in old_forms if ":" not in f)
    if per_token:
        what.append(f"a root's {', '.join(per_token)} one per token")
    return (
        f"rollout-tree nodes in the older form ({'; '.join(what)}) are deprecated; give a root's lists one value "
        "per predicted token (len(tokens) - 1) and the sampler's log-probs as 'logprobs', as batch files, "
        "harts.Engine and Tinker's datums take them"
    )


def _roots_or_cycle(parent: np.ndarray, ids: list[Any]) -> np.ndarray:
    """Root node of every node; raises naming a node on a cycle."""
    nn = parent.size
    root_of = np.full(nn, -1, dtype=np.int64)
    state = np.zeros(nn, dtype=np.int8)  # 0 new, 1 on the current walk, 2 done
    for start in range(nn):
        if state[start] == 2:
            continue
        walk = []
        v = start
        while v >= 0 and state[v] == 0:
            state[v] = 1
            walk.append(v)
            v = int(parent[v])
        if v >= 0 and state[v] == 1:
            raise BatchValidationError(f"node {ids[v]!r} is on a parent cycle")
        root = walk[-1] if v < 0 else int(root_of[v])
        for u in walk:
            root_of[u] = root
            state[u] = 2
    return root_of
