"""The worker's fairness: round-robin across lanes, sliced jobs, cancellation and dropped owners."""

from __future__ import annotations

import asyncio
import threading
import time

from harts.serve.futures import Done, Failed, FutureStore
from harts.serve.worker import Job, Later, Step, Worker


def outcome(futures: FutureStore, request_id: str) -> Done | Failed | None:
    return asyncio.run(futures.wait(request_id, timeout=10))


def logged(futures: FutureStore, log: list[str], name: str, seconds: float = 0.0, **fields: object) -> Job:
    """A job that appends ``name`` to ``log`` when it runs (and takes ``seconds``)."""

    def run() -> Done:
        log.append(name)
        time.sleep(seconds)
        return Done(name.encode(), "text/plain")

    return Job(request_id=futures.create(name), kind=name, run=run, **fields)  # type: ignore[arg-type]


def blocker(futures: FutureStore, gate: threading.Event, started: threading.Event) -> Job:
    """A job that holds the worker until ``gate`` is set, so what is submitted meanwhile queues up."""

    def run() -> Done:
        started.set()
        gate.wait(10)
        return Done(b"", "text/plain")

    return Job(request_id=futures.create("block"), kind="block", run=run, lane="block")


def sliced(futures: FutureStore, log: list[str], name: str, slices: int, lane: str) -> Job:
    """A job that takes ``slices`` turns of the worker (``Later`` between them)."""
    left = [slices]

    def run() -> Step:
        left[0] -= 1
        log.append(f"{name}{slices - left[0]}")
        time.sleep(0.002)
        return Done(name.encode(), "text/plain") if left[0] == 0 else Later(run)

    return Job(request_id=futures.create(name), kind="Sample", run=run, lane=lane)


def queued_behind_a_blocker(worker: Worker, futures: FutureStore, jobs: list[Job]) -> threading.Event:
    gate, started = threading.Event(), threading.Event()
    worker.submit(blocker(futures, gate, started))
    assert started.wait(10)
    for j in jobs:
        worker.submit(j)
    return gate


def test_a_long_queue_of_one_model_does_not_starve_another():
    futures, log = FutureStore(), []
    worker = Worker(futures)
    a = [logged(futures, log, f"a{i}", key="A", seq_id=i) for i in range(6)]
    b = logged(futures, log, "b0", key="B", seq_id=0)
    queued_behind_a_blocker(worker, futures, [*a, b]).set()
    assert outcome(futures, a[-1].request_id) == Done(b"a5", "text/plain")
    assert outcome(futures, b.request_id) == Done(b"b0", "text/plain")
    # round-robin across models: B's only job runs right after A's first, not after all six
    assert log.index("b0") <= 2, log
    assert [x for x in log if x.startswith("a")] == [f"a{i}" for i in range(6)]  # each model's own order
    worker.stop()


def test_a_sliced_job_lets_other_lanes_run_between_its_slices():
    futures, log = FutureStore(), []
    worker = Worker(futures)
    long = sliced(futures, log, "s", 8, lane="sampler")
    steps = [logged(futures, log, f"t{i}", 0.002, key="T", seq_id=i) for i in range(3)]
    queued_behind_a_blocker(worker, futures, [long, *steps]).set()
    assert outcome(futures, long.request_id) == Done(b"s", "text/plain")
    assert all(isinstance(outcome(futures, s.request_id), Done) for s in steps)
    assert log.index("t2") < log.index("s8"), log  # every step ran before the sample's last slice
    assert [x for x in log if x.startswith("s")] == [f"s{i}" for i in range(1, 9)]


def test_a_lane_of_long_jobs_gets_fewer_turns_than_a_lane_of_short_ones():
    futures, log = FutureStore(), []
    worker = Worker(futures)
    long = [logged(futures, log, f"l{i}", 0.05, lane="L") for i in range(3)]
    short = [logged(futures, log, f"s{i}", 0.005, lane="S") for i in range(10)]
    queued_behind_a_blocker(worker, futures, [*long, *short]).set()
    assert all(isinstance(outcome(futures, j.request_id), Done) for j in long + short)
    # by worker time, not by turns: ten short jobs fit in about one long one
    assert log.index("s9") < log.index("l2"), log
    worker.stop()


def test_turns_go_by_client_so_a_client_of_many_runs_gets_no_more_than_one_of_one_run():
    futures, log = FutureStore(), []
    worker = Worker(futures)
    many = [logged(futures, log, f"x{i}", 0.005, lane=f"x-run{i % 3}", owner="X") for i in range(12)]
    one = [logged(futures, log, f"y{i}", 0.005, lane="y-run", owner="Y") for i in range(4)]
    queued_behind_a_blocker(worker, futures, [*many, *one]).set()
    assert all(isinstance(outcome(futures, j.request_id), Done) for j in many + one)
    # X and Y alternate (Y's last job is about the 8th), not X's three runs and Y's one (the 16th)
    assert log.index("y3") <= 10, log
    worker.stop()


def test_a_cancelled_job_never_runs_and_a_running_sliced_job_stops_after_its_slice():
    futures, log = FutureStore(), []
    worker = Worker(futures)
    queued = logged(futures, log, "q", lane="L")
    gate = queued_behind_a_blocker(worker, futures, [queued])
    assert worker.cancel(queued.request_id, "cancelled by the client")
    gate.set()
    result = outcome(futures, queued.request_id)
    assert isinstance(result, Failed) and "cancelled" in result.message and log == []
    assert not worker.cancel(queued.request_id, "again")  # resolved: nothing to cancel

    release, in_slice = threading.Event(), threading.Event()

    def slow() -> Step:
        log.append("slice")
        in_slice.set()
        release.wait(10)
        return Later(slow)

    running = Job(request_id=futures.create("Sample"), kind="Sample", run=slow, lane="L")
    worker.submit(running)
    assert in_slice.wait(10)
    assert worker.cancel(running.request_id, "cancelled by the client")
    release.set()
    result = outcome(futures, running.request_id)
    assert isinstance(result, Failed) and "cancelled" in result.message
    assert log == ["slice"]
    worker.stop()


def test_a_finished_owner_s_queued_jobs_are_dropped_before_they_run():
    futures, log = FutureStore(), []
    worker = Worker(futures)
    mine = [logged(futures, log, f"m{i}", lane="x", owner="s1") for i in range(3)]
    other = logged(futures, log, "o", lane="y", owner="s2")
    gate = queued_behind_a_blocker(worker, futures, [*mine, other])
    assert worker.drop_owner("s1", "session s1 finished") == 3
    gate.set()
    assert outcome(futures, other.request_id) == Done(b"o", "text/plain")
    for j in mine:
        result = outcome(futures, j.request_id)
        assert isinstance(result, Failed) and "finished" in result.message
    assert log == ["o"]
    worker.stop()


def test_forget_drops_the_queued_jobs_of_a_released_model():
    futures, log = FutureStore(), []
    worker = Worker(futures)
    ready = [logged(futures, log, f"r{i}", key="m", seq_id=i) for i in range(2)]
    gate = queued_behind_a_blocker(worker, futures, ready)
    worker.forget("m")
    gate.set()
    for j in ready:
        result = outcome(futures, j.request_id)
        assert isinstance(result, Failed) and "released" in result.message
    assert log == []
    worker.stop()
