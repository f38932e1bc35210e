"""Preallocated decoding caches of many sequences at once: what ``harts.rollout.fast`` reads and
writes in place, and the host bookkeeping of which sequence owns which rows.

Per decoder layer, allocated on the layer's first use (its shapes come from the layer's own
tensors, so every mixer kind is covered without a table of them):

    linear attention (K, G, Mamba-2):  conv_NWC  the last W-1 pre-conv inputs of each sequence
                                       state_NHKV the recurrent state of each sequence
    full attention (M, A):             k_PGD, v_PGE  keys and values by token slot

A sequence is a row ``n`` of the per-sequence tensors; its attention keys live in token slots,
``table_NL[n, i]`` the slot of its i-th token. Forks share their parent's slots by reference
(decoding only appends, each branch to slots of its own, so nothing is ever copied on write);
a slot is freed when no sequence holds it any more (``refs``). The recurrent and conv states are
copied on fork: they are small (one state per head, not per token).

Capacity grows by doubling when a call needs more sequences, slots or positions than are
allocated; a grown tensor is a new allocation, so callers re-read the tensors after
``reserve``.

Shapes: N sequences (capacity), P token slots (capacity), L positions per sequence (capacity),
W conv width, C conv channels, H heads, K/V/D/E head dims, G kv heads.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["SlotCache"]


def _grown(x: torch.Tensor, size: int, dim: int = 0) -> torch.Tensor:
    """``x`` with dimension ``dim`` enlarged to ``size``; new entries zero."""
    if x.shape[dim] >= size:
        return x
    shape = list(x.shape)
    shape[dim] = size
    out = x.new_zeros(shape)
    out.narrow(dim, 0, x.shape[dim]).copy_(x)
    return out


class SlotCache:
    """The caches of up to N live sequences (module docstring)."""

    def __init__(self, device: torch.device, *, seqs: int = 8, slots: int = 1024, positions: int = 256) -> None:
        self.device = device
        #: per layer: {"conv": [N, W-1, C], "state": [N, H, K, V], "k": [P, G, D], "v": [P, G, E]}
        self.layers: dict[int, dict[str, torch.Tensor]] = {}
        #: int64 [N, L] on the device: the slot of each position of each sequence
        self.table_NL = torch.zeros(seqs, positions, dtype=torch.int64, device=device)
        #: tokens each sequence has consumed (host)
        self.lengths = np.zeros(seqs, dtype=np.int64)
        self.live = np.zeros(seqs, dtype=bool)
        #: sequences holding each slot (host); 0: free
        self.refs = np.zeros(slots, dtype=np.int64)
        #: host mirror of ``table_NL`` (the rows of live sequences), for freeing slots without a sync
        self.table_host = np.zeros((seqs, positions), dtype=np.int64)
        #: bumped whenever a tensor is allocated or grown: what holds their addresses (a captured
        #: CUDA graph) is stale once it changes
        self.version = 0

    @property
    def num_slots(self) -> int:
        return len(self.refs)

    # ------------------------------------------------------------------ capacity
    def reserve(self, seqs: int, slots: int, positions: int) -> None:
        """Room for ``seqs`` more sequences, ``slots`` more token slots and sequences of
        ``positions`` tokens; grows what is short by doubling."""
        n_cap, l_cap = self.table_NL.shape
        shapes = (n_cap, l_cap, self.num_slots)
        need_n = int(self.live.sum()) + seqs
        if need_n > n_cap:
            n_new = max(2 * n_cap, need_n)
            self.table_NL = _grown(self.table_NL, n_new)
            self.table_host = np.concatenate([self.table_host, np.zeros((n_new - n_cap, l_cap), np.int64)])
            self.lengths = np.concatenate([self.lengths, np.zeros(n_new - n_cap, np.int64)])
            self.live = np.concatenate([self.live, np.zeros(n_new - n_cap, bool)])
            for cache in self.layers.values():
                for name in ("conv", "state"):
                    if name in cache:
                        cache[name] = _grown(cache[name], n_new)
        n_cap = self.table_NL.shape[0]
        if positions > l_cap:
            l_new = max(2 * l_cap, positions)
            self.table_NL = _grown(self.table_NL, l_new, dim=1)
            self.table_host = np.concatenate([self.table_host, np.zeros((n_cap, l_new - l_cap), np.int64)], 1)
        free = int((self.refs == 0).sum())
        if slots > free:
            p_new = max(2 * self.num_slots, self.num_slots + slots - free)
            self.refs = np.concatenate([self.refs, np.zeros(p_new - self.num_slots, np.int64)])
            for cache in self.layers.values():
                for name in ("k", "v"):
                    if name in cache:
                        cache[name] = _grown(cache[name], p_new)
        self.version += (*self.table_NL.shape, self.num_slots) != shapes

    # ------------------------------------------------------------------ sequences
    def open(self, count: int) -> list[int]:
        """``count`` new empty sequences (their conv and recurrent states zeroed)."""
        self.reserve(count, 0, 0)
        ids = np.flatnonzero(~self.live)[:count].tolist()
        self.live[ids] = True
        self.lengths[ids] = 0
        index = torch.as_tensor(ids, dtype=torch.int64, device=self.device)
        for cache in self.layers.values():
            for name in ("conv", "state"):
                if name in cache:
                    cache[name][index] = 0
        return ids

    def fork(self, parent: int, count: int) -> list[int]:
        """``count`` new sequences with ``parent``'s tokens: slots shared, states copied."""
        self.reserve(count, 0, 0)
        ids = self.open(count)
        length = int(self.lengths[parent])
        self.lengths[ids] = length
        self.table_host[ids, :length] = self.table_host[parent, :length]
        np.add.at(self.refs, self.table_host[parent, :length], count)
        index = torch.as_tensor(ids, dtype=torch.int64, device=self.device)
        self.table_NL[index, :length] = self.table_NL[parent, :length].clone()
        for cache in self.layers.values():
            for name in ("conv", "state"):
                if name in cache:
                    cache[name][index] = cache[name][parent].clone()
        return ids

    def close(self, ids: Sequence[int]) -> None:
        """Free sequences ``ids`` and every slot no other sequence holds."""
        for n in ids:
            if not self.live[n]:
                raise ValueError(f"sequence {n} is not open")
            np.subtract.at(self.refs, self.table_host[n, : self.lengths[n]], 1)
            self.live[n] = False
            self.lengths[n] = 0

    def append(self, ids: Sequence[int], counts: Sequence[int]) -> torch.Tensor:
        """Give sequence ``ids[b]`` ``counts[b]`` new token slots after its last token (in the
        table); returns their slot ids int64 [sum(counts)] on the device, sequence after
        sequence. ``lengths`` is not advanced (``advance`` does, once the tokens ran)."""
        total = int(sum(counts))
        longest = max(int(self.lengths[n]) + c for n, c in zip(ids, counts))
        self.reserve(0, total, longest)
        slots = np.flatnonzero(self.refs == 0)[:total]
        self.refs[slots] = 1
        rows = np.repeat(np.asarray(ids, dtype=np.int64), counts)
        cols = np.concatenate([self.lengths[n] + np.arange(c) for n, c in zip(ids, counts)])
        self.table_host[rows, cols] = slots
        slots_dev = torch.as_tensor(slots, dtype=torch.int64).to(self.device, non_blocking=True)
        rows_dev = torch.as_tensor(rows).to(self.device, non_blocking=True)
        cols_dev = torch.as_tensor(cols).to(self.device, non_blocking=True)
        self.table_NL[rows_dev, cols_dev] = slots_dev
        return slots_dev

    def advance(self, ids: Sequence[int], counts: Sequence[int]) -> None:
        """Sequences ``ids`` consumed ``counts`` more tokens."""
        self.lengths[np.asarray(ids, dtype=np.int64)] += np.asarray(counts, dtype=np.int64)

    # ------------------------------------------------------------------ per-layer tensors
    def tensor(self, layer: int, name: str, row_shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """Layer ``layer``'s cache ``name`` (module docstring), allocated zero on first use with
        rows of shape ``row_shape``: N rows for "conv" / "state", P slots for "k" / "v"."""
        cache = self.layers.setdefault(layer, {})
        if name not in cache:
            rows = self.num_slots if name in ("k", "v") else self.table_NL.shape[0]
            cache[name] = torch.zeros(rows, *row_shape, dtype=dtype, device=self.device)
            self.version += 1
        return cache[name]
