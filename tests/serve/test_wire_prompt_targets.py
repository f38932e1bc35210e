"""``harts.serve.wire.prompt_target_ids`` (a sample request's ``target_prompt_logprobs``) and the
response tensors it is answered with, without a server: what the SDK checks on the client is
checked again here, for any other client."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("tinker")

from tinker.proto import tinker_public_pb2 as pb  # noqa: E402
from tinker.proto.response_conv import _tensor_data_from_proto  # noqa: E402
from tinker.types._pydantic_types.tensor_data import TensorData  # noqa: E402

from harts.serve.wire import WireError, encode_sample_response, prompt_target_ids  # noqa: E402


def td(data: list, dtype: str = "int64", shape: list[int] | None = None, **sparse: list[int]) -> TensorData:
    return TensorData(data=data, dtype=dtype, shape=shape, **sparse)


@pytest.mark.parametrize(
    ("tensor", "says"),
    [
        (td([1.0, 2.0], "float32", [1, 2]), "dtype float32"),
        (td([1, 2], shape=[2]), "shape [2]"),
        (td([1, 2], shape=None), "shape []"),
        (td([1, 2, 3], shape=[1, 2]), "3 values"),
        (td([1, 2.5], shape=[1, 2]), "value 2.5 at flat index 1 is not a token id"),
        (td([2**63 + 1, 2], shape=[1, 2]), "at flat index 0 is not a token id"),
        (td([1, float("nan")], shape=[1, 2]), "value nan at flat index 1"),
        (td([1, 2], shape=[1, 2], sparse_crow_indices=[0, 2], sparse_col_indices=[0, 2]), "sparse_col_indices"),
        (td([1, 2], shape=[1, 2], sparse_crow_indices=[0, 1], sparse_col_indices=[0, 1]), "sparse_crow_indices"),
    ],
)
def test_a_bad_tensor_is_one_line_naming_the_field(tensor: TensorData, says: str) -> None:
    with pytest.raises(WireError) as excinfo:
        prompt_target_ids(tensor, 1, 64, 128)
    assert str(excinfo.value).startswith("target_prompt_logprobs") and says in str(excinfo.value)
    assert "\n" not in str(excinfo.value)


def test_sparse_cells_left_out_ask_nothing_and_the_answer_keeps_the_layout() -> None:
    ids, layout = prompt_target_ids(
        td([5, 7, 9], shape=[3, 2], sparse_crow_indices=[0, 1, 1, 3], sparse_col_indices=[1, 0, 1]), 3, 64, 128
    )
    assert ids.tolist() == [[-1, 5], [-1, -1], [7, 9]]
    assert layout is not None
    lps = np.where(ids >= 0, -0.5 * (ids + 1), 0.0)
    msg = pb.SampleResponse.FromString(
        encode_sample_response([], None, prompt_targets=lps, prompt_targets_layout=layout)
    )
    got = _tensor_data_from_proto(msg.target_prompt_logprobs)
    assert got.sparse_crow_indices == [0, 1, 1, 3] and got.sparse_col_indices == [1, 0, 1]
    np.testing.assert_array_equal(got.to_numpy(), lps.astype(np.float32))


def test_alternative_tokens_travel_as_two_dense_tensors() -> None:
    tokens = np.array([[3, 3], [1, 0]])
    lps = np.array([[-0.25, -0.25], [-1.5, -2.0]])
    msg = pb.SampleResponse.FromString(encode_sample_response([], None, prompt_alt=(tokens, lps)))
    got_tokens = _tensor_data_from_proto(msg.prompt_alt_tokens.tokens)
    got_lps = _tensor_data_from_proto(msg.prompt_alt_tokens.logprobs)
    assert got_tokens.dtype == "int64" and got_tokens.to_numpy().tolist() == tokens.tolist()
    assert got_lps.dtype == "float32" and got_lps.to_numpy().tolist() == lps.tolist()
