"""Fuzzing ``harts serve``'s request bodies: random JSON (and random bytes) to every POST route.

Every answer is a success or a 4xx whose ``detail`` is one line; never a 5xx, never a hang, and
the server answers its health check afterwards. The app runs in process (FastAPI's test client)
over a real ``tiny`` engine factory. The default budget is small; ``-m slow`` runs a larger one.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from harts.serve.app import build_app  # noqa: E402
from harts.serve.config import ServeConfig  # noqa: E402
from harts.serve.server import make_service  # noqa: E402
from tests.serve.test_serve_tiny import POSTS  # noqa: E402

KEY = "tml-fuzz-0123456789abcdef"
POST_JSON = [*POSTS, "telemetry", "client/dynamic_config"]
#: field names the routes read, so that random bodies reach past the first missing field
FIELDS = [
    "session_id", "model_seq_id", "base_model", "lora_config", "rank", "seed", "train_mlp", "train_attn",
    "train_unembed", "model_id", "path", "optimizer", "adam_params", "learning_rate", "beta1", "beta2", "eps",
    "weight_decay", "grad_clip_norm", "forward_backward_input", "data", "loss_fn", "loss_fn_config",
    "model_input", "chunks", "tokens", "loss_fn_inputs", "target_tokens", "weights", "advantages", "logprobs",
    "sampling_params", "max_tokens", "temperature", "num_samples", "prompt", "request_id", "sampling_session_id",
    "seq_id", "tags", "user_metadata", "sdk_version", "type", "name", "ttl_seconds", "base_model_path",
]  # fmt: skip

FAST = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
SLOW = settings(max_examples=1500, deadline=None, suppress_health_check=list(HealthCheck))

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["tiny", "cross_entropy", "ppo", "tinker://x/weights/y", "../../etc", "encoded_text", "tml-x"]),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=5), st.dictionaries(st.sampled_from(FIELDS), inner, max_size=5)),
    max_leaves=20,
)
bodies = st.dictionaries(st.sampled_from(FIELDS), values, max_size=8)


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    state: Path = tmp_path_factory.mktemp("serve-fuzz")
    config = ServeConfig(model="tiny", api_key=KEY, state_dir=state, poll_seconds=0.2, max_models=2, capacity=512)
    with TestClient(build_app(make_service(config)), raise_server_exceptions=False) as c:
        c.headers["X-API-Key"] = KEY
        yield c


def _check(response: Any, route: str) -> None:
    assert response.status_code < 500, (route, response.status_code, response.text[:300])
    if response.status_code >= 400:
        detail = response.json().get("detail")
        assert isinstance(detail, str) and detail and "\n" not in detail, (route, detail)


def _fuzz(client: TestClient, route: str, body: dict[str, Any], raw: bytes) -> None:
    _check(client.post(f"/api/v1/{route}", content=json.dumps(body, allow_nan=True)), route)
    _check(client.post(f"/api/v1/{route}", content=raw), route)
    assert client.get("/api/v1/healthz").status_code == 200


@FAST
@given(route=st.sampled_from(POST_JSON), body=bodies, raw=st.binary(max_size=64))
def test_fuzz_request_bodies(client: TestClient, route: str, body: dict[str, Any], raw: bytes) -> None:
    _fuzz(client, route, body, raw)


@FAST
@given(body=bodies)
def test_fuzz_bodies_inside_a_live_session(client: TestClient, body: dict[str, Any]) -> None:
    """Random fields on top of a real session id, so the routes get past the session lookup."""
    sid = client.post("/api/v1/create_session", json={"tags": [], "user_metadata": None, "sdk_version": "fuzz"})
    assert sid.status_code == 200
    body = {**body, "session_id": sid.json()["session_id"]}
    for route in ("create_model", "create_sampling_session", "asample", "optim_step", "get_info"):
        _check(client.post(f"/api/v1/{route}", content=json.dumps(body, allow_nan=True)), route)


@pytest.mark.slow
@SLOW
@given(route=st.sampled_from(POST_JSON), body=bodies, raw=st.binary(max_size=256))
def test_fuzz_request_bodies_large_budget(client: TestClient, route: str, body: dict[str, Any], raw: bytes) -> None:
    _fuzz(client, route, body, raw)
