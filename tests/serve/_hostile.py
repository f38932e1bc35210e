"""A hostile client of ``harts serve`` for the load test, run as its own process:

    python -m tests.serve._hostile URL KEY CONTROL_DIR

It attacks in rounds the test switches on and off: the test writes ``on N`` / ``off N`` to
``CONTROL_DIR/control``, and the hostile client answers the same line in ``CONTROL_DIR/ack``
once it is under way or has stopped. In a round it makes a session with a training run and a
sampling client, then does at once, over and over: a 55 MiB ``forward_backward`` of a million
datums, a sample of 256 x 65,535 tokens, two long samples the server accepts (and the worker
must slice), a flood of queued ``forward`` requests on its run that it never retrieves, and 300
connections that send half a request head and stop. Ending a round it cancels its samples,
closes its connections and finishes the session (the server drops the queued flood). What the
server answered is counted into ``CONTROL_DIR/stats.json`` by outcome.

A process of its own, so that its work does not take the interpreter from the well-behaved
clients it is measured against.
"""

from __future__ import annotations

import itertools
import json
import os
import socket
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
from tinker.proto import tinker_public_pb2 as pb

HALF_SENT = 300
FLOOD = 300


class Round:
    """One round of attacks, from its own session (module docstring)."""

    def __init__(self, url: str, key: str, stats: Counter[str], lock: threading.Lock) -> None:
        self.url, self.key, self.stats, self.lock = url, key, stats, lock
        self.stop = threading.Event()
        self.client = httpx.Client(timeout=120, headers={"X-API-Key": key})
        self.seq = itertools.count(1)
        self.samples: set[str] = set()
        sid = self.post("create_session", json={"tags": [], "user_metadata": None, "sdk_version": "x"})
        self.session = sid.json()["session_id"]
        create = {"session_id": self.session, "model_seq_id": 0, "base_model": "tiny", "lora_config": {"rank": 2}}
        created = self.post("create_model", json=create).json()
        self.model_id = created["model_id"]
        self.result(created["request_id"])  # the run is built before the attacks start
        sampler = {"session_id": self.session, "sampling_session_seq_id": 0, "base_model": "tiny"}
        self.sampler = self.post("create_sampling_session", json=sampler).json()["sampling_session_id"]
        jobs: list[Callable[[], None]] = [self.huge_bodies, self.huge_samples, self.flood, self.half_sent]
        jobs += [self.long_samples, self.long_samples]
        self.threads = [threading.Thread(target=job, daemon=True) for job in jobs]
        for t in self.threads:
            t.start()

    def post(self, path: str, **kw: object) -> httpx.Response:
        return self.client.post(f"{self.url}/api/v1/{path}", **kw)  # type: ignore[arg-type]

    def result(self, request_id: str) -> httpx.Response:
        """The answer that resolves ``request_id`` (polled until it is not "try again")."""
        while True:
            out = self.post("retrieve_future", json={"request_id": request_id})
            if not out.headers["content-type"].startswith("application/json") or out.json().get("type") != "try_again":
                return out

    def count(self, what: str) -> None:
        with self.lock:
            self.stats[what] += 1

    def forward(self, n: int, tokens: int) -> bytes:
        with self.lock:
            seq_id = next(self.seq)
        return forward_body(self.model_id, seq_id, n, tokens)

    def huge_bodies(self) -> None:
        while not self.stop.is_set():
            r = self.post("forward_backward", content=self.forward(1_000_000, 3))
            self.count(f"huge body {r.status_code}")
            self.stop.wait(2.0)

    def huge_samples(self) -> None:
        while not self.stop.is_set():
            r = self.post("asample", json=sample_request(self.sampler, 256, 65_535))
            self.count(f"huge sample {r.status_code}")
            self.stop.wait(0.5)

    def long_samples(self) -> None:
        while not self.stop.is_set():
            r = self.post("asample", json=sample_request(self.sampler, 16, 450))
            self.count(f"long sample {r.status_code}")
            if r.status_code != 200:
                self.stop.wait(0.5)
                continue
            request_id = r.json()["request_id"]
            with self.lock:
                self.samples.add(request_id)
            self.result(request_id)  # wait for it, as a client that wants its samples does
            with self.lock:
                self.samples.discard(request_id)

    def flood(self) -> None:
        for _ in range(FLOOD):
            if self.stop.is_set():
                return
            r = self.post("forward_backward", content=self.forward(8, 48))
            self.count(f"flood {r.status_code}")

    def half_sent(self) -> None:
        host, port = self.url.removeprefix("http://").split(":")
        socks: list[socket.socket] = []
        while not self.stop.is_set():
            for s in list(socks):
                try:
                    if s.recv(1) == b"":  # the server closed it
                        socks.remove(s)
                        s.close()
                        self.count("half-sent closed")
                except BlockingIOError:
                    pass
            while len(socks) < HALF_SENT:
                s = socket.create_connection((host, int(port)))
                s.sendall(b"POST /api/v1/forward_backward HTTP/1.1\r\nHost: x\r\nContent-Le")
                s.setblocking(False)
                socks.append(s)
            self.stop.wait(0.2)
        for s in socks:
            s.close()

    def end(self) -> None:
        self.stop.set()
        with self.lock:
            samples = list(self.samples)
        for request_id in samples:
            self.post("cancel_future", json={"request_id": request_id})
        for t in self.threads:
            t.join(60)
        self.post(f"sessions/{self.session}/finish", json={})
        self.client.close()


