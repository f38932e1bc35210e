"""The worker's order, resends, refusals and exactly-once futures, without an engine."""

from __future__ import annotations

import asyncio
import threading

import pytest

from harts.errors import UserError
from harts.serve.futures import Done, Failed, FutureStore
from harts.serve.worker import Job, Worker


def outcome(futures: FutureStore, request_id: str) -> Done | Failed | None:
    return asyncio.run(futures.wait(request_id, timeout=10))


def job(futures: FutureStore, log: list[str], name: str, seq: int | None, key: str | None = "m") -> Job:
    def run() -> Done:
        log.append(name)
        return Done(name.encode(), "text/plain")

    return Job(request_id=futures.create(name), kind=name, run=run, key=key, seq_id=seq)


def test_jobs_run_in_sequence_order_whatever_order_they_arrive_in():
    futures = FutureStore()
    worker = Worker(futures)
    log: list[str] = []
    late = [job(futures, log, f"s{i}", i) for i in (3, 1, 2)]
    for j in late:
        worker.submit(j)
    assert asyncio.run(futures.wait(late[0].request_id, timeout=0.1)) is None  # seq 0 has not arrived
    assert log == []
    first = job(futures, log, "s0", 0)
    worker.submit(first)
    assert outcome(futures, late[0].request_id) == Done(b"s3", "text/plain")
    assert log == ["s0", "s1", "s2", "s3"]
    worker.stop()


def test_a_resend_gets_the_first_future_and_runs_once():
    futures = FutureStore()
    worker = Worker(futures)
    log: list[str] = []
    a = job(futures, log, "a", 0)
    assert worker.submit(a) == a.request_id
    b = job(futures, log, "a again", 0)
    assert worker.submit(b) == a.request_id
    assert outcome(futures, a.request_id) == Done(b"a", "text/plain")
    assert log == ["a"] and worker.taken("m", 0) == a.request_id
    worker.stop()


def test_a_refused_number_lets_the_next_one_run():
    futures = FutureStore()
    worker = Worker(futures)
    log: list[str] = []
    worker.submit(job(futures, log, "s0", 0))
    two = job(futures, log, "s2", 2)
    worker.submit(two)
    worker.skip("m", 1)
    assert outcome(futures, two.request_id) == Done(b"s2", "text/plain")
    assert worker.is_past("m", 1) and not worker.is_past("m", 2)
    worker.skip("m", 1)  # idempotent
    worker.stop()


def test_failures_resolve_once_with_a_category_and_the_worker_carries_on():
    futures = FutureStore()
    worker = Worker(futures)

    def user() -> Done:
        raise UserError("bad datum")

    def bug() -> Done:
        raise RuntimeError("boom\nsecond line")

    ids = [futures.create(k) for k in ("user", "bug")]
    worker.submit(Job(ids[0], "Forward", user))
    worker.submit(Job(ids[1], "Forward", bug))
    ok = job(futures, [], "after", None, key=None)
    worker.submit(ok)
    assert outcome(futures, ids[0]) == Failed("Forward: bad datum", "user")
    failed = outcome(futures, ids[1])
    assert isinstance(failed, Failed) and failed.category == "server" and "boom" in failed.message
    assert "second line" not in failed.message
    assert outcome(futures, ok.request_id) == Done(b"after", "text/plain")
    with pytest.raises(Exception):  # a future resolves exactly once
        futures.resolve(ok.request_id, Done(b"twice", "text/plain"))
    worker.stop()


def test_forget_fails_held_jobs():
    futures = FutureStore()
    worker = Worker(futures)
    held = job(futures, [], "s5", 5)
    worker.submit(held)
    worker.forget("m")
    result = outcome(futures, held.request_id)
    assert isinstance(result, Failed) and "released" in result.message
    worker.stop()


def test_unknown_request_ids_raise_and_waiting_times_out():
    futures = FutureStore()
    with pytest.raises(KeyError):
        outcome(futures, "nope")
    rid = futures.create("x")
    assert asyncio.run(futures.wait(rid, timeout=0.05)) is None
    threading.Timer(0.05, futures.resolve, (rid, Done(b"y", "text/plain"))).start()
    assert outcome(futures, rid) == Done(b"y", "text/plain")
