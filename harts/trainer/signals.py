"""SIGINT / SIGTERM during a run: stop after the last completed step, never halfway through an
update.

``Signals`` raises ``Interrupted`` inside its ``window()`` blocks (the slow, abandonable parts:
reading and checking the steps, building the model, computing a step's gradients) and only
records a signal outside them (progress bookkeeping, printing, the optimizer update, saving),
to act on it when the next window opens. Standard library only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

__all__ = ["Interrupted", "Signals"]


class Interrupted(BaseException):
    """Raised by the signal handler (a BaseException, so no ``except Exception`` swallows it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class Signals:
    """SIGINT/SIGTERM: raise ``Interrupted`` inside a ``window()``, else remember for later.

    Outside the windows (progress-bar bookkeeping, printing, the optimizer update, saving) a
    signal is only recorded and acted on when the next window opens, so it never lands halfway
    through a tqdm call or a weight update. The windows cover the slow parts: reading and
    checking the steps, building the model, and computing each step's gradients.
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self.interruptible = False
        self._previous: dict[int, Any] = {}

    def handler(self, signum: int, frame: object) -> None:  # noqa: ARG002
        if self.signum is None:
            self.signum = signum
            if self.interruptible:
                raise Interrupted(signum)

    def install(self) -> None:
        import signal
        import threading

        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self.handler)

    def restore(self) -> None:
        import signal

        for sig, prev in self._previous.items():
            signal.signal(sig, prev)
        self._previous.clear()

    def check(self) -> None:
        """Become interruptible; a signal that arrived while we were not is acted on now."""
        self.interruptible = True
        if self.signum is not None:
            raise Interrupted(self.signum)

    def defer(self) -> None:
        self.interruptible = False

    @contextlib.contextmanager
    def window(self) -> Iterator[None]:
        """Interruptible inside the block (a signal recorded earlier is raised on entry)."""
        self.check()
        try:
            yield
        finally:
            self.interruptible = False
