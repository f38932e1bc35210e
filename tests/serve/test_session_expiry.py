"""``harts serve``: a client that goes away without ``close()`` (a crash, a lost network) stops
heartbeating; after ``--session-timeout`` seconds its session is finished as ``close()`` would:
its runs are released (their memory and ``--max-models`` slots free again, their checkpoints
kept), its later requests are refused, and a session that keeps heartbeating is left alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from harts.errors import UserError  # noqa: E402
from harts.serve.app import build_app  # noqa: E402
from harts.serve.config import ServeConfig  # noqa: E402
from harts.serve.server import make_service  # noqa: E402

KEY = "tml-expiry-0123456789abcdef"
LORA = {"rank": 2, "seed": 0, "train_mlp": True, "train_attn": True, "train_unembed": False}


def _session(c: TestClient) -> str:
    r = c.post("/api/v1/create_session", json={"tags": [], "user_metadata": None, "sdk_version": "t"})
    assert r.status_code == 200, r.text
    return str(r.json()["session_id"])


def _run(c: TestClient, sid: str) -> str:
    """A LoRA run of session ``sid``, created (its creation job done); its model id."""
    r = c.post(
        "/api/v1/create_model", json={"session_id": sid, "model_seq_id": 0, "base_model": "tiny", "lora_config": LORA}
    )
    assert r.status_code == 200, r.text
    fut = json.loads(r.text)
    while True:
        body = c.post("/api/v1/retrieve_future", json={"request_id": fut["request_id"]}).json()
        if body.get("type") != "try_again":
            assert body["type"] == "create_model", body
            return str(fut["model_id"])


def _heartbeat(c: TestClient, sid: str) -> int:
    return c.post("/api/v1/session_heartbeat", json={"session_id": sid}).status_code


def test_a_silent_session_expires_and_frees_its_run(tmp_path: Path) -> None:
    config = ServeConfig(model="tiny", api_key=KEY, state_dir=tmp_path, poll_seconds=0.2, max_models=1, capacity=256)
    service = make_service(config)
    with TestClient(build_app(service), raise_server_exceptions=False) as c:
        c.headers["X-API-Key"] = KEY
        gone, alive = _session(c), _session(c)
        model_id = _run(c, gone)
        # the one --max-models slot is taken: the live session cannot create a run yet
        r = c.post(
            "/api/v1/create_model",
            json={"session_id": alive, "model_seq_id": 0, "base_model": "tiny", "lora_config": LORA},
        )
        assert r.status_code == 400 and "--max-models 1" in r.text, r.text
        # within the timeout nothing expires
        assert service.expire_idle_sessions() == []
        # the crashed client was last heard of two timeouts ago; the live one heartbeats on time
        service._sessions[gone].last_seen -= 2 * config.session_timeout
        assert _heartbeat(c, alive) == 200
        assert service.expire_idle_sessions() == [gone]
        # the expired session is finished: its heartbeat and its run's requests are refused
        assert _heartbeat(c, gone) == 410
        assert c.post("/api/v1/get_info", json={"model_id": model_id}).status_code == 404
        assert _heartbeat(c, alive) == 200
        # its slot is free again: the live session's run is created
        assert _run(c, alive)
        assert c.get("/api/v1/healthz").status_code == 200


def test_session_timeout_is_checked() -> None:
    for bad in (0.0, 29.0, float("nan")):
        with pytest.raises(UserError, match="--session-timeout"):
            ServeConfig(model="tiny", api_key=KEY, session_timeout=bad)
