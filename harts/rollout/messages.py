"""Rollout trees from a user's own engine: OpenAI-style message trees -> a ``RolloutBatch``.

Input: a list of chat messages, each with an ``id`` and a ``parent_id`` (None for a root), so
that every root-to-leaf path is one conversation; siblings are alternative continuations (the
engine forked there). Every other field of a message (``role``, ``content``, ``tool_calls``,
``name``, ...) goes to the chat template as is. A leaf carries ``reward`` (GRPO advantages are
then taken over the leaves of its ``group_id``, default its root) or an explicit ``advantage``::

    {"id": "u1", "parent_id": null, "role": "user", "content": "What is 6 x 7?"}
    {"id": "a1", "parent_id": "u1", "role": "assistant", "content": "42", "reward": 1.0}
    {"id": "a2", "parent_id": "u1", "role": "assistant", "content": "41", "reward": 0.0}

Tokenization: the tokens of message m are what its conversation's rendering gains when m is
added, ``ids(path[:m+1])[len(ids(path[:m])):]`` with the tokenizer's chat template. Shared turns
must come out as shared token prefixes, so this only holds if rendering a conversation never
changes how its earlier turns render; some templates break that (they drop an earlier turn's
reasoning, or end the last turn differently). Every prefix is therefore re-tokenized and
checked, and a template that breaks sharing is a ``BatchValidationError`` naming the message
and the first differing token. Assistant messages are actions, except the template's
generation prompt (the assistant header) where ``add_generation_prompt`` renders one.

The tokenizer is any object with transformers' ``apply_chat_template`` (a
``PreTrainedTokenizerFast`` with a ``chat_template``); nothing here imports transformers.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np

from harts.errors import BatchValidationError
from harts.rl.grpo import group_advantages
from harts.tree.batch import RolloutBatch

__all__ = ["batch_from_messages", "load_messages"]

#: message fields harts reads; the rest is the chat template's
_OWN = ("id", "parent_id", "parent", "reward", "advantage", "group_id")


def load_messages(path: str) -> list[dict[str, Any]]:
    """Messages from ``path``: a JSON list, or JSON lines with one message per line."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if text.lstrip().startswith("["):
        data = json.loads(text)
        if not isinstance(data, list):
            raise BatchValidationError(f"{path}: expected a list of messages")
        return data
    out = []
    for i, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise BatchValidationError(f"{path}, line {i}: not JSON ({err.msg})") from None
    return out


def _render(tokenizer: Any, conversation: list[dict[str, Any]], generation_prompt: bool = False) -> list[int]:
    if not conversation:
        return []
    ids = tokenizer.apply_chat_template(
        conversation, tokenize=True, add_generation_prompt=generation_prompt, return_dict=False
    )
    return [int(t) for t in ids]


def _first_difference(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if diff.size else n


def batch_from_messages(
    messages: Sequence[dict[str, Any]], tokenizer: Any, *, vocab_size: int | None = None
) -> RolloutBatch:
    """A ``RolloutBatch`` whose tree is the message tree (module docstring).

    Raises:
        BatchValidationError: naming the message: a missing id or parent, a duplicate id, a
            cycle, a leaf without ``reward`` or ``advantage``, a message that renders to no
            tokens, or a chat template under which a shared turn is not a shared prefix.
    """
    if not messages:
        raise BatchValidationError("a message tree needs at least one message")
    index: dict[Any, int] = {}
    for i, m in enumerate(messages):
        if "id" not in m:
            raise BatchValidationError(f"message #{i} has no 'id'")
        if m["id"] in index:
            raise BatchValidationError(f"duplicate message id {m['id']!r}")
        index[m["id"]] = i
    parent = np.full(len(messages), -1, dtype=np.int64)
    for i, m in enumerate(messages):
        p = m.get("parent_id", m.get("parent"))
        if p is not None:
            if p not in index:
                raise BatchValidationError(f"message {m['id']!r}: parent {p!r} does not exist")
            parent[i] = index[p]
    order = _parents_first(parent, [m["id"] for m in messages])
    has_child = np.zeros(len(messages), dtype=bool)
    has_child[parent[parent >= 0]] = True

    rendered: dict[int, list[int]] = {}  # message -> ids of its whole conversation
    root_of = np.empty(len(messages), dtype=np.int64)
    nodes: list[dict[str, Any]] = []
    for i in order:
        m, p = messages[i], int(parent[i])
        root_of[i] = i if p < 0 else root_of[p]
        path = [i]
        while parent[path[-1]] >= 0:
            path.append(int(parent[path[-1]]))
        conversation = [{k: v for k, v in messages[j].items() if k not in _OWN} for j in reversed(path)]
        before = rendered[p] if p >= 0 else []
        ids = _render(tokenizer, conversation)
        at = _first_difference(before, ids)
        if at < len(before):
            raise BatchValidationError(
                f"message {m['id']!r}: the chat template renders the conversation before it differently once it "
                f"is added (token {at}: {before[at]} becomes {ids[at] if at < len(ids) else 'nothing'}), so the "
                "turns it shares with its siblings would not be a shared token prefix; use a template that "
                "renders earlier turns the same way in every conversation"
            )
        span = ids[len(before) :]
        if not span:
            raise BatchValidationError(f"message {m['id']!r} renders to no tokens")
        rendered[i] = ids
        mask = [False] * len(span)
        if m.get("role") == "assistant":
            header = _render(tokenizer, conversation[:-1], generation_prompt=True)
            skip = len(header) - len(before) if ids[: len(header)] == header else 0
            mask = [False] * skip + [True] * (len(span) - skip)
        if p < 0:
            mask = mask[1:]  # nothing predicts a first token: one entry per predicted token
        parent_id = None if p < 0 else messages[p]["id"]
        nodes.append({"id": m["id"], "parent": parent_id, "tokens": span, "action_mask": mask})

    leaves = [i for i in range(len(messages)) if not has_child[i]]
    _leaf_advantages(messages, leaves, root_of, {n["id"]: n for n in nodes})
    # the tree numbers trajectories by leaf order in the node list; keep the input's order
    nodes.sort(key=lambda n: index[n["id"]])
    return RolloutBatch.from_tree(nodes, vocab_size=vocab_size)


def _leaf_advantages(
    messages: Sequence[dict[str, Any]], leaves: list[int], root_of: np.ndarray, nodes: dict[Any, dict[str, Any]]
) -> None:
    """Set ``advantage`` and ``group_id`` on every leaf node: given, or group-relative from rewards."""
    for i in leaves:
        if "advantage" not in messages[i] and "reward" not in messages[i]:
            raise BatchValidationError(f"message {messages[i]['id']!r} is a leaf without 'reward' or 'advantage'")
    # group ids may be any JSON value; default: one group per root
    keys = [json.dumps(messages[i]["group_id"]) if "group_id" in messages[i] else f"root {root_of[i]}" for i in leaves]
    number = {key: n for n, key in enumerate(dict.fromkeys(keys))}
    groups = np.array([number[key] for key in keys], dtype=np.int64)
    rewarded = [k for k, i in enumerate(leaves) if "advantage" not in messages[leaves[k]]]
    adv = np.zeros(len(leaves))
    if rewarded:
        rewards = np.array([float(messages[leaves[k]]["reward"]) for k in rewarded])
        adv[rewarded] = group_advantages(rewards, groups[rewarded])
    for k, i in enumerate(leaves):
        node = nodes[messages[i]["id"]]
        node["advantage"] = float(messages[i]["advantage"]) if "advantage" in messages[i] else float(adv[k])
        node["group_id"] = int(groups[k])


def _parents_first(parent: np.ndarray, ids: list[Any]) -> list[int]:
    """Message indices with every parent before its children; BatchValidationError on a cycle."""
    children: dict[int, list[int]] = {}
    for i, p in enumerate(parent.tolist()):
        children.setdefault(p, []).append(i)
    order, stack = [], list(reversed(children.get(-1, [])))
    while stack:
        i = stack.pop()
        order.append(i)
        stack.extend(reversed(children.get(i, [])))
    if len(order) < len(parent):
        stuck = sorted(set(range(len(parent))) - set(order))[0]
        raise BatchValidationError(f"message {ids[stuck]!r} is on a cycle of parent ids (no root above it)")
    return order
