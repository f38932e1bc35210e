"""``harts serve`` with several tenants: a key belongs to a tenant, and a tenant sees, trains,
overwrites, samples from, loads from and deletes only its own sessions, runs, sampling clients,
requests and checkpoints. Another tenant's ids answer 404, as unknown ones do, so they do not
leak; listings hold only the tenant's own items; ownership is written into ``run.json`` and
survives a restart. Keys are checked at start-up (one line each), and a server bound to an
address other than loopback says so in its log.

One real server (a subprocess, bound to 0.0.0.0) serves alice and bob from a keys file; alice
trains and saves through the tinker SDK, bob tries everything on her ids.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

tinker = pytest.importorskip("tinker")
pytest.importorskip("fastapi")

from fastapi.testclient import TestClient  # noqa: E402
from tinker import types  # noqa: E402

from harts.cli import main  # noqa: E402
from harts.errors import UserError  # noqa: E402
from harts.serve.app import build_app  # noqa: E402
from harts.serve.config import ServeConfig  # noqa: E402
from harts.serve.server import make_service  # noqa: E402
from tests.serve._server import Server, serving  # noqa: E402

ALICE = "tml-alice-0123456789abcdef"
BOB = "tml-bob-fedcba9876543210"
KEYS_TOML = f'[tenants.alice]\nkey = "{ALICE}"\n\n[tenants.bob]\nkey = "{BOB}"\n'
TENANTS = {"alice": ALICE, "bob": BOB}
LORA = {"rank": 4, "seed": 0, "train_attn": True, "train_mlp": True, "train_unembed": False}
ADAM = types.AdamParams(learning_rate=1e-2)
SAMPLE = {"num_samples": 1, "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]}}
SAMPLE["sampling_params"] = {"max_tokens": 2, "seed": 0}
SESSION = {"tags": [], "user_metadata": None, "sdk_version": "t"}


def _datum() -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3, 4]),
        loss_fn_inputs={"target_tokens": [2, 3, 4, 5], "weights": [0.0, 1.0, 1.0, 1.0]},
    )


def _fb_body(model_id: str, seq_id: int) -> bytes:
    """A ``forward_backward`` request as the SDK sends it (protobuf)."""
    from tinker.proto.request_conv import forward_backward_request_to_proto

    fb = types.ForwardBackwardInput(data=[_datum()], loss_fn="cross_entropy")
    request = types.ForwardBackwardRequest(forward_backward_input=fb, model_id=model_id, seq_id=seq_id)
    return bytes(forward_backward_request_to_proto(request).SerializeToString())


@dataclass
class Alice:
    """What alice made: an SDK training run with a saved state and a sampler export, and a raw
    session with a sampling client over that export and a second run (its creation's request id)."""

    training: Any
    model_id: str
    state_path: str
    sampler_path: str
    session_id: str
    sampler_id: str
    raw_model_id: str
    request_id: str


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    workdir = tmp_path_factory.mktemp("serve tenants")
    keys = workdir / "keys.toml"
    keys.write_text(KEYS_TOML)
    extra = ("--capacity", "256", "--host", "0.0.0.0", "--max-models", "8")
    with serving("tiny", workdir, *extra, keys_file=keys, key=ALICE) as srv:
        yield srv


def _post(server: Server, key: str, path: str, body: dict[str, Any]) -> Any:
    return server.post(path, json=body, headers={"X-API-Key": key})


def _ok(response: Any) -> dict[str, Any]:
    assert response.status_code == 200, response.text
    return dict(response.json())


def _result(server: Server, key: str, request_id: str) -> dict[str, Any] | bytes:
    """The outcome of a request: its JSON, or the bytes of a protobuf result."""
    while True:
        r = _post(server, key, "retrieve_future", {"request_id": request_id})
        assert r.status_code == 200, r.text
        if not r.headers["content-type"].startswith("application/json"):
            return bytes(r.content)
        body = dict(r.json())
        if body.get("type") != "try_again":
            return body


@pytest.fixture(scope="module")
def alice(server: Server) -> Alice:
    service = tinker.ServiceClient(base_url=server.url, api_key=ALICE)
    tc = service.create_lora_training_client(base_model="tiny", rank=4, seed=1).result()
    tc.forward_backward([_datum()], "cross_entropy")
    tc.optim_step(ADAM).result()
    state_path = tc.save_state("a-state").result().path
    sampler_path = tc.save_weights_for_sampler("a-snap").result().path
    sid = _ok(_post(server, ALICE, "create_session", SESSION))["session_id"]
    body = {"session_id": sid, "sampling_session_seq_id": 0, "model_path": sampler_path}
    sampler_id = _ok(_post(server, ALICE, "create_sampling_session", body))["sampling_session_id"]
    body = {"session_id": sid, "model_seq_id": 0, "base_model": "tiny", "lora_config": LORA}
    created = _ok(_post(server, ALICE, "create_model", body))
    return Alice(tc, tc.model_id, state_path, sampler_path, sid, sampler_id, created["model_id"], created["request_id"])


def _tree(root: Path) -> str:
    """A digest of every file under ``root``: names, sizes and contents."""
    h = hashlib.sha256()
    for f in sorted(p for p in root.rglob("*") if p.is_file()):
        h.update(f"{f.relative_to(root)}:{f.stat().st_size}".encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def _attacks(a: Alice, bob_session: str) -> list[tuple[str, str, dict[str, Any] | bytes | None]]:
    """(method, route, body) of every request bob could make on alice's ids."""
    run, raw, sampler = a.model_id, a.raw_model_id, a.sampler_path
    return [
        ("GET", f"sessions/{a.session_id}", None),
        ("POST", "session_heartbeat", {"session_id": a.session_id}),
        ("POST", f"sessions/{a.session_id}/finish", {}),
        ("POST", "create_model", {"session_id": a.session_id, "model_seq_id": 5, "base_model": "tiny"}),
        ("POST", "create_sampling_session", {"session_id": a.session_id, "sampling_session_seq_id": 5}),
        ("POST", "retrieve_future", {"request_id": a.request_id}),
        ("POST", "cancel_future", {"request_id": a.request_id}),
        ("POST", "get_info", {"model_id": run}),
        ("POST", "forward_backward", _fb_body(raw, 1)),
        ("POST", "optim_step", {"model_id": run, "seq_id": 99, "adam_params": {"learning_rate": 0.01}}),
        ("POST", "save_weights", {"model_id": run, "seq_id": 99, "path": "a-state", "overwrite": True}),
        ("POST", "save_weights_for_sampler", {"model_id": run, "seq_id": 99, "path": "a-snap"}),
        ("POST", "load_weights", {"model_id": run, "seq_id": 99, "path": a.state_path, "optimizer": True}),
        (
            "POST",
            "load_weights",
            {"session_id": bob_session, "model_seq_id": 0, "path": a.state_path, "optimizer": False},
        ),
        (
            "POST",
            "create_sampling_session",
            {"session_id": bob_session, "sampling_session_seq_id": 0, "model_path": sampler},
        ),
        ("POST", "asample", {**SAMPLE, "sampling_session_id": a.sampler_id}),
        ("POST", "asample", {**SAMPLE, "model_path": a.sampler_path}),
        ("GET", f"samplers/{a.sampler_id}", None),
        ("GET", f"training_runs/{run}", None),
        ("GET", f"training_runs/{run}/checkpoints", None),
        ("DELETE", f"training_runs/{run}/checkpoints/weights/a-state", None),
        ("DELETE", f"training_runs/{run}/checkpoints/sampler_weights/a-snap", None),
        ("POST", "weights_info", {"tinker_path": a.state_path}),
        ("POST", "save_weights_external", {"model_id": run, "seq_id": 99, "path": "a-export"}),
        ("POST", f"training_runs/{run}/checkpoints/weights/a-state/publish", None),
        ("DELETE", f"training_runs/{run}/checkpoints/weights/a-state/publish", None),
        ("PUT", f"training_runs/{run}/checkpoints/weights/a-state/ttl", {"ttl_seconds": 7200}),
        ("GET", f"training_runs/{run}/checkpoints/weights/a-state/archive", None),
        ("GET", f"training_runs/{run}/checkpoints/external_weights/a-export/external_weights_urls", None),
    ]


def _send(server: Server, key: str, method: str, route: str, body: dict[str, Any] | bytes | None) -> Any:
    import httpx

    url, headers = f"{server.url}/api/v1/{route}", {"X-API-Key": key}
    if isinstance(body, bytes):
        headers["Content-Type"] = "application/x-protobuf"
        return httpx.request(method, url, content=body, headers=headers, timeout=60)
    return httpx.request(method, url, json=body, headers=headers, timeout=60)


def test_another_tenant_gets_404_for_everything_of_alices(server: Server, alice: Alice) -> None:
    before = _tree(server.state_dir / "runs" / alice.model_id)
    bob_session = _ok(_post(server, BOB, "create_session", SESSION))["session_id"]
    for method, route, body in _attacks(alice, bob_session):
        r = _send(server, BOB, method, route, body)
        assert r.status_code == 404, (method, route, r.status_code, r.text)
    # the SDK sees the same: nothing of alice's exists for bob
    bob = tinker.ServiceClient(base_url=server.url, api_key=BOB)
    with pytest.raises(tinker.NotFoundError):
        bob.create_training_client_from_state(alice.state_path).result()
    rest = tinker.RestClient(base_url=server.url, api_key=BOB)
    with pytest.raises(tinker.NotFoundError):
        rest.get_training_run(alice.model_id).result()
    assert alice.model_id not in [r.training_run_id for r in rest.list_training_runs(limit=100).result().training_runs]
    assert not [c for c in rest.list_user_checkpoints().result().checkpoints if alice.model_id in c.tinker_path]
    sessions = _ok(server.get("sessions", key=BOB))["sessions"]
    assert bob_session in sessions and alice.session_id not in sessions
    # alice's files are as she left them, and everything of hers still works for her
    assert _tree(server.state_dir / "runs" / alice.model_id) == before
    assert _result(server, ALICE, alice.request_id) == {"model_id": alice.raw_model_id, "type": "create_model"}
    assert _ok(_post(server, ALICE, "session_heartbeat", {"session_id": alice.session_id})) == {
        "type": "session_heartbeat"
    }
    sample = _ok(_post(server, ALICE, "asample", {**SAMPLE, "sampling_session_id": alice.sampler_id}))
    assert isinstance(_result(server, ALICE, sample["request_id"]), bytes)  # a SampleResponse
    alice.training.forward_backward([_datum()], "cross_entropy")
    assert alice.training.optim_step(ADAM).result().metrics["grad_norm"] > 0
    mine = tinker.RestClient(base_url=server.url, api_key=ALICE).list_checkpoints(alice.model_id).result()
    assert {c.checkpoint_id for c in mine.checkpoints} == {"weights/a-state", "sampler_weights/a-snap"}
    assert alice.session_id in _ok(server.get("sessions", key=ALICE))["sessions"]


def test_a_malformed_request_on_anothers_run_does_not_use_its_sequence_number(server: Server, alice: Alice) -> None:
    """A refused request frees its sequence number so the run's next requests go on; one that
    names another tenant's run must not, or a tenant could stall another's training."""
    _result(server, ALICE, alice.request_id)
    bad = {"model_id": alice.raw_model_id, "seq_id": 1, "adam_params": {"learning_rate": "x"}}
    r = _post(server, BOB, "optim_step", bad)
    assert r.status_code in (400, 404), r.text
    # nor a call the server does not serve
    r = _post(server, BOB, "a_call_of_a_newer_sdk", {"model_id": alice.raw_model_id, "seq_id": 1})
    assert r.status_code == 404, r.text
    fb = _ok(_send(server, ALICE, "POST", "forward_backward", _fb_body(alice.raw_model_id, 1)))
    assert isinstance(_result(server, ALICE, fb["request_id"]), bytes)  # a ForwardBackwardOutput, not an error


def test_the_server_warns_when_bound_beyond_loopback(server: Server) -> None:
    from harts.serve.server import exposure_warning

    assert "0.0.0.0 is not a loopback address" in server.log_text()
    assert exposure_warning("127.0.0.1") is None and exposure_warning("localhost") is None
    assert exposure_warning("0.0.0.0") is not None


def _restarted(state_dir: Path, **keys: Any) -> TestClient:
    config = ServeConfig(model="tiny", state_dir=state_dir, poll_seconds=0.2, capacity=256, **keys)
    return TestClient(build_app(make_service(config)))


def test_ownership_survives_a_restart(server: Server, alice: Alice) -> None:
    assert '"tenant": "alice"' in (server.state_dir / "runs" / alice.model_id / "run.json").read_text()
    with _restarted(server.state_dir, tenants=dict(TENANTS)) as c:
        for key, status in ((ALICE, 200), (BOB, 404)):
            c.headers["X-API-Key"] = key
            assert c.get(f"/api/v1/training_runs/{alice.model_id}").status_code == status
            assert c.get(f"/api/v1/training_runs/{alice.model_id}/checkpoints").status_code == status
            assert c.post("/api/v1/weights_info", json={"tinker_path": alice.state_path}).status_code == status
            runs = [r["training_run_id"] for r in c.get("/api/v1/training_runs?limit=100").json()["training_runs"]]
            assert (alice.model_id in runs) == (key == ALICE)
        c.headers["X-API-Key"] = BOB
        assert c.delete(f"/api/v1/training_runs/{alice.model_id}/checkpoints/weights/a-state").status_code == 404
    assert (server.state_dir / "runs" / alice.model_id / "weights" / "a-state").is_dir()


def test_runs_without_a_tenant_belong_to_the_api_key_tenant_only(tmp_path: Path) -> None:
    """A run written by a server that did not record tenants is the one tenant's under
    ``--api-key``, and nobody's under a keys file."""
    run = tmp_path / "runs" / "old:train:0"
    (run / "weights" / "s1").mkdir(parents=True)
    record = '{"model_id": "old:train:0", "session_id": "old", "base_model": "tiny", "lora": null,'
    (run / "run.json").write_text(record + ' "created": "2020-01-01T00:00:00+00:00", "user_metadata": null}')
    with _restarted(tmp_path, api_key=ALICE) as c:
        c.headers["X-API-Key"] = ALICE
        assert c.get("/api/v1/training_runs/old:train:0").status_code == 200
        assert [x["checkpoint_id"] for x in c.get("/api/v1/checkpoints").json()["checkpoints"]] == ["weights/s1"]
    with _restarted(tmp_path, tenants=dict(TENANTS)) as c:
        for key in (ALICE, BOB):
            c.headers["X-API-Key"] = key
            assert c.get("/api/v1/training_runs/old:train:0").status_code == 404
            assert c.get("/api/v1/checkpoints").json()["checkpoints"] == []


# ---------------------------------------------------------------------------- keys at start-up


def _serve(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, *argv: str) -> tuple[int, str, list]:
    """``harts serve ARGV`` in-process with the server itself replaced: (exit code, the error
    line or "", the configs it would have served)."""
    started: list[ServeConfig] = []
    monkeypatch.setattr("harts.serve.server.serve", lambda config, **kw: started.append(config))
    monkeypatch.delenv("HARTS_SERVE_API_KEY", raising=False)
    code = main(["serve", "--model", "tiny", "--port", "1", *argv])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("harts: error:")]
    assert len(lines) == (code != 0) and len(err.strip().splitlines()) == len(lines), err
    return code, (lines or [""])[0], started


@pytest.mark.parametrize(
    ("text", "needles"),
    [
        (None, ["keys.toml", "cannot read"]),
        ("[tenants.alice\nkey = 1", ["keys.toml", "not valid TOML"]),
        ("[tenants.alice]\nkey = 5\n", ["tenant 'alice'", "key must be a string"]),
        ('[tenants]\nalice = "tml-0123456789abcdef0"\n', ["tenants.alice must be a table"]),
        ('[other]\nx = "y"\n', ["unknown top-level entry 'other'"]),
        ("", ["no tenants"]),
        (
            f'[tenants.alice]\nkey = "{ALICE}"\n[tenants.bob]\nkey = "{ALICE}"\n',
            ["tenant 'bob'", "same key", "'alice'"],
        ),
        (f'[tenants.alice]\nkey = "{ALICE}"\n[tenants.bob]\nkey = "tml-"\n', ["tenant 'bob'", "0 characters"]),
        (f'[tenants.alice]\nkey = "{ALICE}"\n[tenants.bob]\nkey = "tml-short"\n', ["tenant 'bob'", "at least 16"]),
        ('[tenants.alice]\nkey = "sk-0123456789abcdef0123"\n', ["tenant 'alice'", "must start with 'tml-'"]),
        ('[tenants.alice]\nkey = "tml-0123456789abcdef0123"\nkye = "x"\n', ["tenant 'alice'", "unknown field 'kye'"]),
        ('[tenants."a b"]\nkey = "tml-0123456789abcdef0123"\n', ["tenant 'a b'", "tenant name"]),
    ],
)
def test_a_bad_keys_file_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, text: str | None, needles: list
) -> None:
    path = tmp_path / "keys.toml"
    if text is not None:
        path.write_text(text)
    code, line, started = _serve(capsys, monkeypatch, "--keys-file", str(path))
    assert code == 2 and not started, line
    for needle in needles:
        assert needle in line, line


def test_a_keys_file_serves_its_tenants(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "keys.toml"
    path.write_text(KEYS_TOML)
    code, line, started = _serve(capsys, monkeypatch, "--keys-file", str(path))
    assert code == 0 and started[0].keys == TENANTS, line
    code, line, _ = _serve(capsys, monkeypatch, "--keys-file", str(path), "--api-key", ALICE)
    assert code == 2 and "not both" in line, line


@pytest.mark.parametrize("key", ["tml-", "tml-local", "tml-0123456789abcde", "tml-0123456789 abcdef0"])
def test_an_api_key_without_a_secret_is_refused(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, key: str
) -> None:
    code, line, started = _serve(capsys, monkeypatch, "--api-key", key)
    assert code == 2 and not started and line.startswith("harts: error: --api-key: the key"), line
    with pytest.raises(UserError, match="--api-key"):
        ServeConfig(model="tiny", api_key=key)
    code, line, started = _serve(capsys, monkeypatch, "--api-key", "tml-0123456789abcdef")
    assert code == 0 and started[0].keys == {"default": "tml-0123456789abcdef"}, line
