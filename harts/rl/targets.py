"""Top-k targets: a trajectory whose per-target fields have K columns, as K trajectories of one.

Tinker's top-k distillation datums score K tokens at every position: ``targets`` [n - 1, K] and
``weights`` [n - 1, K] (cross_entropy: ``-sum_tk w[t, k] * log p(targets[t, k] | x[:t + 1])``).
Here such a trajectory becomes K trajectories with the same tokens, copy k carrying column k of
every 2-D field (a 1-D field is shared by all copies). The copies share every token, so compaction
(``harts.tree.compact``) runs the model once over them and the LM head takes one logsumexp per
compact row and gathers the K targets from it (``harts.ops.logprob.mapped``): the cost of K
columns is K gathers per position, not K forwards, and no [positions, V] softmax is kept beyond
the head's chunk. The trajectory-wise baseline runs the K copies as they are (the oracle). The
loss is a sum over tokens, so the copies' losses add up to the datum's.

``ColumnFold`` maps the copies' log-probs back: [n - 1, K] per trajectory that had columns, [n - 1]
per other one, in the caller's order.

Shapes: n_j tokens of trajectory j, K_j its columns (0: none, all fields 1-D).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from harts.errors import UserError

__all__ = ["ColumnFold", "expand_columns"]


@dataclass(frozen=True)
class ColumnFold:
    """Where each caller's trajectory went: ``columns[j]`` copies (0: itself, unexpanded)."""

    columns: tuple[int, ...]

    @property
    def expanded(self) -> bool:
        return any(self.columns)

    def fold(self, per_copy: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Per-copy arrays [n_j - 1] -> one per trajectory: [n_j - 1, K_j], or [n_j - 1] if K_j = 0
        (the arrays as they are where nothing was expanded)."""
        if not self.expanded:
            return list(per_copy)
        out, i = [], 0
        for k in self.columns:
            if k:
                out.append(np.stack(list(per_copy[i : i + k]), axis=1))
                i += k
            else:
                out.append(per_copy[i])
                i += 1
        assert i == len(per_copy), (i, len(per_copy))
        return out

    def unfold(self, per_trajectory: Sequence[np.ndarray]) -> list[np.ndarray]:
        """The inverse of ``fold``: [n_j - 1, K_j] -> K_j arrays [n_j - 1]."""
        if not self.expanded:
            return list(per_trajectory)
        out: list[np.ndarray] = []
        for k, a in zip(self.columns, per_trajectory, strict=True):
            out.extend(a[:, c] for c in range(k)) if k else out.append(a)
        return out


def _columns(traj: Mapping[str, Any], j: int, fields: Sequence[str]) -> int:
    """K_j: the column count its 2-D fields agree on (0 if every field is 1-D); ``UserError``
    for fields of different column counts or a 2-D field beside 1-D targets."""
    ks = {}
    for name in fields:
        if name in traj and traj[name] is not None:
            try:
                shape = np.shape(traj[name])
            except ValueError:  # ragged: the field's own check names it
                continue
            if len(shape) == 2:
                ks[name] = shape[1]
    if not ks:
        return 0
    if len(set(ks.values())) > 1:
        raise UserError(f"trajectory {j}: 2-D fields of different column counts {ks}; all take K columns")
    if "targets" not in ks:
        raise UserError(f"trajectory {j}: {sorted(ks)[0]} is 2-D but targets is not (K columns score K targets)")
    k = ks["targets"]
    if k < 1:
        raise UserError(f"trajectory {j}: targets has 0 columns")
    return int(k)


def expand_columns(
    trajectories: Sequence[Mapping[str, Any]], fields: Sequence[str]
) -> tuple[list[Mapping[str, Any]], ColumnFold]:
    """The trajectories with each one of K columns (2-D ``targets`` and any 2-D field of
    ``fields``) replaced by its K copies (module docstring), and the ``ColumnFold`` back.
    Trajectories without columns are passed through as they are (no copy)."""
    cols = [_columns(t, j, fields) if isinstance(t, Mapping) else 0 for j, t in enumerate(trajectories)]
    if not any(cols):
        return list(trajectories), ColumnFold(tuple(cols))
    out: list[Mapping[str, Any]] = []
    for t, k in zip(trajectories, cols, strict=True):
        if not k:
            out.append(t)
            continue
        arrays = {name: np.asarray(t[name]) for name in fields if name in t and t[name] is not None}
        for c in range(k):
            copy = dict(t)
            copy.update({name: a[:, c] for name, a in arrays.items() if a.ndim == 2})
            out.append(copy)
    return out, ColumnFold(tuple(cols))
