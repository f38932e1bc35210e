"""``harts serve --max-models`` counts the runs of live sessions only: a session closed, or silent
for ``--session-timeout`` seconds, holds no slot, whether or not the reaper has been round yet."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from harts.serve.app import build_app  # noqa: E402
from harts.serve.config import ServeConfig  # noqa: E402
from harts.serve.server import make_service  # noqa: E402
from harts.serve.service import Service  # noqa: E402

KEY = "tml-lifecycle-0123456789abcdef"
LORA = {"rank": 2, "seed": 0, "train_mlp": True, "train_attn": True, "train_unembed": False}


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[TestClient, Service]]:
    config = ServeConfig(model="tiny", api_key=KEY, state_dir=tmp_path, poll_seconds=0.2, max_models=1, capacity=256)
    service = make_service(config)
    with TestClient(build_app(service), raise_server_exceptions=False) as c:
        c.headers["X-API-Key"] = KEY
        yield c, service


def _session(c: TestClient) -> str:
    r = c.post("/api/v1/create_session", json={"tags": [], "user_metadata": None, "sdk_version": "t"})
    assert r.status_code == 200, r.text
    return str(r.json()["session_id"])


def _create(c: TestClient, sid: str) -> tuple[int, str]:
    """(status, body) of creating run 0 of session ``sid``, its creation job waited for."""
    body = {"session_id": sid, "model_seq_id": 0, "base_model": "tiny", "lora_config": LORA}
    r = c.post("/api/v1/create_model", json=body)
    if r.status_code != 200:
        return r.status_code, r.text
    fut = json.loads(r.text)
    while True:
        out = c.post("/api/v1/retrieve_future", json={"request_id": fut["request_id"]}).json()
        if out.get("type") != "try_again":
            assert out["type"] == "create_model", out
            return 200, str(fut["model_id"])


def test_a_silent_session_frees_its_slot_before_the_reaper_comes(served: tuple[TestClient, Service]) -> None:
    c, service = served
    gone, alive = _session(c), _session(c)
    status, model_id = _create(c, gone)
    assert status == 200, model_id
    # the client of ``gone`` crashed two timeouts ago; the reaper has not been round since
    service._sessions[gone].last_seen -= 2 * service.config.session_timeout
    status, text = _create(c, alive)
    assert status == 200, text
    assert c.post("/api/v1/get_info", json={"model_id": model_id}).status_code == 404
    assert c.post("/api/v1/session_heartbeat", json={"session_id": gone}).status_code == 410
    assert len(service._runs) == 1


def test_a_live_session_keeps_its_slot_until_it_closes(served: tuple[TestClient, Service]) -> None:
    c, service = served
    first, second = _session(c), _session(c)
    assert _create(c, first)[0] == 200
    status, text = _create(c, second)
    assert status == 400, text
    detail = r"training runs of live sessions \(--max-models 1\).*--session-timeout 120 s"
    assert re.search(detail, text), text
    # close() of the first client (finish_session) frees the slot at once
    assert c.post(f"/api/v1/sessions/{first}/finish").status_code == 200
    assert _create(c, second)[0] == 200
    assert len(service._runs) == 1


def test_an_unserved_call_gives_its_sequence_number_back(served: tuple[TestClient, Service]) -> None:
    """A training client's call to a route the server lacks (a newer SDK's) is a 404 naming it,
    and the number the SDK spent on it is skipped: the client's next request runs."""
    c, _ = served
    status, model_id = _create(c, _session(c))
    assert status == 200, model_id
    r = c.post("/api/v1/save_weights_somewhere_new", json={"model_id": model_id, "seq_id": 1, "path": "x"})
    assert r.status_code == 404 and "POST /api/v1/save_weights_somewhere_new" in r.json()["detail"], r.text
    for method in ("GET", "PUT", "DELETE"):  # a known route with another method, too
        assert c.request(method, "/api/v1/create_model").status_code == 404
    r = c.post("/api/v1/save_weights", json={"model_id": model_id, "seq_id": 2, "path": "after"})
    assert r.status_code == 200, r.text
    request_id = r.json()["request_id"]
    for _ in range(50):  # 10 s of polls; without the skip, request 2 waits for request 1 for good
        out = c.post("/api/v1/retrieve_future", json={"request_id": request_id}).json()
        if out.get("type") != "try_again":
            break
    assert out.get("type") == "save_weights", out
