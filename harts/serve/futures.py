"""The server's futures: one record per accepted request, resolved exactly once.

Tinker's protocol is asynchronous: a request that does work (``forward_backward``,
``optim_step``, ``asample``, ...) is answered at once with a ``request_id``, and the client
polls ``/api/v1/retrieve_future`` until the result is there. ``FutureStore`` holds those
records. A record is resolved exactly once, by the worker thread, with the encoded result
(``Done``) or an error (``Failed``); a second resolution is a bug and raises. Retrieving
does not consume a record: a client that lost the answer to a poll (a dropped connection, a
timeout) polls again and gets the same bytes. Retrieved records are dropped a while later
(``keep_seconds``); unretrieved ones stay until ``max_records`` forces the oldest out, so a
client that disconnects and comes back still finds what was computed for it.

``wait`` is the long poll: it returns as soon as the record resolves or after ``timeout``
seconds, whichever is first, without blocking the event loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field

__all__ = ["Done", "Failed", "FutureStore", "Outcome"]


@dataclass(frozen=True, slots=True)
class Done:
    """A finished request: its response body and media type, ready to send."""

    body: bytes
    media_type: str


@dataclass(frozen=True, slots=True)
class Failed:
    """A failed request: a one-line message and Tinker's error category ("user" or "server")."""

    message: str
    category: str = "user"


Outcome = Done | Failed


@dataclass(slots=True)
class _Record:
    kind: str
    created: float
    #: the tenant whose request it is (None: anyone's)
    tenant: str | None = None
    future: concurrent.futures.Future[Outcome] = field(default_factory=concurrent.futures.Future)
    retrieved_at: float | None = None


class FutureStore:
    """Request records by id (module docstring). Thread-safe: the event loop creates and
    polls records, the worker thread resolves them."""

    def __init__(self, *, keep_seconds: float = 600.0, max_records: int = 100_000) -> None:
        self._lock = threading.Lock()
        self._records: OrderedDict[str, _Record] = OrderedDict()
        self._keep_seconds = keep_seconds
        self._max_records = max_records

    def create(self, kind: str, tenant: str | None = None) -> str:
        """A new pending record for a request of ``kind`` (e.g. ``"ForwardBackward"``) of
        ``tenant``; its id."""
        request_id = uuid.uuid4().hex
        with self._lock:
            self._prune_locked()
            self._records[request_id] = _Record(kind=kind, created=time.monotonic(), tenant=tenant)
        return request_id

    def resolve(self, request_id: str, outcome: Outcome) -> None:
        """Resolve a pending record; resolving one twice raises (``InvalidStateError``)."""
        with self._lock:
            record = self._records.get(request_id)
        if record is None:  # forced out by max_records before the work finished
            return
        record.future.set_result(outcome)

    def kind(self, request_id: str, tenant: str | None = None) -> str | None:
        """The kind of a known request, else None (also for another tenant's when ``tenant`` is given)."""
        with self._lock:
            record = self._records.get(request_id)
        if record is None or (tenant is not None and record.tenant is not None and record.tenant != tenant):
            return None
        return record.kind

    async def wait(self, request_id: str, timeout: float, tenant: str | None = None) -> Outcome | None:
        """The outcome of a known request once it is resolved, or None after ``timeout`` seconds.

        Raises ``KeyError`` for an unknown (or long-retrieved) request id, and for another
        tenant's when ``tenant`` is given (as unknown: its ids do not leak)."""
        with self._lock:
            record = self._records[request_id]
        if tenant is not None and record.tenant is not None and record.tenant != tenant:
            raise KeyError(request_id)
        if not record.future.done() and timeout > 0:
            await asyncio.wait([asyncio.wrap_future(record.future)], timeout=timeout)
        if not record.future.done():
            return None
        with self._lock:
            if record.retrieved_at is None:
                record.retrieved_at = time.monotonic()
        return record.future.result()

    def pending(self) -> int:
        """How many records are not resolved yet."""
        with self._lock:
            return sum(1 for r in self._records.values() if not r.future.done())

    def _prune_locked(self) -> None:
        now = time.monotonic()
        stale = [
            rid
            for rid, r in self._records.items()
            if r.retrieved_at is not None and now - r.retrieved_at > self._keep_seconds
        ]
        for rid in stale:
            del self._records[rid]
        while len(self._records) >= self._max_records:
            self._records.popitem(last=False)
