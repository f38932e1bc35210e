"""A training run's resumable checkpoints in its run directory (``harts.parallel.checkpoint``).

``RunCheckpoints(run_dir, identity)`` saves the model, the optimizer and the data position
(``next_step``, and the step plan's ``replicas``) with the run's ``identity`` (what a resumed run
must match: the data, seed, model, mode, optimizer settings, ...), and ``resume`` loads the
newest one: with ``fallback`` (``--resume auto``) the newest one that loads, passing over damaged
newer ones with a warning. ``check(path, saved, identity)`` sees every candidate's saved
identity before any weight is read and raises to refuse it (``harts train`` names the flag that
differs).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from harts.errors import UserError
from harts.parallel.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint

__all__ = ["RunCheckpoints"]


def _rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


class RunCheckpoints:
    """The checkpoints of one run (module docstring); ``run_dir`` None: none are written."""

    def __init__(
        self,
        run_dir: str | None,
        identity: dict[str, Any],
        *,
        fallback: bool = False,
        check: Callable[[Any, dict[str, Any], dict[str, Any]], None] | None = None,
        replicas: int | None = None,
    ) -> None:
        self.run_dir = run_dir
        self.identity = identity
        self.fallback = fallback
        self.check = check
        #: the step plan's replicas, saved beside ``next_step`` (a resumed run may change them)
        self.replicas = replicas
        #: the completed steps of the newest checkpoint written or loaded (-1: none)
        self.saved_step = -1
        #: the replicas of the run ``resume`` continued (None: no checkpoint, or one without them)
        self.resumed_replicas: int | None = None

    def resume(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, num_steps: int) -> int:
        """Load the newest checkpoint into ``model`` and ``optimizer``; returns the first step to
        run (0 without one). UserError when it completed more than ``num_steps`` steps."""
        if self.run_dir is None or latest_checkpoint(self.run_dir) is None:
            return 0
        check = self.check
        got = load_checkpoint(
            self.run_dir,
            model=model,
            optimizer=optimizer,
            fallback=self.fallback,
            check=None if check is None else lambda saved: check(saved.path, saved.extra, self.identity),
        )
        for line in got.skipped if _rank0() else ():
            print(f"harts: warning: {line}", file=sys.stderr, flush=True)
        nxt = int(got.data_state["next_step"])
        if nxt > num_steps:
            raise UserError(f"--resume {self.run_dir}: it completed {nxt} steps, more than the {num_steps} asked for")
        self.saved_step = nxt
        replicas = got.data_state.get("replicas")
        self.resumed_replicas = replicas if isinstance(replicas, int) else None
        return nxt

    def save(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, next_step: int) -> None:
        """Checkpoint after ``next_step`` completed steps (every rank calls this; once per step)."""
        if self.run_dir is None or next_step == self.saved_step:
            return
        path = save_checkpoint(
            self.run_dir,
            step=next_step,
            model=model,
            optimizer=optimizer,
            data_state={"next_step": next_step, "replicas": self.replicas},
            extra=self.identity,
        )
        self.saved_step = next_step
        if _rank0():
            print(f"checkpoint {path}", file=sys.stderr, flush=True)
