"""``--resume auto`` for the commands that checkpoint (``harts train``, ``harts demo``).

``--resume RUN_DIR`` continues RUN_DIR from its newest checkpoint, and a damaged one is an error
naming the file and the checkpoint before it. ``--resume auto`` (with ``--run-dir RUN_DIR``, or
the command's default run directory) is the form a restarted job repeats unchanged: it continues
RUN_DIR from its newest checkpoint that loads, passing over damaged newer ones with a warning,
and starts a new run in RUN_DIR when there is none yet (an existing non-empty RUN_DIR then
needs ``--overwrite``, as for any new run). A new run into a RUN_DIR that holds a checkpoint is
refused with the ``--resume auto`` command that continues it (``refuse_second_run``).

Import-light (no torch): ``harts.parallel.checkpoint`` is imported only when ``auto`` is given.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

__all__ = ["AUTO", "check_resumed_run", "refuse_second_run", "resolve_resume"]

AUTO = "auto"


def resolve_resume(args: argparse.Namespace, subdirs: tuple[str, ...] = ("",), default: str | None = None) -> None:
    """Turn ``--resume auto`` into ``--resume RUN_DIR`` (a checkpoint to continue) or ``--run-dir
    RUN_DIR`` (a new run), and set ``args.resume_auto`` (load with ``fallback=True``).

    ``subdirs``: the runs inside RUN_DIR (``harts demo --mode both`` keeps one per mode); any of
    them with a checkpoint makes it a resumed run. ``default``: RUN_DIR without ``--run-dir``.
    """
    from harts.errors import UserError

    args.resume_auto = args.resume == AUTO
    if not args.resume_auto:
        return
    run_dir = args.run_dir or default
    if run_dir is None:
        raise UserError("--resume auto needs --run-dir DIR: the run to continue, or to start when it has no checkpoint")
    from harts.parallel.checkpoint import checkpoints

    if any(checkpoints(os.path.join(run_dir, d)) for d in subdirs):
        args.resume, args.run_dir = run_dir, None
    else:
        args.resume, args.run_dir = None, run_dir


def refuse_second_run(args: argparse.Namespace, command: str, flags: str, subdirs: tuple[str, ...] = ("",)) -> None:
    """A new run of ``harts command`` into a ``--run-dir`` that holds a checkpoint (in one of its
    ``subdirs``), without ``--overwrite``, is refused with the command that continues it
    (``flags``: what it repeats beside ``--resume auto``, e.g. `` --run-dir DIR``): running the
    command again is most often meant to train the run further, which ``--overwrite`` throws away."""
    from harts.errors import OutputPathError
    from harts.parallel.checkpoint import latest_checkpoint

    if args.resume or args.overwrite or not args.run_dir:
        return
    found = [c for c in (latest_checkpoint(os.path.join(args.run_dir, d)) for d in subdirs) if c is not None]
    if found:
        raise OutputPathError(
            f"--run-dir {args.run_dir}: holds a {command} run (checkpoint {found[0]}); continue it with: harts "
            f"{command} --resume auto{flags} --steps N (N more than the steps it completed, and the same flags), "
            "or pass --overwrite to start a new run there"
        )


def check_resumed_run(resume: str, ckpt: Any, saved: dict[str, Any], command: str, identity: dict[str, Any]) -> None:  # noqa: ANN401
    """UserError unless checkpoint ``ckpt`` (``saved``: the ``extra`` it was saved with) was written
    by ``harts command`` with the flags of ``identity`` (``check_same_run``). ``harts train``'s
    checkpoints carry no ``command``."""
    from harts.commands._runs import check_same_run
    from harts.errors import UserError

    writer = saved.get("command", "train")
    if writer != command:
        raise UserError(
            f"--resume {resume}: {ckpt} was written by harts {writer}, not by harts {command}; continue it with "
            f"harts {writer} --resume"
        )
    check_same_run(resume, saved, identity)
