"""RolloutBatch: N trajectories in original order with the per-token RL metadata.

Every array is flat over the S semantic positions of the batch (trajectory j owns
``[offsets[j], offsets[j+1])``); nothing is reordered, nothing is dropped.

Alignment of per-token metadata: entry t of a trajectory describes token t *as an
action*: it was sampled from ``p(. | x[:t])``. Token 0 is never predicted, so
``action_mask[0]`` must be False; the model's log-prob for token t (t >= 1) is entry
``t - 1`` of that trajectory's ``logprobs`` slice (see ``RolloutBatch.logprob_index``).

Shapes (S = total tokens, N = trajectories):
    tokens        int64   [S]
    offsets       int64   [N + 1]
    action_mask   bool    [S]
    advantages    float64 [S]   (per-trajectory advantages are broadcast to tokens)
    old_logprobs  float64 [S] | None   entry 0 of each trajectory is ignored
    ref_logprobs  float64 [S] | None   entry 0 of each trajectory is ignored
    loss_weights  float64 [S] | None
    group_ids     int64   [N] | None
    tree_ids      int64   [N] | None
    rewards       float64 [N] | None   per-trajectory scalar reward (reported; the loss uses
                                       advantages)
    targets       int64   [S] | None   the token whose log-prob entry t of a trajectory takes
                                       (entry 0 of each trajectory is ignored); None: the
                                       token itself, i.e. the next input token (Tinker's
                                       datums may score any token at a position)
    loss_inputs   {name: float64 [S]} | None   further per-token inputs of a loss
                                       (Tinker's ``sequence_ratio_mask``), entry 0 ignored
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from harts.errors import BatchValidationError
from harts.tree.io import load_batch, save_batch
from harts.tree.rollout_tree import RolloutTree
from harts.tree.schema import PER_TOKEN_FIELDS

__all__ = ["RolloutBatch", "BatchValidationError", "PER_TOKEN_FIELDS"]


@dataclass(frozen=True, eq=False)
class RolloutBatch:
    """N trajectories (token-id sequences) with per-token RL metadata, in original order."""

    tokens: np.ndarray
    offsets: np.ndarray
    action_mask: np.ndarray
    advantages: np.ndarray
    old_logprobs: np.ndarray | None = None
    ref_logprobs: np.ndarray | None = None
    loss_weights: np.ndarray | None = None
    group_ids: np.ndarray | None = None
    tree_ids: np.ndarray | None = None
    rewards: np.ndarray | None = None
    vocab_size: int | None = None
    targets: np.ndarray | None = None
    loss_inputs: dict[str, np.ndarray] | None = None
    #: The explicit rollout trees this batch was built from, if any. Compaction uses it
    #: to build the trie without token comparisons.
    tree: RolloutTree | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        _validate(self)

    # ------------------------------------------------------------------ sizes
    @property
    def num_trajectories(self) -> int:
        return len(self.offsets) - 1

    @property
    def num_tokens(self) -> int:
        """S: the number of semantic positions."""
        return int(self.offsets[-1])

    @property
    def lengths(self) -> np.ndarray:
        """int64 [N]: tokens per trajectory."""
        return np.diff(self.offsets)

    @property
    def num_logprobs(self) -> int:
        """sum(len(x) - 1): the length of the model's ``logprobs`` output."""
        return self.num_tokens - self.num_trajectories

    def trajectory(self, j: int) -> np.ndarray:
        """int64 [len_j]: the tokens of trajectory j (a view)."""
        return self.tokens[self.offsets[j] : self.offsets[j + 1]]

    def trajectories(self) -> list[np.ndarray]:
        return [self.trajectory(j) for j in range(self.num_trajectories)]

    def logprob_index(self) -> np.ndarray:
        """int64 [S]: index into ``logprobs`` of each token, -1 for every first token.

        ``logprobs`` has length sum(len - 1); token t >= 1 of trajectory j sits at
        ``offsets[j] - j + t - 1``.
        """
        j = np.repeat(np.arange(self.num_trajectories), self.lengths)
        idx = np.arange(self.num_tokens) - j - 1
        idx[self.offsets[:-1]] = -1
        return idx

    def _predicted(self) -> np.ndarray:
        """bool [S]: tokens that have a log-prob (every token but each trajectory's first)."""
        keep = np.ones(self.num_tokens, dtype=bool)
        keep[self.offsets[:-1]] = False
        return keep

    def next_token_targets(self) -> np.ndarray:
        """int64 [S - N]: for every predicting position, the token whose log-prob it takes
        (original order): the next token, or ``targets`` where the batch has them."""
        return (self.tokens if self.targets is None else self.targets)[self._predicted()]

    def action_logprob_entries(self) -> np.ndarray:
        """int64 [A]: the entries of ``logprobs`` [S - N] whose target token is an action
        (``action_mask``), ascending; A = ``action_mask.sum()`` (a first token is never an action).
        The only entries an RL loss reads (``ExecutionConfig.logprob_positions="actions"``)."""
        return np.flatnonzero(self.action_mask[self._predicted()])

    def predicting_positions(self) -> np.ndarray:
        """int64 [S - N]: the semantic position that predicts each log-prob entry."""
        keep = np.ones(self.num_tokens, dtype=bool)
        keep[self.offsets[1:] - 1] = False
        return np.flatnonzero(keep)

    # ------------------------------------------------------------ constructors
    @classmethod
    def from_trajectories(
        cls,
        trajectories: Sequence[Sequence[int] | np.ndarray],
        *,
        action_mask: Sequence[Sequence[bool] | np.ndarray] | None = None,
        advantages: Sequence[float] | Sequence[Sequence[float]] | np.ndarray | None = None,
        old_logprobs: Sequence[Sequence[float] | np.ndarray] | None = None,
        ref_logprobs: Sequence[Sequence[float] | np.ndarray] | None = None,
        loss_weights: Sequence[Sequence[float] | np.ndarray] | None = None,
        group_ids: Sequence[int] | np.ndarray | None = None,
        tree_ids: Sequence[int] | np.ndarray | None = None,
        rewards: Sequence[float] | np.ndarray | None = None,
        vocab_size: int | None = None,
    ) -> RolloutBatch:
        """Build a batch from one token list per trajectory plus metadata.

        Per-token metadata is one sequence per trajectory, each as long as its tokens.
        ``advantages`` is either N scalars (one per trajectory) or N per-token sequences.
        Defaults: every token but the first is an action; advantages are zero.
        """
        n = len(trajectories)
        if n == 0:
            raise BatchValidationError("a rollout batch needs at least one trajectory")
        parts = []
        for j, traj in enumerate(trajectories):
            arr = _as_int_array(traj, f"trajectory {j}")
            if arr.size == 0:
                raise BatchValidationError(f"trajectory {j} is empty")
            parts.append(arr)
        lengths = np.array([p.size for p in parts], dtype=np.int64)
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        tokens = np.concatenate(parts)

        if action_mask is None:
            mask = np.ones(int(offsets[-1]), dtype=bool)
            mask[offsets[:-1]] = False
        else:
            mask = _flatten_per_token(action_mask, lengths, "action_mask", bool)

        if advantages is None:
            adv = np.zeros(int(offsets[-1]), dtype=np.float64)
        else:
            adv = _advantages_to_tokens(advantages, lengths)

        def opt(values: Any, name: str) -> np.ndarray | None:
            if values is None:
                return None
            return _flatten_per_token(values, lengths, name, np.float64)

        return cls(
            tokens=tokens,
            offsets=offsets,
            action_mask=mask,
            advantages=adv,
            old_logprobs=opt(old_logprobs, "old_logprobs"),
            ref_logprobs=opt(ref_logprobs, "ref_logprobs"),
            loss_weights=opt(loss_weights, "loss_weights"),
            group_ids=_opt_ids(group_ids, n, "group_ids"),
            tree_ids=_opt_ids(tree_ids, n, "tree_ids"),
            rewards=None if rewards is None else np.asarray(rewards, dtype=np.float64),
            vocab_size=vocab_size,
        )

    @classmethod
    def from_tree(cls, nodes: Sequence[dict[str, Any]] | RolloutTree, *, vocab_size: int | None = None) -> RolloutBatch:
        """Build a batch from explicit rollout-tree nodes (see ``harts.tree.rollout_tree``) or
        a built ``RolloutTree``: every root-to-leaf path is a trajectory, in leaf order."""
        tree = nodes if isinstance(nodes, RolloutTree) else RolloutTree.from_nodes(nodes)
        return cls(**tree.batch_fields(), vocab_size=vocab_size, tree=tree)

    # ------------------------------------------------------------------ files
    @classmethod
    def load(cls, path: str, *, vocab_size: int | None = None) -> RolloutBatch:
        """Read a ``.jsonl`` or ``.parquet`` batch file (schema: ``harts.tree.io``)."""
        return load_batch(path, vocab_size=vocab_size, build=cls.from_trajectories)

    def save(self, path: str) -> None:
        """Write a ``.jsonl`` or ``.parquet`` batch file (schema: ``harts.tree.io``)."""
        save_batch(self, path)

    def select(self, indices: Sequence[int] | np.ndarray) -> RolloutBatch:
        """A new batch holding trajectories ``indices`` in that order (metadata kept)."""
        idx = np.asarray(indices, dtype=np.int64)
        if idx.size == 0:
            raise BatchValidationError("select() needs at least one trajectory index")
        if idx.min() < 0 or idx.max() >= self.num_trajectories:
            raise BatchValidationError(
                f"trajectory index out of range [0, {self.num_trajectories}): {idx.min()}..{idx.max()}"
            )
        lengths = self.lengths[idx]
        offsets = np.zeros(idx.size + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        gather = np.arange(int(offsets[-1])) - np.repeat(offsets[:-1] - self.offsets[idx], lengths)

        def take(a: np.ndarray | None) -> np.ndarray | None:
            return None if a is None else a[gather]

        def take_ids(a: np.ndarray | None) -> np.ndarray | None:
            return None if a is None else a[idx]

        return RolloutBatch(
            tokens=self.tokens[gather],
            offsets=offsets,
            action_mask=self.action_mask[gather],
            advantages=self.advantages[gather],
            old_logprobs=take(self.old_logprobs),
            ref_logprobs=take(self.ref_logprobs),
            loss_weights=take(self.loss_weights),
            group_ids=take_ids(self.group_ids),
            tree_ids=take_ids(self.tree_ids),
            rewards=take_ids(self.rewards),
            vocab_size=self.vocab_size,
            targets=take(self.targets),
            loss_inputs=None if self.loss_inputs is None else {k: v[gather] for k, v in self.loss_inputs.items()},
        )

    def __repr__(self) -> str:
        return (
            f"RolloutBatch(trajectories={self.num_trajectories}, tokens={self.num_tokens}, "
            f"vocab_size={self.vocab_size})"
        )


# ---------------------------------------------------------------------- helpers
def _as_int_array(values: Any, what: str) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise BatchValidationError(f"{what}: expected a 1-D token sequence, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        if np.issubdtype(arr.dtype, np.floating) and np.all(np.isfinite(arr)) and np.all(arr == np.round(arr)):
            arr = arr.astype(np.int64)
        else:
            raise BatchValidationError(f"{what}: token ids must be integers, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def _flatten_per_token(values: Any, lengths: np.ndarray, name: str, dtype: Any) -> np.ndarray:
    if len(values) != len(lengths):
        raise BatchValidationError(f"{name}: has {len(values)} entries but the batch has {len(lengths)} trajectories")
    parts = []
    for j, (v, n) in enumerate(zip(values, lengths)):
        arr = np.asarray(v, dtype=dtype)
        if arr.ndim != 1 or arr.size != n:
            raise BatchValidationError(
                f"{name}: trajectory {j} has {arr.size if arr.ndim == 1 else arr.shape} values for {n} tokens"
            )
        parts.append(arr)
    return np.concatenate(parts)


def _advantages_to_tokens(values: Any, lengths: np.ndarray) -> np.ndarray:
    if isinstance(values, np.ndarray) and values.ndim == 1 and values.dtype != object:
        per_traj = values
    elif len(values) and all(np.ndim(v) == 0 for v in values):
        per_traj = np.asarray(values, dtype=np.float64)
    else:
        return _flatten_per_token(values, lengths, "advantages", np.float64)
    if per_traj.size != lengths.size:
        raise BatchValidationError(
            f"advantages: has {per_traj.size} entries but the batch has {lengths.size} trajectories"
        )
    return np.repeat(per_traj.astype(np.float64), lengths)


def _opt_ids(values: Any, n: int, name: str) -> np.ndarray | None:
    if values is None:
        return None
    arr = np.asarray(values)
    if arr.ndim != 1 or arr.size != n:
        raise BatchValidationError(f"{name}: has {arr.size} entries but the batch has {n} trajectories")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise BatchValidationError(f"{name}: ids must be integers, got dtype {arr.dtype}")
    return arr.astype(np.int64)


def _traj_of(batch: RolloutBatch, flat_index: int) -> tuple[int, int]:
    j = int(np.searchsorted(batch.offsets, flat_index, side="right") - 1)
    return j, int(flat_index - batch.offsets[j])


def _validate(b: RolloutBatch) -> None:
    n = len(b.offsets) - 1
    if n < 1:
        raise BatchValidationError("a rollout batch needs at least one trajectory")
    if b.offsets[0] != 0 or b.offsets[-1] != b.tokens.size:
        raise BatchValidationError(
            f"offsets must start at 0 and end at len(tokens)={b.tokens.size}, got {b.offsets[0]}..{b.offsets[-1]}"
        )
    lengths = np.diff(b.offsets)
    empty = np.flatnonzero(lengths <= 0)
    if empty.size:
        raise BatchValidationError(f"trajectory {int(empty[0])} is empty")
    s = b.tokens.size
    if b.tokens.dtype != np.int64:
        raise BatchValidationError(f"tokens must be int64, got {b.tokens.dtype}")
    neg = np.flatnonzero(b.tokens < 0)
    if neg.size:
        j, t = _traj_of(b, int(neg[0]))
        raise BatchValidationError(f"trajectory {j}, position {t}: negative token id {int(b.tokens[neg[0]])}")
    if b.vocab_size is not None:
        if b.vocab_size <= 0:
            raise BatchValidationError(f"vocab_size must be positive, got {b.vocab_size}")
        big = np.flatnonzero(b.tokens >= b.vocab_size)
        if big.size:
            j, t = _traj_of(b, int(big[0]))
            raise BatchValidationError(
                f"trajectory {j}, position {t}: token id {int(b.tokens[big[0]])} is out of vocabulary "
                f"(vocab_size={b.vocab_size})"
            )
    _validate_targets(b)
    named = [("action_mask", b.action_mask), ("advantages", b.advantages)]
    named += [(f, getattr(b, f)) for f in PER_TOKEN_FIELDS if getattr(b, f) is not None]
    named += [(f"loss_inputs.{k}", v) for k, v in (b.loss_inputs or {}).items()]
    for name, arr in named:
        if arr.shape != (s,):
            raise BatchValidationError(f"{name}: expected {s} per-token values, got shape {arr.shape}")
    for name, arr in named[1:]:
        bad = np.flatnonzero(~np.isfinite(arr))
        if bad.size:
            j, t = _traj_of(b, int(bad[0]))
            raise BatchValidationError(f"{name}: trajectory {j}, position {t} is {arr[bad[0]]} (must be finite)")
    first_action = np.flatnonzero(b.action_mask[b.offsets[:-1]])
    if first_action.size:
        raise BatchValidationError(
            f"action_mask: trajectory {int(first_action[0])} marks its first token as an action, "
            "but nothing predicts a first token (it has no log-prob)"
        )
    for name in ("group_ids", "tree_ids"):
        arr = getattr(b, name)
        if arr is not None and arr.shape != (n,):
            raise BatchValidationError(f"{name}: expected {n} per-trajectory ids, got shape {arr.shape}")
    if b.rewards is not None:
        if b.rewards.shape != (n,):
            raise BatchValidationError(f"rewards: expected {n} per-trajectory values, got shape {b.rewards.shape}")
        bad = np.flatnonzero(~np.isfinite(b.rewards))
        if bad.size:
            raise BatchValidationError(f"rewards: trajectory {int(bad[0])} has {b.rewards[bad[0]]} (must be finite)")


def _validate_targets(b: RolloutBatch) -> None:
    """``targets``: int64 [S], each a token id of the vocabulary."""
    if b.targets is None:
        return
    if b.targets.dtype != np.int64 or b.targets.shape != b.tokens.shape:
        raise BatchValidationError(
            f"targets: expected int64 [{b.tokens.size}], got {b.targets.dtype} {b.targets.shape}"
        )
    top = b.vocab_size if b.vocab_size is not None else np.iinfo(np.int64).max
    bad = np.flatnonzero((b.targets < 0) | (b.targets >= top))
    if bad.size:
        j, t = _traj_of(b, int(bad[0]))
        raise BatchValidationError(f"targets: trajectory {j}, position {t}: {int(b.targets[bad[0]])} is no token id")
