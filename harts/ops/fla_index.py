"""fla-core's chunk index of packed variable-length sequences, built on the host.

fla's varlen kernels take ``chunk_indices`` int [NT, 2]: for each chunk of ``chunk_size`` rows,
in packed order, (sequence, chunk within that sequence). When a caller does not pass it, fla
builds it from ``cu_seqlens``: on the device (``repeat_interleave``, which reads a count back to
the host) or from ``cu_seqlens_cpu`` followed by a synchronous upload. Either way the host
waits for the device's queue to drain. harts builds it here from host lengths and uploads it
non-blocking, once per layout.
"""

from __future__ import annotations

import numpy as np

__all__ = ["fla_chunk_indices"]


def fla_chunk_indices(lengths: np.ndarray, chunk_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Chunk offsets and fla's chunk index of sequences of ``lengths``.

    Args:
        lengths: int [N] sequence lengths (zero allowed: such a sequence has no chunk).
        chunk_size: rows per chunk (fla's ``BT``).

    Returns:
        offsets: int64 [N + 1], sequence n's chunks are ``offsets[n]:offsets[n + 1]``.
        chunk_indices: int64 [NT, 2], row t = (sequence of chunk t, chunk t's index within it).
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive; got {chunk_size}")
    if lengths.ndim != 1 or (lengths < 0).any():
        raise ValueError(f"lengths must be a 1-d array of non-negative counts; got {lengths[:8].tolist()}")
    chunks = (lengths + chunk_size - 1) // chunk_size
    offsets = np.concatenate([[0], np.cumsum(chunks)]).astype(np.int64)
    seq_of_chunk = np.repeat(np.arange(lengths.size, dtype=np.int64), chunks)
    within = np.arange(int(offsets[-1]), dtype=np.int64) - offsets[:-1][seq_of_chunk]
    return offsets, np.stack([seq_of_chunk, within], 1)
