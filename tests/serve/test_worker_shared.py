"""The worker's support for jobs that share work (sampling requests in one decode batch): a
rotating slice lets its lane's other jobs take turns, a job finished by another's turn is
resolved at once and never runs, and a dropped or failed job's ``drop`` runs on the worker thread."""

from __future__ import annotations

import threading
import time

from harts.serve.futures import Done, Failed, FutureStore
from harts.serve.worker import Job, Later, Step, Worker
from tests.serve.test_worker_fairness import outcome, queued_behind_a_blocker


def rotating(
    futures: FutureStore, log: list[str], name: str, slices: int, *, rotate: bool = True, **fields: object
) -> Job:
    """A job of ``slices`` turns whose slices ``rotate`` (``Later.rotate``); its ``drop`` logs
    ``drop-<name>@<thread>``."""
    left = [slices]

    def drop() -> None:
        log.append(f"drop-{name}@{threading.current_thread().name}")

    def run() -> Step:
        left[0] -= 1
        log.append(f"{name}{slices - left[0]}")
        return Done(name.encode(), "text/plain") if left[0] == 0 else Later(run, drop=drop, rotate=rotate)

    return Job(request_id=futures.create(name), kind="Sample", run=run, **fields)  # type: ignore[arg-type]


def test_rotating_slices_take_turns_within_their_lane_and_others_go_ahead():
    futures, log = FutureStore(), []
    worker = Worker(futures)
    jobs = [rotating(futures, log, n, 3, lane="L") for n in "ab"]
    jobs += [rotating(futures, log, n, 2, rotate=False, lane="M") for n in "cd"]
    queued_behind_a_blocker(worker, futures, jobs).set()
    assert all(isinstance(outcome(futures, j.request_id), Done) for j in jobs)
    worker.stop()
    assert [x for x in log if x[0] in "ab"] == ["a1", "b1", "a2", "b2", "a3", "b3"]
    assert [x for x in log if x[0] in "cd"] == ["c1", "c2", "d1", "d2"]  # no rotation: one after the other


def test_a_job_settled_by_another_s_turn_is_answered_at_once_and_never_runs():
    futures, log = FutureStore(), []
    worker = Worker(futures)
    waiting = rotating(futures, log, "w", 1, lane="L")
    settled: list[bool] = []

    def run() -> Done:  # finishes ``waiting``'s work within its own turn
        settled.append(worker.settle(waiting.request_id, Done(b"by-r", "text/plain")))
        settled.append(worker.settle(waiting.request_id, Done(b"again", "text/plain")))
        settled.append(worker.settle(runner.request_id, Done(b"self", "text/plain")))
        return Done(b"r", "text/plain")

    runner = Job(request_id=futures.create("r"), kind="Sample", run=run, lane="L")
    queued_behind_a_blocker(worker, futures, [runner, waiting]).set()
    assert outcome(futures, waiting.request_id) == Done(b"by-r", "text/plain")
    assert outcome(futures, runner.request_id) == Done(b"r", "text/plain")
    worker.stop()
    assert settled == [True, False, False]  # once; never the running job
    assert log == []  # the settled job never ran


def test_dropped_and_failed_jobs_let_go_of_their_shared_state_on_the_worker_thread():
    futures, log = FutureStore(), []
    worker = Worker(futures)
    queued = rotating(futures, log, "q", 10**9, lane="L")
    owned = rotating(futures, log, "o", 10**9, lane="L", owner="s1")
    worker.submit(queued)
    worker.submit(owned)
    while not ("q1" in log and "o1" in log):  # both ran a slice, so both hold shared state
        time.sleep(0.001)
    fresh = rotating(futures, log, "f", 5, lane="M")  # never runs: nothing to let go of
    gate = queued_behind_a_blocker(worker, futures, [fresh])  # the worker busy: all three queued
    assert worker.cancel(fresh.request_id, "cancelled by the client")
    assert worker.cancel(queued.request_id, "cancelled by the client")
    assert worker.drop_owner("s1", "session s1 expired") == 1
    gate.set()
    for job, word in ((queued, "cancelled"), (owned, "expired"), (fresh, "cancelled")):
        result = outcome(futures, job.request_id)
        assert isinstance(result, Failed) and word in result.message

    failing_left = [2]

    def failing() -> Step:  # its second slice raises
        failing_left[0] -= 1
        if failing_left[0] == 0:
            raise RuntimeError("the batch broke")
        return Later(failing, drop=lambda: log.append(f"drop-x@{threading.current_thread().name}"), rotate=True)

    broken = Job(request_id=futures.create("x"), kind="Sample", run=failing, lane="X")
    worker.submit(broken)
    result = outcome(futures, broken.request_id)
    assert isinstance(result, Failed) and "the batch broke" in result.message
    worker.stop()
    drops = sorted(x for x in log if x.startswith("drop-"))
    assert drops == [f"drop-{n}@harts-serve-worker" for n in "oqx"], log
