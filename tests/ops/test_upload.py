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
    """Uploads queued behind a long kernel, each source overwritten right after its call: the device
    tensors hold the values at the time of the call (no pinned block is reused before its copy
    ran), and the calls return while the kernel still runs (a pageable copy of 8 MB waits for the
    copy engine, which runs behind it)."""
    n, count = 1 << 20, 16
    warm = [upload(np.zeros(n, dtype=np.int64), "cuda") for _ in range(count)]  # the pinned blocks
    torch.cuda.synchronize()
    del warm
    torch.cuda._sleep(2_000_000_000)  # a kernel that spins ~1 s (2e9 cycles at <= 1.98 GHz)
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
    for g, w in zip(got, want):
        assert np.array_equal(g.cpu().numpy(), w)
    assert still_running, "the uploads waited for the queued kernel"
