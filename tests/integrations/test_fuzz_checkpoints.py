"""Fuzzing what users hand over besides batch files: a checkpoint's config.json and safetensors
header, and the trainer engine's flat trajectories.

Every outcome is a model / result or a ``harts.UserError`` naming the item; never another
exception. Checkpoint mutations: dropped fields, values of other types (numbers, NaN, huge and
negative ints, strings, lists, objects, nulls), unknown model types, truncated or random JSON; a
safetensors header with a wrong length prefix, garbled JSON, shapes and dtypes that disagree with
the config, offsets past the file, a truncated file. The default budget is small; ``-m slow`` runs
a larger one.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from harts import UserError

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

FAST = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
SLOW = settings(max_examples=800, deadline=None, suppress_health_check=list(HealthCheck))

odd_values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**65), max_value=2**65),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.lists(st.integers(-3, 300), max_size=4),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.integrations._hf import make_hf_model

    path = tmp_path_factory.mktemp("fuzz-ckpt") / "qwen3_next"
    make_hf_model("qwen3_next").save_pretrained(path)
    return path


def _load(path: Path) -> None:
    from harts.integrations.hf import inspect_checkpoint
    from harts.integrations.loading import load_model

    for fn in (lambda: inspect_checkpoint(str(path)), lambda: load_model(str(path))):
        try:
            fn()
        except UserError as err:
            assert str(err).strip() and "\n" not in str(err).strip(), str(err)


def _copy(checkpoint: Path, tmp: Path) -> Path:
    out = tmp / "c"
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(checkpoint, out)
    return out


@st.composite
def config_mutations(draw: Any, config: dict) -> bytes:
    cfg = json.loads(json.dumps(config))
    kind = draw(st.sampled_from(["drop", "retype", "model_type", "truncate", "random"]))
    keys = sorted(cfg)
    if kind == "drop":
        for k in draw(st.lists(st.sampled_from(keys), min_size=1, max_size=3)):
            cfg.pop(k, None)
    elif kind == "retype":
        for k in draw(st.lists(st.sampled_from(keys), min_size=1, max_size=3)):
            cfg[k] = draw(odd_values)
    elif kind == "model_type":
        cfg["model_type"] = draw(st.one_of(st.text(max_size=12), st.sampled_from(["qwen3_5", "kimi_linear", "llama"])))
    text = json.dumps(cfg, allow_nan=True).encode()
    if kind == "truncate":
        text = text[: draw(st.integers(0, max(len(text) - 1, 0)))]
    if kind == "random":
        text = draw(st.binary(max_size=200))
    return text


def _header(file: Path) -> tuple[dict, bytes]:
    raw = file.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


@st.composite
def header_mutations(draw: Any, header: dict, data: bytes) -> bytes:
    h = json.loads(json.dumps(header))
    names = sorted(k for k in h if k != "__metadata__")
    kind = draw(st.sampled_from(["shape", "dtype", "offsets", "drop", "length", "garble", "truncate"]))
    name = draw(st.sampled_from(names))
    if kind == "shape":
        h[name]["shape"] = draw(st.lists(st.integers(0, 70), max_size=3))
    elif kind == "dtype":
        h[name]["dtype"] = draw(st.sampled_from(["F16", "BF16", "I64", "U8", "F64", "XX"]))
    elif kind == "offsets":
        h[name]["data_offsets"] = draw(st.lists(st.integers(-5, 10**9), min_size=0, max_size=3))
    elif kind == "drop":
        h.pop(name)
    body = json.dumps(h).encode()
    prefix = struct.pack("<Q", len(body))
    if kind == "length":
        prefix = struct.pack("<Q", draw(st.integers(0, 2**40)))
    if kind == "garble":
        i = draw(st.integers(0, len(body) - 1))
        body = body[:i] + draw(st.binary(min_size=1, max_size=8)) + body[i + 1 :]
        prefix = struct.pack("<Q", len(body))
    out = prefix + body + data
    if kind == "truncate":
        out = out[: draw(st.integers(0, len(out) - 1))]
    return out


def _fuzz_config(checkpoint: Path, tmp: Path, data: Any) -> None:
    config = json.loads((checkpoint / "config.json").read_text())
    path = _copy(checkpoint, tmp)
    (path / "config.json").write_bytes(data.draw(config_mutations(config)))
    _load(path)


def _fuzz_header(checkpoint: Path, tmp: Path, data: Any) -> None:
    header, payload = _header(checkpoint / "model.safetensors")
    path = _copy(checkpoint, tmp)
    (path / "model.safetensors").write_bytes(data.draw(header_mutations(header, payload)))
    _load(path)


def test_base_checkpoint_loads(checkpoint: Path) -> None:
    _load(checkpoint)


@FAST
@given(data=st.data())
def test_fuzz_config_json(checkpoint: Path, tmp_path: Path, data: Any) -> None:
    _fuzz_config(checkpoint, tmp_path, data)


@FAST
@given(data=st.data())
def test_fuzz_safetensors_header(checkpoint: Path, tmp_path: Path, data: Any) -> None:
    _fuzz_header(checkpoint, tmp_path, data)


# ---------------------------------------------------------------- the engine's trajectories
token_lists = st.one_of(
    st.lists(st.integers(-2, 70), max_size=12),
    st.lists(st.one_of(st.integers(0, 63), st.floats(), st.text(max_size=2), st.none()), max_size=6),
    st.text(max_size=5),
    st.none(),
    st.integers(),
)
per_target = st.one_of(
    st.lists(st.floats(allow_nan=True, allow_infinity=True), max_size=12), st.text(max_size=3), st.none(), st.integers()
)
trajectory = st.one_of(
    st.fixed_dictionaries(
        {"tokens": token_lists},
        optional={"weights": per_target, "advantages": per_target, "logprobs": per_target, "extra": st.integers()},
    ),
    st.integers(),
    st.text(max_size=3),
    st.lists(st.integers(0, 63), max_size=4),
)


@pytest.fixture(scope="module")
def engine() -> Any:
    from harts.trainer.engine import Engine

    return Engine.from_spec("tiny", dtype="float64", capacity=64)


@FAST
@given(
    trajs=st.one_of(st.lists(trajectory, max_size=4), st.none(), st.text(max_size=4), st.integers()),
    loss=st.sampled_from(["cross_entropy", "importance_sampling", "ppo", "cispo", "dpo", 3]),
)
# per-target fields that numpy reads as numbers or fails on: strings, a list of strings, ragged lists
@example(trajs=[{"tokens": [0], "weights": ""}], loss="cross_entropy")
@example(trajs=[{"tokens": [0, 1, 2], "advantages": ["1", "2"]}], loss="importance_sampling")
@example(trajs=[{"tokens": [0, 1, 2], "logprobs": [[1.0], [2.0, 3.0]]}], loss="ppo")
def test_fuzz_engine_trajectories(engine: Any, trajs: Any, loss: Any) -> None:
    try:
        out = engine.forward_backward(trajs, loss)
    except UserError as err:
        assert str(err).strip() and "\n" not in str(err).strip(), str(err)
    else:
        assert len(out.logprobs) == len(trajs)
        assert all(np.isfinite(lp).all() for lp in out.logprobs)
    finally:
        engine.optimizer.zero_grad(set_to_none=True)


@pytest.mark.slow
@SLOW
@given(data=st.data())
def test_fuzz_checkpoints_large_budget(checkpoint: Path, tmp_path: Path, data: Any) -> None:
    _fuzz_config(checkpoint, tmp_path, data)
    _fuzz_header(checkpoint, tmp_path, data)
