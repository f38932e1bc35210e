"""Per-semantic-position log-probabilities from compact logit rows, without S x V tensors."""

from __future__ import annotations

from harts.ops.logprob.mapped import mapped_logprobs
from harts.ops.logprob.naive import naive_mapped_logprobs

__all__ = ["mapped_logprobs", "naive_mapped_logprobs"]
