"""harts' error types: one ``UserError`` family (a ``ValueError``), one line each, also in the
Python API."""

from __future__ import annotations

import pickle

import pytest

import harts
from harts.errors import OutputPathError, UserError


def test_a_quoted_multiline_message_is_one_line():
    err = UserError("x.pt: not loadable (Weights only load failed.\n  Re-running `torch.load` ...\n\nCheck)")
    assert str(err) == "x.pt: not loadable (Weights only load failed. Re-running `torch.load` ... Check)"
    assert str(OutputPathError("a")) == "a"
    # DCP gathers the exceptions of every rank through pickle
    assert str(pickle.loads(pickle.dumps(err))) == str(err)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: harts.HybridConfig(hidden_size=-1), "HybridConfig.hidden_size must be a positive integer"),
        (lambda: harts.HybridConfig(layer_pattern="KXM"), "layer_pattern 'KXM': letters must be from"),
        (lambda: harts.HybridConfig(num_attention_heads=6, num_key_value_heads=4), "must be a multiple of"),
        (lambda: harts.HybridConfig(chunk_size=12), "chunk_size must be a power of two"),
        (lambda: harts.HybridConfig(dtype="float16"), "dtype must be float32, float64 or bfloat16"),
        (lambda: harts.HybridConfig.preset("nope"), "unknown model preset 'nope'"),
    ],
)
def test_hybrid_config_validation_is_a_user_error(make, match):
    with pytest.raises(UserError, match=match) as err:
        make()
    assert isinstance(err.value, ValueError) and "\n" not in str(err.value)
