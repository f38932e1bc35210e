"""Reference for mapped log-probs: materialize every position's logit row (n x V).

Shapes: P hidden rows, D model dim, V vocabulary, n positions.
"""

from __future__ import annotations

import torch

__all__ = ["naive_mapped_logprobs"]


def naive_mapped_logprobs(
    hidden_PD: torch.Tensor, lm_head_weight_VD: torch.Tensor, rows_n: torch.Tensor, targets_n: torch.Tensor
) -> torch.Tensor:
    """log_softmax(hidden[rows] @ weight^T)[n, targets[n]]; allocates n x V."""
    logits = hidden_PD[rows_n] @ lm_head_weight_VD.T
    return torch.log_softmax(logits, dim=-1).gather(1, targets_n[:, None])[:, 0]
