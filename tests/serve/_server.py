"""``harts serve`` as a subprocess on a free localhost port, for the tests that drive it with tinker."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]


@dataclass
class Server:
    url: str
    api_key: str
    state_dir: Path
    log: Path
    proc: subprocess.Popen

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def get(self, path: str, key: str | None = None) -> httpx.Response:
        """GET /api/v1/PATH with the server's key (or ``key``)."""
        headers = {"X-API-Key": self.api_key if key is None else key}
        return httpx.get(f"{self.url}/api/v1/{path}", headers=headers, timeout=60)

    def post(
        self, path: str, *, json: object = None, content: bytes | None = None, headers: dict[str, str] | None = None
    ) -> httpx.Response:
        """POST /api/v1/PATH with the server's key (``headers`` may replace it)."""
        sent = {"X-API-Key": self.api_key, **(headers or {})}
        return httpx.post(f"{self.url}/api/v1/{path}", json=json, content=content, headers=sent, timeout=60)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def running_server(
    model: str, workdir: Path, *extra: str, keys_file: Path | None = None, key: str | None = None
) -> Iterator[Server]:
    """Start ``harts serve --model MODEL`` and wait for its health check; stop it afterwards.
    With ``keys_file`` it serves that file's tenants, and ``key`` (one of them) is the one the
    health check and ``Server.get`` / ``post`` send."""
    port = free_port()
    key = key or f"tml-test-{uuid.uuid4().hex[:12]}"
    keys = ["--keys-file", str(keys_file)] if keys_file is not None else ["--api-key", key]
    state = workdir / "state dir"
    log = workdir / "server.log"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    cmd = [sys.executable, "-m", "harts.cli", "serve", "--model", model, "--port", str(port), *keys]
    cmd += ["--state-dir", str(state), "--threads", "1", "--poll-seconds", "5", *extra]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=workdir)
    server = Server(f"http://127.0.0.1:{port}", key, state, log, proc)
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"harts serve exited with {proc.returncode}:\n{server.log_text()}")
            try:
                if server.get("healthz").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"harts serve did not answer within 120 s:\n{server.log_text()}")
            time.sleep(0.2)
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def serving(model: str, workdir: Path, *extra: str, **keys: Any) -> Iterator[Server]:
    """``running_server`` for a test module: the SDK's telemetry off in this process while it
    runs, and the server's log free of tracebacks when it stops. ``keys``: ``keys_file``, ``key``."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TINKER_TELEMETRY", "0")
        with running_server(model, workdir, *extra, **keys) as srv:
            yield srv
        assert "Traceback" not in srv.log_text(), srv.log_text()


@contextmanager
def service_client(server: Server) -> Iterator[Any]:
    """A ``tinker.ServiceClient`` of ``server``'s key, closed (its session finished) afterwards."""
    import tinker

    sc = tinker.ServiceClient(base_url=server.url, api_key=server.api_key)
    yield sc
    sc.close("success").result()
