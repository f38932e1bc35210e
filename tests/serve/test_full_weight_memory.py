"""``harts serve``: each new training run is checked against the device's memory. A run without
LoRA (every weight trained, its gradients and AdamW state beside the engines already held) is
checked when it is asked for: one that does not fit is a 4xx naming ``lora_config``. A LoRA run's
adapters are checked in its creation job (no step runs beside it then): one that does not fit
fails as a user error naming ``lora_config``, is not registered, and the server stays up."""

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

KEY = "tml-memory-0123456789abcdef"


def _create(client: TestClient, lora: dict | None) -> tuple[int, str]:
    sid = client.post("/api/v1/create_session", json={"tags": [], "user_metadata": None, "sdk_version": "t"})
    assert sid.status_code == 200
    body = {"session_id": sid.json()["session_id"], "model_seq_id": 0, "base_model": "tiny", "lora_config": lora}
    r = client.post("/api/v1/create_model", json=body)
    return r.status_code, r.text


def _result(client: TestClient, request_id: str) -> dict:
    while True:
        r = client.post("/api/v1/retrieve_future", json={"request_id": request_id})
        assert r.status_code == 200, r.text
        body = r.json()
        if body.get("type") != "try_again":
            return body


def test_full_weight_run_that_does_not_fit_is_refused_by_field(tmp_path: Path) -> None:
    calls: list[object] = []

    def too_big(lora: object) -> None:
        calls.append(lora)
        if lora is None:
            raise UserError("not enough memory on cpu: one step is estimated at 9.0 GiB, 1.0 GiB available")

    config = ServeConfig(model="tiny", api_key=KEY, state_dir=tmp_path, poll_seconds=0.2, max_models=2, capacity=512)
    with TestClient(build_app(make_service(config, check_run_memory=too_big)), raise_server_exceptions=False) as c:
        c.headers["X-API-Key"] = KEY
        status, text = _create(c, None)
        assert 400 <= status < 500 and "lora_config" in text and "9.0 GiB" in text, (status, text)
        assert calls == [None]
        status, text = _create(c, {"rank": 4, "seed": 0, "train_mlp": True, "train_attn": True, "train_unembed": False})
        assert status == 200
        assert _result(c, json.loads(text)["request_id"])["type"] == "create_model"
        assert len(calls) == 2 and calls[1].rank == 4  # the LoRA run checked in its job
        assert c.get("/api/v1/healthz").status_code == 200


def test_lora_run_whose_adapters_do_not_fit_fails_by_field(tmp_path: Path) -> None:
    def adapters_too_big(lora: object) -> None:
        raise UserError("not enough memory on cpu for rank-64 adapters: ...; rank 8 fits")

    config = ServeConfig(model="tiny", api_key=KEY, state_dir=tmp_path, poll_seconds=0.2, max_models=2, capacity=512)
    with TestClient(build_app(make_service(config, check_run_memory=adapters_too_big))) as c:
        c.headers["X-API-Key"] = KEY
        status, text = _create(
            c, {"rank": 64, "seed": 0, "train_mlp": True, "train_attn": True, "train_unembed": False}
        )
        assert status == 200, text
        fut = json.loads(text)
        body = _result(c, fut["request_id"])
        assert body.get("category") == "user" and "lora_config: not enough memory" in body["error"], body
        # the run was not registered; the server goes on
        info = c.post("/api/v1/get_info", json={"model_id": fut["model_id"]})
        assert info.status_code == 404, info.text
        assert c.get("/api/v1/healthz").status_code == 200


def test_full_weight_run_that_fits_is_created(tmp_path: Path) -> None:
    config = ServeConfig(model="tiny", api_key=KEY, state_dir=tmp_path, poll_seconds=0.2, max_models=2, capacity=512)
    with TestClient(build_app(make_service(config, check_run_memory=lambda lora: None))) as c:
        c.headers["X-API-Key"] = KEY
        status, text = _create(c, None)
        assert status == 200, text


def test_full_weight_run_from_a_saved_state_is_checked_too(tmp_path: Path) -> None:
    allow = [True]

    def check(lora: object) -> None:
        if lora is None and not allow[0]:
            raise UserError("not enough memory on cpu: one step is estimated at 9.0 GiB, 1.0 GiB available")

    config = ServeConfig(model="tiny", api_key=KEY, state_dir=tmp_path, poll_seconds=0.2, max_models=3, capacity=512)
    with TestClient(build_app(make_service(config, check_run_memory=check)), raise_server_exceptions=False) as c:
        c.headers["X-API-Key"] = KEY
        status, text = _create(c, None)
        assert status == 200, text
        fut = json.loads(text)
        assert _result(c, fut["request_id"])["type"] == "create_model"
        saved = c.post("/api/v1/save_weights", json={"model_id": fut["model_id"], "path": "s1", "seq_id": 1})
        assert saved.status_code == 200, saved.text
        path = _result(c, saved.json()["request_id"])["path"]
        allow[0] = False
        sid = c.post("/api/v1/create_session", json={"tags": [], "user_metadata": None, "sdk_version": "t"})
        body = {"session_id": sid.json()["session_id"], "model_seq_id": 0, "path": path, "optimizer": True}
        r = c.post("/api/v1/load_weights", json=body)
        assert 400 <= r.status_code < 500 and "lora_config" in r.text and "9.0 GiB" in r.text, (r.status_code, r.text)
        assert c.get("/api/v1/healthz").status_code == 200
