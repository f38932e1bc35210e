"""Batch files as a dataset: what ``harts train --data PATH...`` trains on, step by step.

Each batch file (``.jsonl`` / ``.parquet``, schema ``harts.tree.io``) is one optimizer step.
``batch_files`` turns the paths a user gives into the ordered list of files: a file stands for
itself, a directory for the batch files below it (sorted by their path inside it), a glob
pattern for its matches (sorted). ``epoch_order`` repeats that list ``epochs`` times, which is
the step order of the run: step ``i`` trains on file ``order[i]``.

No torch: the CLI lists and counts a dataset before it builds anything.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from harts.errors import UserError

if TYPE_CHECKING:
    from harts.tree.batch import RolloutBatch

__all__ = ["BATCH_SUFFIXES", "Schedule", "batch_files", "epoch_order"]

#: the file types ``RolloutBatch.load`` reads (``harts.tree.io``)
BATCH_SUFFIXES = (".jsonl", ".json", ".parquet", ".pq")


def _is_batch_file(path: str) -> bool:
    name = os.path.basename(path)
    return not name.startswith(".") and name.lower().endswith(BATCH_SUFFIXES)


def _directory_files(root: str) -> list[str]:
    """The batch files below ``root``, sorted by their path relative to it (hidden ones skipped)."""
    found: list[str] = []
    for parent, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        found.extend(os.path.join(parent, f) for f in files if _is_batch_file(f))
    return sorted(found, key=lambda p: os.path.relpath(p, root).split(os.sep))


def batch_files(paths: Sequence[str], *, option: str = "--data") -> list[str]:
    """The batch files ``paths`` name, in order (module docstring); a path may repeat.

    Raises ``UserError`` naming the first path that is missing, is not a batch file, or (a
    directory or a pattern) yields no batch file.
    """
    files: list[str] = []
    for path in paths:
        if os.path.isdir(path):
            found = _directory_files(path)
            if not found:
                raise UserError(f"{option} {path}: a directory without batch files ({', '.join(BATCH_SUFFIXES)})")
            files.extend(found)
        elif os.path.isfile(path):
            if not _is_batch_file(path):
                raise UserError(f"{option} {path}: not a batch file (use {', '.join(BATCH_SUFFIXES)})")
            files.append(path)
        elif glob.has_magic(path):
            matches = sorted(glob.glob(path, recursive=True))
            found = [m for m in matches if os.path.isfile(m) and _is_batch_file(m)]
            if not found:
                raise UserError(f"{option} {path}: the pattern matches no batch file")
            files.extend(found)
        else:
            raise UserError(f"{option} {path}: no such file or directory")
    return files


def epoch_order(num_files: int, epochs: int, steps: int | None = None) -> list[int]:
    """File index of every step: ``0 .. num_files - 1`` repeated ``epochs`` times, cut to the
    first ``steps`` steps when given. ``UserError`` when ``steps`` asks for more."""
    order = [i for _ in range(epochs) for i in range(num_files)]
    if steps is not None:
        if steps > len(order):
            raise UserError(
                f"--steps {steps}: the data gives {len(order)} steps ({num_files} batch file(s) x {epochs} "
                "epoch(s)); raise --epochs or drop --steps"
            )
        order = order[:steps]
    return order


@dataclass
class Schedule:
    """The steps of a training run: ``order[i]`` is the index into ``sources`` of step ``i``'s
    batch; each source is read (and checked) once, however often the epochs repeat it."""

    sources: list[tuple[str, Callable[[], RolloutBatch]]]
    order: list[int]
    #: what the steps are, for the run's first line (e.g. "3 batch files x 2 epochs = 6 steps")
    description: str
    #: the batch files of ``--data`` (None for a workload)
    files: list[str] | None = None

    def epoch(self, step: int) -> int:
        """The epoch (from 0) step ``step`` belongs to."""
        return step // len(self.sources)
