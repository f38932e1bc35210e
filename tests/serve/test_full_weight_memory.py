"""``harts serve``: a training run without LoRA (every weight trained, its gradients and AdamW
state beside the engines already held) is checked against the device's memory when it is asked
for; one that does not fit is a 4xx naming ``lora_config``, and the server stays up."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from harts.errors import UserError  # noqa: E402
from harts.serve.app import build_app  # noqa: E402
from harts.serve.config import ServeConfig  # noqa: E402
from harts.serve.server import make_service  # noqa: E402

KEY = "tml-memory"


def _create(client: TestClient, lora: dict | None) -> tuple[int, str]:
    sid = client.post("/api/v1/create_session", json={"tags": [], "user_metadata": None, "sdk_version": "t"})
    assert sid.status_code == 200
    body = {"session_id": sid.json()["session_id"], "model_seq_id": 0, "base_model": "tiny", "lora_config": lora}
    r = client.post("/api/v1/create_model", json=body)
    return r.status_code, r.text


def test_full_weight_run_that_does_not_fit_is_refused_by_field(tmp_path: Path) -> None:
    calls: list[int] = []

    def too_big() -> None:
        calls.append(1)
        raise UserError("not enough memory on cpu: one step is estimated at 9.0 GiB, 1.0 GiB available")

    config = ServeConfig(model="tiny", api_key=KEY, state_dir=tmp_path, poll_seconds=0.2, max_models=2, capacity=512)
    with TestClient(build_app(make_service(config, check_full_weights=too_big)), raise_server_exceptions=False) as c:
        c.headers["X-API-Key"] = KEY
        status, text = _create(c, None)
        assert 400 <= status < 500 and "lora_config" in text and "9.0 GiB" in text, (status, text)
        assert calls == [1]
        status, _ = _create(c, {"rank": 4, "seed": 0, "train_mlp": True, "train_attn": True, "train_unembed": False})
        assert status == 200 and calls == [1]  # a LoRA run is counted at start, not here
        assert c.get("/api/v1/healthz").status_code == 200


def test_full_weight_run_that_fits_is_created(tmp_path: Path) -> None:
    config = ServeConfig(model="tiny", api_key=KEY, state_dir=tmp_path, poll_seconds=0.2, max_models=2, capacity=512)
    with TestClient(build_app(make_service(config, check_full_weights=lambda: None))) as c:
        c.headers["X-API-Key"] = KEY
        status, text = _create(c, None)
        assert status == 200, text
