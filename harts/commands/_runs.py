"""Run-directory plumbing shared by ``harts train`` and ``harts demo``: stopping on SIGINT /
SIGTERM after the last completed step, the ``--run-dir`` / ``--resume`` / ``--save-every``
checks, and checking that a resumed run is the run its checkpoint came from.

Import-light (no torch): the commands import it at module level and ``--help`` stays instant.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator
from typing import Any

__all__ = ["Interrupted", "Signals", "check_run_dir", "check_same_run"]


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


def check_run_dir(args: argparse.Namespace, subdirs: tuple[str, ...] = ("",)) -> None:
    """``--run-dir`` is writable (not an existing run without ``--overwrite``); ``--resume`` holds a
    checkpoint (in one of its ``subdirs`` at least: ``harts demo --mode both`` keeps one run per
    mode); ``--save-every`` has a directory to write to."""
    import os

    from harts.commands._inputs import check_output_dir
    from harts.errors import UserError
    from harts.parallel.checkpoint import latest_checkpoint

    if args.run_dir and args.resume:
        raise UserError("--run-dir and --resume both name the run directory; give one (--resume continues it)")
    if args.save_every and not (args.run_dir or args.resume):
        raise UserError("--save-every needs a run directory: --run-dir DIR (or --resume DIR)")
    check_output_dir(args.run_dir, "--run-dir", args.overwrite)
    if args.resume and all(latest_checkpoint(os.path.join(args.resume, d)) is None for d in subdirs):
        where = " or ".join(os.path.join(args.resume, d, "checkpoints") for d in subdirs)
        raise UserError(f"--resume {args.resume}: no complete checkpoint under {where}")


def check_same_run(run_dir: str, saved: dict[str, Any], wanted: dict[str, Any]) -> None:
    """UserError naming the first flag whose value differs between the checkpoint's run (``saved``,
    the ``extra`` it was saved with) and this command (``wanted``); keys are flag names."""
    from harts.errors import UserError

    for key, want in wanted.items():
        had = saved.get(key)
        if had != want:
            raise UserError(
                f"--resume {run_dir}: the run used --{key} {had}, this command --{key} {want}; "
                f"pass --{key} {had} to continue it"
            )
