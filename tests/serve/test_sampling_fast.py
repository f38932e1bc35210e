"""harts serve's sampling through the batched decoder (the CUDA path, forced on the CPU here)
answers as the reference decoder does: the same tokens, log-probs to 1e-10 in float64 (the
same float64 terms summed in another order), top-k log-probs, named prompt targets' log-probs,
alternative prompt tokens and stop reasons, in slices."""

from __future__ import annotations

import numpy as np
import pytest
from google.protobuf.json_format import MessageToDict

import harts.serve.sampling as sampling
from harts.rollout.sampler import SamplingConfig
from harts.serve.sampling import SampleJob, SampleRun
from harts.trainer.engine import Engine
from tests.serve.test_sampling_slices import finish

CONFIG = SamplingConfig(max_tokens=10, top_k=20, temperature=0.9, stop_tokens=(3,), topk_logprobs=4)
TARGETS = np.array([[(5 * i) % 64, -1 if i % 3 else i] for i in range(12)], dtype=np.int64)
JOB = SampleJob(
    prompt=list(range(1, 14)),
    num_samples=4,
    config=CONFIG,
    seed=5,
    topk_prompt_logprobs=3,
    prompt_targets=TARGETS,
    prompt_alt_tokens_k=3,
)


def _split(value: object, path: str = "") -> tuple[dict[str, object], dict[str, float]]:
    """A response as plain values by path: (everything but the floats, the floats)."""
    exact: dict[str, object] = {}
    floats: dict[str, float] = {}
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        (floats if isinstance(value, float) else exact)[path] = value
        return exact, floats
    for key, item in items:
        e, f = _split(item, f"{path}/{key}")
        exact.update(e)
        floats.update(f)
    return exact, floats


def test_fast_path_answers_as_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = Engine.from_spec("tiny", dtype="float64", seed=0, capacity=128)
    ref, _ = finish(SampleRun(JOB, lambda: (engine, None), slice_seconds=1e9))
    monkeypatch.setattr(sampling, "fast_decoding_applies", lambda model: True)
    fast, slices = finish(SampleRun(JOB, lambda: (engine, None), slice_seconds=0.0))
    assert slices > 1
    (ref_exact, ref_floats), (fast_exact, fast_floats) = (_split(MessageToDict(r)) for r in (ref, fast))
    assert fast_exact == ref_exact and fast_floats.keys() == ref_floats.keys()
    assert len({t for s in ref.sequences for t in s.tokens}) > 1 and len(ref.topk_prompt_logprobs.ListFields()) > 0
    assert ref.HasField("target_prompt_logprobs") and ref.HasField("prompt_alt_tokens")
    keys = sorted(ref_floats)
    np.testing.assert_allclose([fast_floats[k] for k in keys], [ref_floats[k] for k in keys], rtol=0, atol=1e-10)
