"""upload: host arrays of any layout and rank become tensors of the same shape and values."""

from __future__ import annotations

import numpy as np
import torch

from harts.ops.upload import upload


def test_shapes_layouts_and_dtypes_survive() -> None:
    scalar = upload(np.asarray(5.0), "cpu", torch.float32)
    assert scalar.shape == () and scalar.dtype == torch.float32 and float(scalar) == 5.0
    reversed_ = np.arange(6)[::-2]  # negative strides: torch cannot view them
    assert upload(reversed_, "cpu").tolist() == [5, 3, 1]
    assert upload(np.array([[1, 2], [3, 4]], dtype=np.int32), "cpu", torch.int64).dtype == torch.int64
    assert upload(np.zeros((0, 3)), "cpu").shape == (0, 3)
