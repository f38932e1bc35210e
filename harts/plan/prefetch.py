"""Host preparation of a step's microbatches one ahead, on a background thread.

A microbatch's host inputs (its slice of the step's compaction, its call plan, its layout and
its LM head's index: ``StepPlan.prepare_microbatch`` then ``HybridLM.prepare_compact``) are
numpy work of a few to a few tens of milliseconds per microbatch. Made in the training thread
right before the microbatch runs, they sit on the critical path whenever the device drains its
launch queue faster than that: the host can only queue about a thousand kernels ahead of the
device, so after launching microbatch k's backward it is never far ahead. ``Prefetched``
prepares microbatch k + 1 on one background thread while the training thread launches k (torch
releases the GIL inside its operators, and the autograd engine runs the backward in its own
threads; numpy releases it in its array loops).

    for inputs in Prefetched([partial(prepare, k) for k in mine]):
        run(inputs)

The items come out in order, each exactly what calling its function in the training thread
gives. An exception raised by a preparation is raised where its item is taken, with its
traceback. Besides what the caller still references (a ``for`` loop's variables keep item k
until item k + 1 is taken), the host holds one item: the one being prepared.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic, TypeVar

T = TypeVar("T")


class Prefetched(Generic[T]):
    """Iterate over ``fn()`` for each of ``prepare`` (in order), computing item k + 1 on a
    background thread while the caller works on item k. ``waited``: seconds the caller spent
    waiting for items (the preparation not hidden behind its work; the first item's included).
    ``ahead=False`` calls each function in the caller's thread when its item is taken (the
    reference order of work, for tests and comparisons)."""

    def __init__(self, prepare: Sequence[Callable[[], T]], *, ahead: bool = True) -> None:
        self._prepare = list(prepare)
        self._ahead = ahead
        self.waited = 0.0

    def __len__(self) -> int:
        return len(self._prepare)

    def __iter__(self) -> Iterator[T]:
        if not self._ahead or len(self._prepare) < 2:
            for fn in self._prepare:
                t0 = time.perf_counter()
                item = fn()
                self.waited += time.perf_counter() - t0
                yield item
            return
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="harts-prepare")
        try:
            pending: Future[T] = pool.submit(self._prepare[0])
            for k in range(len(self._prepare)):
                t0 = time.perf_counter()
                item = pending.result()
                self.waited += time.perf_counter() - t0
                if k + 1 < len(self._prepare):
                    pending = pool.submit(self._prepare[k + 1])
                yield item
                del item  # the caller's copy is all that keeps it
        finally:
            # an abandoned iteration (an exception in the caller) drops the one item in flight
            pool.shutdown(wait=False, cancel_futures=True)
