"""The one thread that touches the engines: requests run here, one at a time, in order.

Tinker numbers every request of a training client: create_model (or the load that creates the
model) is number 0 and the client's later requests carry ``seq_id`` 1, 2, 3, ... in the order
the program issued them. The SDK may send them out of that order (it sends the chunks of one
large ``forward_backward`` in parallel, the first chunk last) and resend one after a dropped
connection, so the server orders them itself. ``Worker`` keeps, per model, the next sequence
number it expects; a job that arrives early waits until every job before it has arrived,
a job with a number already taken is a resend and gets the first one's request id back (it
does not run twice). Jobs of all models and all sampling requests (which carry no order) then
run in arrival order on one thread, so an engine never sees two calls at once and no lock is
needed around model weights.

A request the server refuses before it is queued (a malformed datum, an oversized batch)
still used its sequence number on the client, so the handler calls ``skip`` to let the jobs
after it through.

Every job resolves its future exactly once (``FutureStore.resolve``): with its result, with
the ``UserError`` message it raised (category "user"), or, for any other exception, with a
one-line message (category "server") while the traceback goes to the server log; the worker
then carries on with the next job.
"""

from __future__ import annotations

import logging
import threading
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from harts.errors import UserError
from harts.serve.futures import Done, Failed, FutureStore, Outcome

__all__ = ["Job", "Worker"]

log = logging.getLogger("harts.serve")


@dataclass(slots=True)
class Job:
    """One queued request: ``run`` computes its outcome on the worker thread."""

    request_id: str
    kind: str
    run: Callable[[], Done]
    #: ordering key (a model id) and the job's number in it; None for unordered jobs
    key: str | None = None
    seq_id: int | None = None


class Worker:
    """Runs jobs on one daemon thread in per-model sequence order (module docstring)."""

    def __init__(self, futures: FutureStore) -> None:
        self._futures = futures
        self._cond = threading.Condition()
        self._ready: deque[Job] = deque()
        self._next_seq: dict[str, int] = {}
        self._held: dict[str, dict[int, Job]] = {}
        self._taken: dict[tuple[str, int], str] = {}
        self._busy = False
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="harts-serve-worker", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ submission
    def taken(self, key: str, seq_id: int) -> str | None:
        """The request id already holding ``seq_id`` of ``key`` (a resend), else None."""
        with self._cond:
            return self._taken.get((key, seq_id))

    def is_past(self, key: str, seq_id: int) -> bool:
        """True when ``seq_id`` of ``key`` was used by a request that was refused (``skip``)."""
        with self._cond:
            return seq_id < self._next_seq.get(key, 0) and (key, seq_id) not in self._taken

    def submit(self, job: Job) -> str:
        """Queue ``job``; returns its request id, or the first one's for a resend (see ``taken``)."""
        with self._cond:
            if job.key is None or job.seq_id is None:
                self._ready.append(job)
            else:
                first = self._taken.get((job.key, job.seq_id))
                if first is not None:
                    return first
                self._taken[(job.key, job.seq_id)] = job.request_id
                self._held.setdefault(job.key, {})[job.seq_id] = job
                self._release_locked(job.key)
            self._cond.notify_all()
        return job.request_id

    def skip(self, key: str, seq_id: int) -> None:
        """``seq_id`` of ``key`` was refused before queueing: let the jobs after it run."""
        with self._cond:
            if (key, seq_id) in self._taken or seq_id < self._next_seq.get(key, 0):
                return
            self._held.setdefault(key, {})[seq_id] = Job(request_id="", kind="skipped", run=_nothing)
            self._release_locked(key)
            self._cond.notify_all()

    def forget(self, key: str) -> None:
        """Drop the ordering state of ``key`` (its model is gone); held jobs fail."""
        with self._cond:
            held = self._held.pop(key, {})
            self._next_seq.pop(key, None)
            for k in [k for k in self._taken if k[0] == key]:
                del self._taken[k]
        for job in held.values():
            if job.request_id:
                self._futures.resolve(job.request_id, Failed(f"model {key} was released before this request ran"))

    def _release_locked(self, key: str) -> None:
        held = self._held.get(key, {})
        nxt = self._next_seq.get(key, 0)
        while nxt in held:
            job = held.pop(nxt)
            if job.request_id:
                self._ready.append(job)
            nxt += 1
        self._next_seq[key] = nxt

    # ------------------------------------------------------------------ state
    def waiting(self) -> int:
        """Jobs queued or held for an earlier sequence number (not counting the running one)."""
        with self._cond:
            return len(self._ready) + sum(1 for h in self._held.values() for j in h.values() if j.request_id)

    def idle(self) -> bool:
        """Nothing running and nothing ready to run."""
        with self._cond:
            return not self._busy and not self._ready

    def stop(self) -> None:
        """Let the running job finish, then end the thread (queued jobs stay unresolved)."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self._thread.join(timeout=60)

    # ------------------------------------------------------------------ the thread
    def _loop(self) -> None:
        while True:
            with self._cond:
                self._busy = False
                while not self._ready and not self._stopped:
                    self._cond.wait()
                if self._stopped:
                    return
                job = self._ready.popleft()
                self._busy = True
            self._futures.resolve(job.request_id, _outcome(job))


def _outcome(job: Job) -> Outcome:
    try:
        return job.run()
    except UserError as err:
        return Failed(f"{job.kind}: {err}", "user")
    except Exception as err:  # a bug or a resource error: report one line, keep serving
        log.error("%s %s failed:\n%s", job.kind, job.request_id, traceback.format_exc())
        text = str(err).strip().splitlines()
        return Failed(f"{job.kind}: {type(err).__name__}: {text[0] if text else ''} (see the server log)", "server")


def _nothing() -> Done:
    raise AssertionError("a skipped sequence number is never run")
