"""Host arrays to device tensors without waiting for the device.

A synchronous host-to-device copy (``torch.as_tensor(a, device=cuda)``, ``.to(cuda)``) first
drains the stream, so the host stops running ahead of the GPU in the middle of a step. A
non-blocking copy from pageable host memory is staged before the call returns, so the source
array may be freed or changed right after it.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["upload"]


def upload(a: np.ndarray, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``a`` (converted to ``dtype`` on the host, if given) as a tensor on ``device``, non-blocking."""
    # np.require keeps a 0-d array 0-d (np.ascontiguousarray would make it [1])
    return torch.as_tensor(np.require(a, requirements="C"), dtype=dtype).to(device, non_blocking=True)
