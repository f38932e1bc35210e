"""Run-directory plumbing shared by ``harts train`` and ``harts demo``: the ``--run-dir`` /
``--resume`` / ``--save-every`` checks, and checking that a resumed run is the run its
checkpoint came from. Stopping on SIGINT / SIGTERM after the last completed step is
``harts.trainer.signals`` (``Signals``, ``Interrupted``; imported from here too).

Import-light (no torch): the commands import it at module level and ``--help`` stays instant.
"""

from __future__ import annotations

import argparse
from typing import Any

from harts.trainer.signals import Interrupted, Signals

__all__ = ["Interrupted", "Signals", "check_run_dir", "check_same_run"]


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
    """UserError naming the first setting whose value differs between the checkpoint's run
    (``saved``, the ``extra`` it was saved with) and this command (``wanted``), in one line.

    A key of ``wanted`` is a flag's name (``capacity`` is ``--capacity``); a dict value is a group
    of settings that no flag sets (``AdamW``: the optimizer's betas, eps, ...), each compared and
    named as ``AdamW.eps``. A key the checkpoint does not record (an older harts wrote it) is
    refused too: the run it would continue is unknown.
    """
    from harts.errors import UserError

    for key, want in wanted.items():
        if isinstance(want, dict):
            had_group = saved.get(key)
            for sub, sub_want in want.items():
                name = f"{key}.{sub}"
                if not isinstance(had_group, dict) or sub not in had_group:
                    raise UserError(
                        f"--resume {run_dir}: the checkpoint does not record {name} (an older harts wrote it), "
                        f"this command uses {sub_want}; start a new run"
                    )
                if had_group[sub] != sub_want:
                    raise UserError(
                        f"--resume {run_dir}: the run used {name} {had_group[sub]}, this command {name} {sub_want}; "
                        "no flag sets it: only code that uses the run's setting can continue it"
                    )
            continue
        if key not in saved and key == "model-config":
            raise UserError(
                f"--resume {run_dir}: the checkpoint does not record its model configuration's digest (an older "
                "harts wrote it); start a new run"
            )
        if key not in saved:
            raise UserError(
                f"--resume {run_dir}: the checkpoint does not record --{key} (an older harts wrote it), this "
                f"command --{key} {want}; start a new run"
            )
        had = saved[key]
        if had != want and key == "model-config":
            raise UserError(
                f"--resume {run_dir}: the run's model configuration (digest {had}) differs from this command's "
                f"(digest {want}): the --model checkpoint's config.json or the preset changed; restore it or "
                "start a new run"
            )
        if had != want:
            raise UserError(
                f"--resume {run_dir}: the run used --{key} {had}, this command --{key} {want}; "
                f"pass --{key} {had} to continue it"
            )
