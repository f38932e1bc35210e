"""Host arrays to device tensors without waiting for the device.

A synchronous host-to-device copy (``torch.as_tensor(a, device=cuda)``, ``.to(cuda)``) first
drains the stream, so the host stops running ahead of the GPU in the middle of a step. A
"non-blocking" copy from pageable host memory is no better in practice: the driver stages it
through its own pinned buffer, and the host waits until the copy engine, which runs in stream
order behind the kernels already queued, has taken the data; with a hundred or so index
copies per microbatch the GPU then sits idle (a profile before and after:
``benchmarks/results/ling3-tiny_h200_2026-12-01_tma-pinned-uploads.md``). ``upload`` therefore copies the array into pinned
(page-locked) memory from torch's caching host allocator first: the device copy is then queued
and the call returns at once. The pinned block is not handed out again before its copy has run
(the allocator records the copy's stream event), and the source array may be freed or changed
right after the call.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

__all__ = ["upload"]

#: False once pinning has failed on this machine (then pageable copies, with one warning)
_PINNING = [True]


def upload(a: np.ndarray, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``a`` (converted to ``dtype`` on the host, if given) as a tensor on ``device``, non-blocking:
    through pinned host memory on CUDA (module docstring), a plain copy elsewhere."""
    # np.require keeps a 0-d array 0-d (np.ascontiguousarray would make it [1])
    host = torch.as_tensor(np.require(a, requirements="C"), dtype=dtype)
    device = torch.device(device)
    if device.type == "cuda" and host.numel() and _PINNING[0]:
        try:
            host = host.pin_memory()
        except RuntimeError as exc:  # no page-locked memory here: keep training, say why once
            _PINNING[0] = False
            warnings.warn(f"pinned host memory unavailable ({exc}); index uploads use pageable copies", stacklevel=2)
    return host.to(device, non_blocking=True)
