"""Many clients at once, one of them hostile: the well-behaved ones keep their pace.

A real ``harts serve`` (the tiny preset) and seven well-behaved tinker clients, each training
its own run (``forward_backward`` + ``optim_step`` per step) in a loop for the whole test, and
an eighth, hostile client (``tests/serve/_hostile.py``: a million-datum body, an oversized
sample, long samples, a flood of queued requests on its own run, 300 half-sent connections)
switched on and off in alternating time windows, so that a drift in the machine's load falls on
both alike and every step is measured at the same steady concurrency. Every well-behaved
client's median step time beside the hostile client stays within 2x of its median alone (the
steps wholly inside the windows of each kind); only times of the same run are compared, never a
wall-clock bound.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

tinker = pytest.importorskip("tinker")
pytest.importorskip("fastapi")

from tinker import types  # noqa: E402

from tests.serve._server import REPO, Server, serving  # noqa: E402

pytestmark = pytest.mark.slow

GOOD = 7
#: seconds of stepping before the measured windows, and the windows: ROUNDS times a window
#: alone and a window beside the hostile client
WARMUP = 3.0
ROUNDS = 5
WINDOW = 4.0
#: seconds after which a client counts as hung (a guard against waiting forever, not a bound on
#: its pace: a step takes a fraction of a second)
HUNG = 600
ARGS = (
    "--capacity",
    "512",
    "--max-models",
    "32",
    "--max-datums",
    "4096",
    "--max-sample-tokens",
    "20000",
    "--header-timeout",
    "2",
    "--body-timeout",
    "2",
)
ADAM = types.AdamParams(learning_rate=1e-3)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serving("tiny", tmp_path_factory.mktemp("serve load"), *ARGS) as srv:
        yield srv


def batch(seed: int, datums: int = 8, tokens: int = 64) -> list[types.Datum]:
    ids = [(seed * 7 + i) % 60 + 1 for i in range(tokens)]
    return [
        types.Datum(
            model_input=types.ModelInput.from_ints(ids[:-1]),
            loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (tokens - 1)},
        )
    ] * datums


class Stepping:
    """The well-behaved clients, each stepping its run in a loop of its own until ``stop``; every
    step's (start, end) goes to ``steps[client]``."""

    def __init__(self, clients: list[tinker.TrainingClient]) -> None:
        self.steps: list[list[tuple[float, float]]] = [[] for _ in clients]
        self.errors: list[BaseException] = []
        self.done = threading.Event()
        self.threads = [threading.Thread(target=self.loop, args=(tc, i)) for i, tc in enumerate(clients)]
        for t in self.threads:
            t.start()

    def loop(self, tc: tinker.TrainingClient, i: int) -> None:
        data = batch(i)
        try:
            while not self.done.is_set():
                t0 = time.monotonic()
                fwd = tc.forward_backward(data, "cross_entropy")
                opt = tc.optim_step(ADAM)
                assert opt.result().metrics["grad_norm"] > 0 and fwd.result().metrics["loss:sum"] > 0
                self.steps[i].append((t0, time.monotonic()))
        except BaseException as err:  # reported by stop()
            self.errors.append(err)

    def stop(self) -> None:
        self.done.set()
        deadline = time.monotonic() + HUNG
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        assert not self.errors and not any(t.is_alive() for t in self.threads), self.errors or "a client hung"

    def within(self, windows: list[tuple[float, float]]) -> list[list[float]]:
        """Each client's times of the steps that started and ended inside one of ``windows``."""
        return [[e - s for s, e in mine if any(a <= s and e <= b for a, b in windows)] for mine in self.steps]


class HostileProcess:
    """``tests/serve/_hostile.py`` in its own process, its rounds switched on and off from here."""

    def __init__(self, server: Server, control_dir: Path) -> None:
        self.dir = control_dir
        cmd = [sys.executable, "-m", "tests.serve._hostile", server.url, server.api_key, str(control_dir)]
        self.proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
        self.round = 0

    def switch(self, state: str) -> None:
        """Switch the attacks ``on`` or ``off`` and wait until the hostile client has."""
        self.round += state == "on"
        line = f"{state} {self.round}"
        (self.dir / "control.tmp").write_text(line)
        os.replace(self.dir / "control.tmp", self.dir / "control")
        ack = self.dir / "ack"
        deadline = time.monotonic() + 120
        while not (ack.exists() and ack.read_text().strip() == line):
            assert self.proc.poll() is None and time.monotonic() < deadline, "the hostile client is gone"
            time.sleep(0.05)

    def stats(self) -> dict[str, int]:
        return dict(json.loads((self.dir / "stats.json").read_text()))

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def window(seconds: float) -> tuple[float, float]:
    start = time.monotonic()
    time.sleep(seconds)
    return start, time.monotonic()


def test_a_hostile_client_does_not_slow_the_others_past_2x(server, tmp_path: Path):
    services = [tinker.ServiceClient(base_url=server.url, api_key=server.api_key) for _ in range(GOOD)]
    clients = [
        sc.create_lora_training_client(base_model="tiny", rank=4, seed=i).result() for i, sc in enumerate(services)
    ]
    stepping = Stepping(clients)
    alone, beside = [], []
    hostile = HostileProcess(server, tmp_path)
    try:
        time.sleep(WARMUP)
        for _ in range(ROUNDS):
            alone.append(window(WINDOW))
            hostile.switch("on")
            time.sleep(1.0)  # every kind of attack under way
            beside.append(window(WINDOW))
            hostile.switch("off")
            time.sleep(1.0)  # the last slice of its work done
        stats = hostile.stats()
    finally:
        hostile.stop()
        stepping.stop()
    for sc in services:
        sc.close("success").result()

    times = list(zip(stepping.within(alone), stepping.within(beside), strict=True))
    assert all(len(a) >= 5 and len(b) >= 5 for a, b in times), times  # enough steps of each client to compare
    ratios = [statistics.median(b) / statistics.median(a) for a, b in times]
    detail = {"ratios": [round(r, 2) for r in ratios], "times (alone, beside)": times, "hostile": stats}
    # every attack was made, and the server refused what it must (never a 2xx for the million datums)
    assert stats.get("huge body 400", 0) >= 2 and not any(k.startswith("huge body 2") for k in stats), stats
    assert stats.get("huge sample 400", 0) >= 2 and stats.get("long sample 200", 0) >= 2, stats
    assert stats.get("half-sent closed", 0) >= 300 and stats.get("flood 200", 0) >= 100, stats
    print(f"median step time beside the hostile client / alone, per client: {detail['ratios']}; hostile: {stats}")
    assert max(ratios) <= 2.0, detail
    assert server.get("healthz").status_code == 200
