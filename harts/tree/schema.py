"""Field names shared by ``RolloutBatch``, rollout trees and batch files (no imports).

``tree/batch.py`` builds on ``tree/rollout_tree.py`` and ``tree/io.py``; all three read the
metadata names from here, so neither of the two imports the batch.
"""

from __future__ import annotations

__all__ = ["PER_TOKEN_FIELDS"]

#: Optional per-token float metadata, in file-schema order.
PER_TOKEN_FIELDS = ("old_logprobs", "ref_logprobs", "loss_weights")
