"""One client of ``harts serve`` cannot stop the others: bodies are parsed off the event loop,
requests past the limits are refused before any work is queued, runs take turns on the worker
(samples in slices), abandoned samples are cancelled, and half-sent requests are closed.

Timing checks compare two durations of the same run (never a wall-clock bound alone): the
server's answers to ``/healthz`` against the time a large request takes, and whether a long
sample is still running when another run's step has finished.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import httpx
import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
pytest.importorskip("fastapi")

from tinker import types  # noqa: E402
from tinker.proto import tinker_public_pb2 as pb  # noqa: E402

from tests.serve._server import Server, service_client, serving  # noqa: E402

CAPACITY = 512
MAX_DATUMS = 20_000
MAX_BATCH_TOKENS = 200_000
MAX_SAMPLE_TOKENS = 20_000
LIMITS = (
    "--capacity",
    str(CAPACITY),
    "--max-models",
    "32",
    "--max-datums",
    str(MAX_DATUMS),
    "--max-batch-tokens",
    str(MAX_BATCH_TOKENS),
    "--max-sample-tokens",
    str(MAX_SAMPLE_TOKENS),
    "--header-timeout",
    "1",
    "--body-timeout",
    "1",
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serving("tiny", tmp_path_factory.mktemp("serve fairness"), *LIMITS) as srv:
        yield srv


@pytest.fixture(scope="module")
def service(server: Server) -> Iterator[tinker.ServiceClient]:
    with service_client(server) as sc:
        yield sc


# ------------------------------------------------------------------ the raw protocol
def session(server: Server) -> str:
    body = {"tags": [], "user_metadata": None, "sdk_version": "test"}
    return str(server.post("create_session", json=body).json()["session_id"])


def result(server: Server, request_id: str) -> object:
    """The outcome of a request: its JSON, or its bytes (a protobuf result)."""
    while True:
        r = server.post("retrieve_future", json={"request_id": request_id})
        assert r.status_code == 200, r.text
        if not r.headers["content-type"].startswith("application/json"):
            return r.content
        body = r.json()
        if body.get("type") != "try_again":
            return body


def new_run(server: Server, sid: str, n: int = 0) -> str:
    create = {"session_id": sid, "model_seq_id": n, "base_model": "tiny", "lora_config": {"rank": 2, "seed": 1}}
    fut = server.post("create_model", json=create).json()
    assert result(server, fut["request_id"]) == {"model_id": fut["model_id"], "type": "create_model"}
    return str(fut["model_id"])


def long_sample(server: Server, sid: str, num_samples: int = 32, max_tokens: int = 450) -> str:
    """Start a sample of the base model that keeps the worker busy for seconds; its request id."""
    create = {"session_id": sid, "sampling_session_seq_id": 0, "base_model": "tiny"}
    sampler = server.post("create_sampling_session", json=create).json()["sampling_session_id"]
    req = {
        "sampling_session_id": sampler,
        "num_samples": num_samples,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3, 4, 5]}]},
        "sampling_params": {"max_tokens": max_tokens, "seed": 0, "stop": []},
    }
    r = server.post("asample", json=req)
    assert r.status_code == 200, r.text
    return str(r.json()["request_id"])


def batch_body(model_id: str, seq_id: int, n: int, tokens: int = 3, last_token: int = 3) -> bytes:
    """A protobuf ``forward`` of ``n`` datums of ``tokens`` input tokens, built as bytes; the last
    datum's last input token is ``last_token``."""
    head = pb.ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, loss_fn="cross_entropy", forward_only=True)
    inputs = np.arange(1, tokens + 1) % 60
    return head.SerializeToString() + _frame(inputs) * (n - 1) + _frame(np.r_[inputs[:-1], last_token])


def _frame(inputs: np.ndarray) -> bytes:
    """One datum as field 3 (data) of a ``ForwardBackwardRequest``, length-delimited."""
    d = pb.Datum()
    d.model_input.add().encoded_text.tokens = inputs.astype(np.int32).tobytes()
    target = d.loss_fn_inputs["target_tokens"]
    target.dense, target.dtype = np.r_[inputs[1:], 0].astype(np.int64).tobytes(), pb.DTYPE_INT64
    target.shape.append(len(inputs))
    raw = d.SerializeToString()
    return bytes([3 << 3 | 2]) + _varint(len(raw)) + raw


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    return bytes([*out, n])


def post_batch(server: Server, body: bytes) -> object:
    return server.post("forward_backward", content=body, headers={"Content-Type": "application/x-protobuf"})


def cancelled(server: Server, request_id: str) -> bool:
    """Cancel a sampling request; True when it had not finished (its outcome says "cancelled")."""
    assert server.post("cancel_future", json={"request_id": request_id}).status_code == 200
    out = result(server, request_id)
    return isinstance(out, dict) and "cancelled" in str(out.get("error"))


