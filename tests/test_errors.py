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


@pytest.mark.parametrize("text", ['{"model_type": "qwen3_next", ', "[1, 2]", "\udcff"], ids=["cut", "list", "bytes"])
@pytest.mark.parametrize("command", ["train", "compare"])
def test_a_broken_config_json_in_model_names_the_file(capsys, tmp_path, command, text):
    from harts.cli import main

    (tmp_path / "config.json").write_bytes(text.encode("utf-8", "surrogateescape"))
    (tmp_path / "model.safetensors").write_bytes(b"")
    steps = ["--steps", "1"] if command == "train" else []
    code = main([command, "--model", str(tmp_path), "--workload", "tiny", *steps])
    _, err = capsys.readouterr()
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"harts: error: {tmp_path / 'config.json'}: not ")
