"""Chunkwise linear attention on packed sequences: the gated delta rule (KDA per-channel decay, GDN
scalar decay) and the plain decayed recurrence (``rule="plain"``: Mamba-2's SSD), one contract.

`chunk_linear_attn` is the chunkwise reference with boundary-state export, `naive_recurrent_linear_attn`
the token-by-token oracle, and `fla_chunk_linear_attn` the CUDA fast path over fla-core.
"""

from __future__ import annotations

from harts.ops.linear_attn.chunk import chunk_linear_attn
from harts.ops.linear_attn.dispatch import LINEAR_ATTN_BACKENDS, linear_attn_op, resolve_linear_attn_backend
from harts.ops.linear_attn.fla import fla_chunk_linear_attn
from harts.ops.linear_attn.naive import naive_recurrent_linear_attn

__all__ = [
    "LINEAR_ATTN_BACKENDS",
    "chunk_linear_attn",
    "fla_chunk_linear_attn",
    "linear_attn_op",
    "naive_recurrent_linear_attn",
    "resolve_linear_attn_backend",
]
