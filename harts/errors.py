"""The errors harts raises for bad input, at the bottom of the package (imports nothing of harts).

Every error a user can cause by what they pass in -- a malformed batch or tree file, an option
out of range, a device that does not exist, an output path that cannot be written -- is a
``UserError``; its message names the offending item (file, record, field, option) and says what
to do instead. The ``harts`` command prints ``harts: error: <message>`` for these and exits with
status 2, without a traceback (``HARTS_DEBUG=1`` shows it). Any other exception is a bug of
ours and keeps its traceback (exit status 1).

``UserError`` derives from ``ValueError`` so that code written against the older
``ValueError``-based errors keeps working. The Python API raises the same types: a bad
``HybridConfig`` field, a damaged checkpoint, an unwritable output path are ``UserError``s there
too.

Hierarchy::

    HartsError
     └── UserError (ValueError)
          ├── BatchValidationError    a rollout batch, rollout tree or batch file is malformed
          ├── TreeFileError           a TREE.json segment file is malformed
          ├── CapacityError           a trajectory does not fit the microbatch capacity
          ├── OutputPathError         an output path cannot be written, or would be overwritten
          ├── DamagedCheckpoint       a checkpoint file is missing, truncated or garbled
          └── DivergenceError         a training step's loss or gradient norm is not finite
"""

from __future__ import annotations

__all__ = [
    "HartsError",
    "UserError",
    "BatchValidationError",
    "TreeFileError",
    "CapacityError",
    "OutputPathError",
    "DamagedCheckpoint",
    "DivergenceError",
]


class HartsError(Exception):
    """Base class of every exception harts raises on purpose."""


class UserError(HartsError, ValueError):
    """Bad input or options; the message names the item and the fix (the CLI exits 2).

    Its text is one line: a message that quotes another library's error (which may span several
    lines) is joined into one, so that the CLI's ``harts: error: ...`` stays a single line.

    ``every_rank``: under torchrun, every rank raised this same error (the ranks agreed on it, as
    a checkpoint's loading does), so the CLI prints it from rank 0 alone: one line, not one a rank.
    """

    every_rank: bool = False

    def __str__(self) -> str:
        text = super().__str__()
        if "\n" not in text:
            return text
        return " ".join(part.strip() for part in text.splitlines() if part.strip())


class BatchValidationError(UserError):
    """A rollout batch or tree is malformed; the message names the offending item."""


class TreeFileError(UserError):
    """A TREE.json segment file is malformed; the message names the offending segment."""


class CapacityError(UserError):
    """A trajectory is longer than the microbatch capacity (the message suggests one that fits)."""


class OutputPathError(UserError):
    """An output path is not writable, is the wrong kind of file, or exists (without --overwrite)."""


class DamagedCheckpoint(UserError):
    """A checkpoint file is missing, truncated, garbled or holds something harts never writes (a
    pickle); the message names the file and the checkpoint to use instead."""


class DivergenceError(UserError):
    """A training step's loss or gradient norm is not finite (a learning rate too high, data
    with huge advantages or weights). The step is refused before its update: the weights and the
    optimizer state stay as they were before it, and the message names the step."""
