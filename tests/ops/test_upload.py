"""upload: host arrays of any layout and rank become tensors of the same shape and values."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from harts.ops.upload import upload


def test_shapes_layouts_and_dtypes_survive() -> None:
    scalar = upload(np.asarray(5.0), "cpu", torch.float32)
    assert scalar.shape == () and scalar.dtype == torch.float32 and float(scalar) == 5.0
    reversed_ = np.arange(6)[::-2]  # negative strides: torch cannot view them
    assert upload(reversed_, "cpu").tolist() == [5, 3, 1]
    assert upload(np.array([[1, 2], [3, 4]], dtype=np.int32), "cpu", torch.int64).dtype == torch.int64
    assert upload(np.zeros((0, 3)), "cpu").shape == (0, 3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_uploads_are_pinned_copies_that_outlive_their_source() -> None:
    """Uploads queued behind long kernels, each source overwritten right after its call: the device
    tensors hold the values at the time of the call (no pinned block is reused before its copy
    ran), and the calls return while the kernels still run (a pageable copy of 8 MB waits for the
    copy engine, which runs behind them)."""
    n, count = 1 << 20, 16
    warm = [upload(np.zeros(n, dtype=np.int64), "cuda") for _ in range(count)]  # the pinned blocks
    torch.cuda.synchronize()
    del warm
    big = torch.randn(8192, 8192, device="cuda")
    for _ in range(4):
        big = big @ big  # tens of ms of queued float32 work on an H200
    done = torch.cuda.Event()
    done.record()
    got, want = [], []
    for i in range(count):
        src = np.arange(i, i + n, dtype=np.int64)
        got.append(upload(src, "cuda"))
        want.append(src.copy())
        src[:] = -1  # the caller reuses its buffer at once
    still_running = not done.query()
    torch.cuda.synchronize()
    assert still_running
    for g, w in zip(got, want):
        assert np.array_equal(g.cpu().numpy(), w)
