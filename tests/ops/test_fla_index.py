"""fla's chunk index built on the host: the layout fla's varlen kernels read."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from harts.ops.fla_index import fla_chunk_indices


@given(st.lists(st.integers(0, 300), max_size=12), st.sampled_from([1, 16, 64]))
def test_chunk_index_lists_each_sequence_s_chunks_in_order(lengths: list[int], chunk: int) -> None:
    offsets, index = fla_chunk_indices(np.array(lengths, dtype=np.int64), chunk)
    expected = [(n, c) for n, m in enumerate(lengths) for c in range(-(-m // chunk))]
    assert index.dtype == np.int64 and index.shape == (len(expected), 2)
    assert [tuple(r) for r in index.tolist()] == expected
    assert offsets.tolist() == np.cumsum([0] + [-(-m // chunk) for m in lengths]).tolist()


def test_chunk_index_equals_fla_s_own() -> None:
    torch = pytest.importorskip("torch")
    utils = pytest.importorskip("fla.ops.utils")
    lengths = [0, 3, 64, 65, 0, 200, 1]
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]))
    _, index = fla_chunk_indices(np.array(lengths), 64)
    assert utils.prepare_chunk_indices(cu, 64).tolist() == index.tolist()


@pytest.mark.parametrize("bad", [[-1, 3], [[1, 2]]])
def test_bad_lengths_are_named(bad: list) -> None:
    with pytest.raises(ValueError, match="lengths must be"):
        fla_chunk_indices(np.array(bad), 64)
