"""Ranks that agree on a user error: one rank's refusal becomes every rank's, at the same point.

Under torchrun a rank that raises alone leaves the others waiting in their next collective (a
broadcast of weights that never comes, a barrier) until the launcher kills them, each with a
traceback of its own. Where only some ranks can see a problem (rank 0 reads a checkpoint; each
rank writes its shards), every rank calls ``agree(problem)`` at the same point instead: a
collective that returns the first rank's problem to all of them (None when none has one), marked
``every_rank`` so that the CLI prints it once, from rank 0.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from harts.errors import DamagedCheckpoint, OutputPathError, UserError

__all__ = ["agree"]

#: the error types ``agree`` keeps (any other user error arrives as a ``UserError``)
_KINDS: dict[str, type[UserError]] = {cls.__name__: cls for cls in (UserError, DamagedCheckpoint, OutputPathError)}


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def agree(problem: UserError | None) -> UserError | None:
    """The first rank's ``problem`` on every rank (None when no rank has one); every rank must
    call it (one collective; nothing on one process, where ``problem`` comes back as it is)."""
    if _world() == 1:
        return problem
    mine = None if problem is None else (type(problem).__name__, str(problem))
    every: list[Any] = [None] * _world()
    dist.all_gather_object(every, mine)
    for found in every:
        if found is not None:
            kind, text = found
            err = _KINDS.get(kind, UserError)(text)
            err.every_rank = True
            return err
    return None
