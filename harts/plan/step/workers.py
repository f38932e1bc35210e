"""Worker processes for the step planner: its independent candidates built side by side.

Most of ``plan_step``'s time goes to independent numpy work: the greedy pass's four processing
orders, the converged repair of the deep candidates, and the polish of the winner
(``planner.py``): under cProfile most of a large step's planning time, and in ``harts bench``
and ``harts train`` with ``--no-prefetch`` that time stands between the rollouts and the first
microbatch.

``PlannerWorkers`` keeps a few spawned processes for that (numpy only: no torch, no CUDA, so
they are safe beside a process that holds a GPU; ``spawn`` never forks a CUDA context), started
once and reused for every step. ``plan_step(..., workers=w)`` hands them the greedy orders,
then each deep candidate's repair *and* polish, and the polish of the best other candidate,
so whichever candidate wins, its polish is already running: the critical path is one greedy
order, the base candidates, and one deep repair plus one polish. The plan is the one
``plan_step`` makes without workers, bit for bit (every task is the same deterministic
function of the same inputs; ``tests/plan/step/test_planner_workers.py``).

Without workers every task runs inline, and only when its result is asked for, so the serial
planner does exactly the work it always did. If a worker process dies, its tasks are
recomputed inline with a warning, and later tasks run inline.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import signal
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Generic, TypeVar

__all__ = ["PlannerWorkers", "Task", "auto_workers", "completed", "run_inline", "shared_workers"]

T = TypeVar("T")

#: below this many trajectories a step is planned in the calling process: handing tasks to the
#: workers costs more than it saves on small steps (``medium``'s 389 paths planned slower with
#: workers, ``swe``'s 1,417-2,364 faster: ``benchmarks/results/ling3-tiny_h200_2026-12-02_planner-workers.md``)
MIN_PATHS = 1000


def _init_worker() -> None:
    """Worker initializer: ignore Ctrl-C (it reaches the whole process group; the parent decides
    what stops, and closes the pool). The planner's modules are in place before the first task
    without naming them here (the planner imports this module): a spawned worker unpickles this
    function, which imports ``harts.plan.step``, whose ``__init__`` imports the planner."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _sigint_handler() -> object:
    return signal.getsignal(signal.SIGINT)


def _ready() -> float:
    # a task that every worker runs once at start, so that all of them are spawned and imported
    time.sleep(0.05)
    return time.perf_counter()


class Task(Generic[T]):
    """The result of ``fn(*args)``: computed by a worker, or inline when first asked for."""

    def __init__(self, fn: Callable[..., T], args: tuple, future: Future | None, owner: PlannerWorkers | None) -> None:
        self._fn, self._args, self._future, self._owner = fn, args, future, owner
        self._value: T
        self._done = False

    def result(self) -> T:
        if not self._done:
            if self._future is None:
                self._value = self._fn(*self._args)
            else:
                try:
                    self._value = self._future.result()
                except BrokenProcessPool as err:
                    if self._owner is not None:
                        self._owner._broken(err)
                    self._value = self._fn(*self._args)
            self._done = True
            self._args = ()
        return self._value


def run_inline(fn: Callable[..., T], *args: Any) -> Task[T]:
    """``fn(*args)`` as a lazy inline ``Task`` (the planner without workers)."""
    return Task(fn, args, None, None)


def completed(value: T) -> Task[T]:
    """A ``Task`` whose result is ``value``."""
    task: Task[T] = Task(_identity, (value,), None, None)
    return task


def _identity(value: T) -> T:
    return value


class PlannerWorkers:
    """A pool of ``processes`` spawned planner processes, reused across ``plan_step`` calls.

    Start it once, early (spawning and importing numpy take a few tenths of a second, which
    then overlap model building), and pass it to every ``plan_step``; ``close()`` it (or use it
    as a context manager) at the end. Four processes cover the planner's widest stage (four
    greedy orders; four polish chains).
    """

    def __init__(self, processes: int = 4, *, min_paths: int | None = None) -> None:
        if isinstance(processes, bool) or not isinstance(processes, int) or processes < 1:
            raise ValueError(f"planner worker processes must be a positive integer; got {processes!r}")
        if min_paths is not None and (isinstance(min_paths, bool) or not isinstance(min_paths, int) or min_paths < 0):
            raise ValueError(f"min_paths must be an integer >= 0 or None; got {min_paths!r}")
        self.processes = processes
        self._min_paths = min_paths
        self._pool: ProcessPoolExecutor | None = ProcessPoolExecutor(
            processes, mp_context=multiprocessing.get_context("spawn"), initializer=_init_worker
        )
        # submitted together, before any finishes: each submit finds no idle worker and spawns one
        self._warm = [self._pool.submit(_ready) for _ in range(processes)]

    @property
    def min_paths(self) -> int:
        """Steps with fewer trajectories are planned in the calling process (default ``MIN_PATHS``)."""
        return MIN_PATHS if self._min_paths is None else self._min_paths

    def used_for(self, paths: int) -> bool:
        """Whether a step of ``paths`` trajectories is planned with the workers."""
        return self._pool is not None and paths >= self.min_paths

    @property
    def active(self) -> bool:
        """Whether tasks go to worker processes (False after ``close`` or a dead worker)."""
        return self._pool is not None

    def wait_ready(self, timeout: float | None = None) -> None:
        """Block until every worker has started and imported the planner (at most ``timeout`` s)."""
        for fut in self._warm:
            try:
                fut.result(timeout=timeout)
            except BrokenProcessPool as err:
                self._broken(err)
                return

    def submit(self, fn: Callable[..., T], *args: Any) -> Task[T]:
        """Run ``fn(*args)`` in a worker (``fn`` a module-level function, arguments picklable);
        inline, lazily, once the pool is closed or broken."""
        if self._pool is None:
            return run_inline(fn, *args)
        try:
            return Task(fn, args, self._pool.submit(fn, *args), self)
        except (BrokenProcessPool, RuntimeError) as err:
            # RuntimeError: the interpreter is shutting down, or the pool was shut down
            self._broken(err)
            return run_inline(fn, *args)

    def _broken(self, err: BaseException) -> None:
        if self._pool is None:
            return
        warnings.warn(
            f"a step-planner worker process failed ({type(err).__name__}: {err}); planning continues in this process",
            RuntimeWarning,
            stacklevel=3,
        )
        pool, self._pool = self._pool, None
        pool.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        """Stop the worker processes; later tasks run inline."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> PlannerWorkers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"PlannerWorkers(processes={self.processes}, active={self.active})"


#: ``shared_workers``' pools, by process count; closed at exit
_SHARED: dict[int, PlannerWorkers] = {}


def shared_workers(processes: int) -> PlannerWorkers | None:
    """This process's pool of ``processes`` planner workers, started on first use and kept
    until exit (``TrainConfig.planner_workers`` and the commands use it); None for 0."""
    if isinstance(processes, bool) or not isinstance(processes, int) or processes < 0:
        raise ValueError(f"planner worker processes must be an integer >= 0; got {processes!r}")
    if processes == 0:
        return None
    workers = _SHARED.get(processes)
    if workers is None or not workers.active:
        workers = _SHARED[processes] = PlannerWorkers(processes)
    return workers


def auto_workers() -> int:
    """The default worker count: 4 where at least 6 cores are usable (the planner's widest stage
    has four tasks, and the main process and torch keep theirs), else 0 (serial)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return 4 if cores >= 6 else 0


@atexit.register
def _close_shared() -> None:
    for workers in _SHARED.values():
        workers.close()
    _SHARED.clear()