# ------------------------------------------------------------------ the tests
def test_healthz_answers_while_a_large_batch_is_checked_and_the_worker_samples(server):
    sid = session(server)
    model_id = new_run(server, sid)
    sample = long_sample(server, sid)
    # every datum is checked before the last one's token outside the vocabulary refuses the batch
    body = batch_body(model_id, 1, MAX_DATUMS, last_token=10**6)
    answered: list[float] = []

    def send() -> None:
        t0 = time.perf_counter()
        r = post_batch(server, body)
        answered.append(time.perf_counter() - t0)
        assert r.status_code == 400 and f"data[{MAX_DATUMS - 1}].model_input" in r.text, r.text  # type: ignore[attr-defined]

    sender = threading.Thread(target=send)
    health = []
    with httpx.Client(headers={"X-API-Key": server.api_key}) as client:  # one connection: no setup per call
        sender.start()
        while sender.is_alive() or len(health) < 20:
            t0 = time.perf_counter()
            assert client.get(f"{server.url}/api/v1/healthz").status_code == 200
            health.append(time.perf_counter() - t0)
            time.sleep(0.01)
    sender.join()
    # checking 20,000 datums takes the server a while; the event loop answered all along
    assert max(health) < 0.25 * answered[0], (max(health), answered[0], sorted(health)[-5:])
    assert cancelled(server, sample)  # the worker was sampling all this time


def test_requests_past_the_limits_are_refused_naming_the_flag_and_the_client_carries_on(server, service):
    sid = session(server)
    model_id = new_run(server, sid)
    r = post_batch(server, batch_body(model_id, 1, MAX_DATUMS + 1))
    assert r.status_code == 400 and "--max-datums" in r.json()["detail"], r.text  # type: ignore[attr-defined]
    assert "forward_backward_input.data" in r.json()["detail"]  # type: ignore[attr-defined]
    r = post_batch(server, batch_body(model_id, 2, 1000, tokens=CAPACITY - 1))
    assert r.status_code == 400 and "--max-batch-tokens" in r.json()["detail"], r.text  # type: ignore[attr-defined]
    # both refusals freed their sequence numbers: the run's next request runs
    ok = post_batch(server, batch_body(model_id, 3, 4)).json()  # type: ignore[attr-defined]
    assert isinstance(result(server, ok["request_id"]), bytes)

    sampler = service.create_sampling_client(base_model="tiny").result()
    prompt = types.ModelInput.from_ints([1, 2, 3, 4, 5])
    with pytest.raises(tinker.APIStatusError) as excinfo:
        sampler.sample(prompt, 64, types.SamplingParams(max_tokens=500, seed=0)).result()
    assert excinfo.value.status_code == 400
    assert "num_samples x sampling_params.max_tokens" in str(excinfo.value), str(excinfo.value)
    assert "--max-sample-tokens" in str(excinfo.value)
    out = sampler.sample(prompt, 2, types.SamplingParams(max_tokens=4, seed=0)).result()
    assert len(out.sequences) == 2


def test_a_long_sample_does_not_hold_back_another_run_s_step(server, service):
    tc = service.create_lora_training_client(base_model="tiny", rank=4, seed=0).result()
    data = [
        types.Datum(
            model_input=types.ModelInput.from_ints([1, 2, 3, 4, 5, 6]),
            loss_fn_inputs={"target_tokens": [2, 3, 4, 5, 6, 7], "weights": [1.0] * 6},
        )
    ] * 4
    tc.forward_backward(data, "cross_entropy").result()  # warm
    sid = session(server)
    sample = long_sample(server, sid)
    out = tc.forward_backward(data, "cross_entropy")
    step = tc.optim_step(types.AdamParams(learning_rate=1e-3))
    assert out.result().metrics["loss:sum"] > 0 and step.result().metrics["grad_norm"] > 0
    # the step went between the sample's slices: the sample is still running, and is cancelled now
    assert cancelled(server, sample)
    assert server.get("healthz").status_code == 200


def test_half_sent_requests_are_closed_and_the_server_keeps_answering(server):
    host, port = server.url.removeprefix("http://").split(":")
    silent = [socket.create_connection((host, int(port))) for _ in range(20)]
    half_head = [socket.create_connection((host, int(port))) for _ in range(20)]
    for s in half_head:
        s.sendall(b"POST /api/v1/asample HTTP/1.1\r\nHost: x\r\nX-API-Key: ")
    half_body = [socket.create_connection((host, int(port))) for _ in range(5)]
    for s in half_body:
        head = (
            f"POST /api/v1/asample HTTP/1.1\r\nHost: x\r\nX-API-Key: {server.api_key}\r\nContent-Length: 1000\r\n\r\n"
        )
        s.sendall(head.encode() + b'{"num_samples": ')
    assert server.get("healthz").status_code == 200
    for s in silent + half_head:  # closed without an answer, once --header-timeout (1 s) has passed
        s.settimeout(30)
        assert s.recv(1024) == b""
    for s in half_body:  # 408 once nothing more came for --body-timeout (1 s)
        s.settimeout(30)
        answer = b""
        while chunk := s.recv(4096):
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 408") and b"--body-timeout" in answer, answer
    for s in silent + half_head + half_body:
        s.close()
    assert server.get("healthz").status_code == 200


def test_a_body_declared_too_large_is_refused_and_its_connection_closed(server):
    """A Content-Length past --max-request-mb is a 413 before the body is read, and the server
    closes the connection rather than read (and drop) a body nobody wants."""
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as s:
        head = (
            f"POST /api/v1/asample HTTP/1.1\r\nHost: x\r\nX-API-Key: {server.api_key}\r\n"
            f"Content-Length: {1 << 40}\r\n\r\n"
        )
        s.sendall(head.encode() + b"{")
        s.settimeout(30)
        answer = b""
        while chunk := s.recv(4096):  # ends: the server closed the connection
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 413") and b"connection: close" in answer.lower(), answer
    assert server.get("healthz").status_code == 200