def forward_body(model_id: str, seq_id: int, n: int, tokens: int) -> bytes:
    """A protobuf ``forward`` of ``n`` identical datums of ``tokens`` input tokens, built as bytes."""
    inputs = np.arange(1, tokens + 1) % 60
    d = pb.Datum()
    d.model_input.add().encoded_text.tokens = inputs.astype(np.int32).tobytes()
    target = d.loss_fn_inputs["target_tokens"]
    target.dense, target.dtype = np.r_[inputs[1:], 0].astype(np.int64).tobytes(), pb.DTYPE_INT64
    raw = d.SerializeToString()
    head = pb.ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, loss_fn="cross_entropy", forward_only=True)
    size, n_bytes = bytearray(), len(raw)
    while n_bytes >= 0x80:
        size.append(n_bytes & 0x7F | 0x80)
        n_bytes >>= 7
    frame = bytes([3 << 3 | 2, *size, n_bytes]) + raw  # field 3 (data), length-delimited
    return head.SerializeToString() + frame * n


def sample_request(sampler_id: str, num_samples: int, max_tokens: int) -> dict[str, object]:
    return {
        "sampling_session_id": sampler_id,
        "num_samples": num_samples,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3, 4, 5]}]},
        "sampling_params": {"max_tokens": max_tokens, "seed": 0, "stop": []},
    }


def write(path: Path, text: str) -> None:
    path.with_suffix(".tmp").write_text(text)
    os.replace(path.with_suffix(".tmp"), path)


def main(url: str, key: str, control_dir: str) -> None:
    control, ack, stats_path = (Path(control_dir) / name for name in ("control", "ack", "stats.json"))
    stats: Counter[str] = Counter()
    lock = threading.Lock()
    current: Round | None = None
    done = ""
    while True:
        line = control.read_text().strip() if control.exists() else ""
        if line and line != done:
            if line.startswith("on"):
                current = Round(url, key, stats, lock)
            elif current is not None:
                current.end()
                current = None
            with lock:
                write(stats_path, json.dumps(dict(stats)))
            write(ack, line)
            done = line
        time.sleep(0.05)


if __name__ == "__main__":
    # the attacker's own work runs on this machine only because the test does: at the lowest
    # priority, what slows the others is what the server does for it, not what it does itself
    os.nice(19)
    main(*sys.argv[1:])
