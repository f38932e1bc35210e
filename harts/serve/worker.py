"""The one thread that touches the engines: requests run here, one at a time, taking turns.

Tinker numbers every request of a training client: create_model (or the load that creates the
model) is number 0 and the client's later requests carry ``seq_id`` 1, 2, 3, ... in the order
the program issued them. The SDK may send them out of that order (it sends the chunks of one
large ``forward_backward`` in parallel, the first chunk last) and resend one after a dropped
connection, so the server orders them itself. ``Worker`` keeps, per model, the next sequence
number it expects; a job that arrives early waits until every job before it has arrived,
a job with a number already taken is a resend and gets the first one's request id back (it
does not run twice). Everything runs on one thread, so an engine never sees two calls at once
and no lock is needed around model weights.

Turns: ready jobs wait in lanes -- a training run's jobs in the lane of its model id, a sampling
request in the lane of the run whose weights it samples (so it keeps its place after that run's
``save_weights_for_sampler``), or of its sampling client -- and lanes belong to clients (a job's
``owner``, the session: one ServiceClient). Each turn goes to the client that has had the least
worker time so far, and within it to its least served lane (ties in rotation order, so equal
jobs go round-robin). A client or lane that becomes ready starts level with the one served last,
never with credit for the time it was idle, and keeps the time it used. So one client's long
queue, long jobs or many runs delay another client's next step by about one job, not by the
whole queue, and a client of long jobs gets proportionally fewer turns than clients of short
ones. Within a lane jobs run in the order they became ready, so a model's requests still run in
sequence order. A long job may run in slices:
its ``run`` returns ``Later`` with the rest of the work, which goes back to the front of its
lane (ahead of the lane's later jobs, so the order within the lane holds) while the other lanes
take their turns. Sampling does this between decoding steps (``harts.serve.sampling``), so a
sample of many long sequences holds the worker for one slice at a time. A slice of sampling
requests that decode together in one shared batch says so (``Later.rotate``): its rest goes to
the back of its lane instead, so the lane's other requests get turns (and join the batch) too,
and a request that another's slice finished is taken out of its lane and resolved at once
(``settle``).

Dropped before they run (their futures fail with the reason, nobody waits on the work): a
released model's queued jobs (``forget``), the jobs of an owner that is gone, e.g. a finished
session (``drop_owner``), and a request its client cancelled (``cancel``; a running sliced job
stops after its current slice). A dropped job that had run a slice lets go of what it shares
with other jobs (``Later.drop``: its sequences in a shared batch) on the worker thread, before
the next turn.

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
import time
import traceback
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

from harts.errors import UserError
from harts.serve.futures import Done, Failed, FutureStore, Outcome

__all__ = ["Job", "Later", "Step", "Worker"]

log = logging.getLogger("harts.serve")


@dataclass(frozen=True, slots=True)
class Later:
    """A slice of a job ended with work left: ``run`` does the next slice (module docstring)."""

    run: Callable[[], Step]
    #: called on the worker thread if the job is dropped before it finishes (cancelled, owner
    #: gone): frees what the job holds in state shared with other jobs
    drop: Callable[[], None] | None = None
    #: True: the rest waits behind the lane's other jobs (it shares its work with them, which
    #: they join on their turns); False: it goes ahead of them. Only unordered jobs rotate.
    rotate: bool = False


#: what one turn of a job gives: its result, or the rest of its work
Step = Done | Later


@dataclass(slots=True)
class Job:
    """One queued request: ``run`` computes its outcome (or its first slice) on the worker thread."""

    request_id: str
    kind: str
    run: Callable[[], Step]
    #: ordering key (a model id) and the job's number in it; None for unordered jobs
    key: str | None = None
    seq_id: int | None = None
    #: the lane it takes turns in (module docstring); None: its key's, else a lane of its own kind
    lane: str | None = None
    #: who it runs for (a session id): the client it takes turns as, and ``drop_owner`` drops the
    #: queued jobs of one that is gone; None: its lane is a client of its own
    owner: str | None = None
    #: its last slice's ``Later.drop``, run if the job is dropped before it finishes
    drop: Callable[[], None] | None = None

    @property
    def turn_lane(self) -> str:
        return self.lane or self.key or f"({self.kind})"

    @property
    def client(self) -> str:
        return self.owner or self.turn_lane


class _Turns:
    """Worker time by client and by lane, and which ready lane goes next (module docstring)."""

    def __init__(self) -> None:
        self.client_time: dict[str, float] = {}
        self.lane_time: dict[str, float] = {}
        #: ready lane -> its client, and each client's number of ready lanes
        self.client_of: dict[str, str] = {}
        self.ready_lanes: dict[str, int] = {}
        #: the time of the client picked last, and per client of its lane picked last: where one
        #: that becomes ready starts
        self.now = 0.0
        self.lane_now: dict[str, float] = {}

    def ready(self, lane: str, client: str) -> None:
        """``lane`` of ``client`` has jobs again."""
        if not self.ready_lanes.get(client):
            self.client_time[client] = max(self.client_time.get(client, 0.0), self.now)
        self.ready_lanes[client] = self.ready_lanes.get(client, 0) + 1
        self.client_of[lane] = client
        self.lane_time[lane] = max(self.lane_time.get(lane, 0.0), self.lane_now.get(client, 0.0))

    def idle(self, lane: str) -> None:
        """``lane`` has no jobs left."""
        client = self.client_of.pop(lane)
        self.ready_lanes[client] -= 1
        if not self.ready_lanes[client]:
            del self.ready_lanes[client]

    def pick(self, lanes: list[str]) -> str:
        """The lane of ``lanes`` (the ready ones, in rotation order) that goes next."""
        clients = dict.fromkeys(self.client_of[lane] for lane in lanes)  # in rotation order
        client = min(clients, key=self.client_time.__getitem__)
        lane = min((x for x in lanes if self.client_of[x] == client), key=self.lane_time.__getitem__)
        self.now, self.lane_now[client] = self.client_time[client], self.lane_time[lane]
        return lane

    def used(self, lane: str, client: str, seconds: float) -> None:
        self.client_time[client] = self.client_time.get(client, self.now) + seconds
        self.lane_time[lane] = self.lane_time.get(lane, 0.0) + seconds
        if len(self.lane_time) > 2 * len(self.client_of) + 256:  # forget the idle ones owed nothing
            for gone in [x for x, t in self.lane_time.items() if x not in self.client_of and t <= self.now]:
                del self.lane_time[gone]
            for gone in [c for c, t in self.client_time.items() if c not in self.ready_lanes and t <= self.now]:
                del self.client_time[gone]
                self.lane_now.pop(gone, None)


class Worker:
    """Runs jobs on one daemon thread, clients and their lanes taking turns by worker time,
    per-model sequence order within a lane (module docstring)."""

    def __init__(self, futures: FutureStore) -> None:
        self._futures = futures
        self._cond = threading.Condition()
        #: lane -> its ready jobs; the dict's order is the rotation
        self._lanes: OrderedDict[str, deque[Job]] = OrderedDict()
        self._turns = _Turns()
        self._next_seq: dict[str, int] = {}
        self._held: dict[str, dict[int, Job]] = {}
        self._taken: dict[tuple[str, int], str] = {}
        self._running: Job | None = None
        #: why the running job is dropped after its slice (cancelled, owner gone), by request id
        self._stop_running: str | None = None
        #: dropped jobs' ``drop``s, run on the worker thread before its next turn
        self._cleanups: list[Callable[[], None]] = []
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
                self._enqueue_locked(job)
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

    def _enqueue_locked(self, job: Job, *, front: bool = False) -> None:
        name = job.turn_lane
        lane = self._lanes.get(name)
        if lane is None:
            lane = self._lanes[name] = deque()
            self._turns.ready(name, job.client)
        if front:
            lane.appendleft(job)
        else:
            lane.append(job)

    def _release_locked(self, key: str) -> None:
        held = self._held.get(key, {})
        nxt = self._next_seq.get(key, 0)
        while nxt in held:
            job = held.pop(nxt)
            if job.request_id:
                self._enqueue_locked(job)
            nxt += 1
        self._next_seq[key] = nxt

    # ------------------------------------------------------------------ dropping work
    def forget(self, key: str) -> None:
        """Drop the ordering state of ``key`` (its model is gone); its held and queued jobs fail."""
        with self._cond:
            held = list(self._held.pop(key, {}).values())
            self._next_seq.pop(key, None)
            for k in [k for k in self._taken if k[0] == key]:
                del self._taken[k]
            dropped = self._drop_locked(lambda j: j.key == key, f"model {key} was released")
        reason = f"model {key} was released before this request ran"
        for job in held:
            if job.request_id:
                self._futures.resolve(job.request_id, Failed(reason))
        self._fail(dropped, reason)

    def drop_owner(self, owner: str, reason: str) -> int:
        """Drop every queued job of ``owner`` (``reason`` says why, e.g. its session finished);
        a running sliced job of it stops after its slice. Returns how many were dropped."""
        with self._cond:
            dropped = self._drop_locked(lambda j: j.owner == owner, reason)
        self._fail(dropped, f"{reason} before this request ran")
        return len(dropped)

    def cancel(self, request_id: str, reason: str) -> bool:
        """Drop the job of ``request_id`` if it is queued, or stop it after its slice if it is
        running; False when there is none (unknown, or already resolved)."""
        with self._cond:
            dropped = self._drop_locked(lambda j: j.request_id == request_id, reason)
            running = self._running is not None and self._running.request_id == request_id
        self._fail(dropped, reason)
        return bool(dropped) or running

    def settle(self, request_id: str, outcome: Outcome) -> bool:
        """Resolve the queued job ``request_id`` with ``outcome`` and take it out of its lane: its
        work was finished by another job's turn (a sampling request decoded in a shared batch).
        False when it is not queued (dropped meanwhile, or the running one)."""
        with self._cond:
            taken = self._take_locked(lambda j: j.request_id == request_id)
        if taken:
            self._futures.resolve(request_id, outcome)
        return bool(taken)

    def _take_locked(self, match: Callable[[Job], bool]) -> list[Job]:
        """Take the queued jobs that ``match`` out of their lanes."""
        taken = []
        for name in list(self._lanes):
            lane = self._lanes[name]
            keep = deque(j for j in lane if not match(j))
            taken += [j for j in lane if match(j)]
            if keep:
                self._lanes[name] = keep
            else:
                del self._lanes[name]
                self._turns.idle(name)
        return taken

    def _drop_locked(self, match: Callable[[Job], bool], reason: str) -> list[Job]:
        """Take the queued jobs that ``match`` out of their lanes (their ``drop``s to run next);
        mark the running one."""
        dropped = self._take_locked(match)
        self._cleanups += [j.drop for j in dropped if j.drop is not None]
        if self._running is not None and match(self._running):
            self._stop_running = reason
        self._cond.notify_all()
        return dropped

    def _fail(self, jobs: list[Job], reason: str) -> None:
        for job in jobs:
            self._futures.resolve(job.request_id, Failed(f"{job.kind}: {reason}"))

    # ------------------------------------------------------------------ state
    def waiting(self) -> int:
        """Jobs queued or held for an earlier sequence number (not counting the running one)."""
        with self._cond:
            queued = sum(len(lane) for lane in self._lanes.values())
            return queued + sum(1 for h in self._held.values() for j in h.values() if j.request_id)

    def idle(self) -> bool:
        """Nothing running and nothing ready to run."""
        with self._cond:
            return self._running is None and not self._lanes and not self._cleanups

    def stop(self) -> None:
        """Let the running slice finish, then end the thread (queued jobs stay unresolved)."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self._thread.join(timeout=60)

    # ------------------------------------------------------------------ the thread
    def _next_locked(self) -> Job:
        """The next job: the head of the least served client's least served lane (module docstring)."""
        name = self._turns.pick(list(self._lanes))
        lane = self._lanes[name]
        job = lane.popleft()
        if lane:
            self._lanes.move_to_end(name)
        else:
            del self._lanes[name]
            self._turns.idle(name)
        return job

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._running = None
                while not self._lanes and not self._cleanups and not self._stopped:
                    self._cond.wait()
                if self._stopped:
                    return
                cleanups, self._cleanups = self._cleanups, []
                job = self._running = None if cleanups else self._next_locked()
                self._stop_running = None
            if job is None:
                for drop in cleanups:
                    _cleanup(drop)
                continue
            started = time.monotonic()
            step = _step(job)
            with self._cond:
                self._turns.used(job.turn_lane, job.client, time.monotonic() - started)
                stop, self._stop_running = self._stop_running, None
                if isinstance(step, Later) and stop is None:
                    job.run, job.drop = step.run, step.drop
                    # ahead of its lane's later jobs (behind them when it rotates); the lane takes
                    # its next turn after the others
                    self._enqueue_locked(job, front=not step.rotate or job.key is not None)
                    self._lanes.move_to_end(job.turn_lane)
                    continue
            if isinstance(step, Later):
                self._fail([job], stop or "dropped")
                if step.drop is not None:
                    _cleanup(step.drop)
                continue
            if isinstance(step, Failed) and job.drop is not None:  # it holds no more shared state
                _cleanup(job.drop)
            self._futures.resolve(job.request_id, step)


def _step(job: Job) -> Step | Outcome:
    try:
        return job.run()
    except UserError as err:
        return Failed(f"{job.kind}: {err}", "user")
    except Exception as err:  # a bug or a resource error: report one line, keep serving
        log.error("%s %s failed:\n%s", job.kind, job.request_id, traceback.format_exc())
        text = str(err).strip().splitlines()
        return Failed(f"{job.kind}: {type(err).__name__}: {text[0] if text else ''} (see the server log)", "server")


def _cleanup(drop: Callable[[], None]) -> None:
    """Run a dropped job's ``drop``; a failure is logged, and the worker carries on."""
    try:
        drop()
    except Exception:
        log.error("dropping a job's shared state failed:\n%s", traceback.format_exc())


def _nothing() -> Done:
    raise AssertionError("a skipped sequence number is never run")
