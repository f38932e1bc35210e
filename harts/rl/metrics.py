"""Per-step metrics of a run: ``RUN_DIR/metrics.jsonl``, and TensorBoard when it is installed.

``MetricsWriter(run_dir)`` appends one JSON object per step to ``metrics.jsonl`` (flushed at
once, so a crash or Ctrl-C keeps every finished step) and, with ``tensorboard=True`` and
``torch.utils.tensorboard`` importable, writes every numeric field as a scalar too; with
``wandb="PROJECT"`` (the ``wandb`` package, ``pip install harts[all]``) it logs them to that
Weights & Biases project as well.
``read_metrics(run_dir)`` reads a run back (``harts plot``); ``truncate_metrics(run_dir, n)``
drops the records of steps ``>= n`` (a resumed run continues after its checkpoint's step).

A write that fails (a full disk) is an ``OutputPathError`` naming ``metrics.jsonl``
(``harts.outputs.writing``): the command stops with that line.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any

from harts.errors import UserError
from harts.outputs import writing

__all__ = [
    "METRICS_FILE",
    "MetricsWriter",
    "read_metrics",
    "tensorboard_available",
    "truncate_metrics",
    "wandb_available",
]

METRICS_FILE = "metrics.jsonl"


def tensorboard_available() -> bool:
    """Whether ``torch.utils.tensorboard`` imports (it needs the ``tensorboard`` package)."""
    try:
        import torch.utils.tensorboard  # noqa: F401
    except ImportError:
        return False
    return True


def wandb_available() -> bool:
    """Whether the ``wandb`` package imports."""
    try:
        import wandb  # noqa: F401
    except ImportError:
        return False
    return True


class MetricsWriter:
    """Appends step records to ``run_dir/metrics.jsonl`` (and TensorBoard / W&B, see module
    docstring); ``config``: the run's settings, given to W&B as its run config."""

    def __init__(
        self,
        run_dir: str,
        *,
        tensorboard: bool = False,
        wandb: str | None = None,
        config: dict[str, Any] | None = None,
    ) -> None:
        self.path = os.path.join(run_dir, METRICS_FILE)
        with writing(self.path):
            os.makedirs(run_dir, exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (closed in close())
        #: a write failed: what is left in the file's buffer cannot be written either
        self._failed = False
        self._tb: Any = None
        self._wandb: Any = None
        if tensorboard and tensorboard_available():
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=os.path.join(run_dir, "tensorboard"))
        if wandb is not None:
            import wandb as wandb_module

            self._wandb = wandb_module.init(project=wandb, dir=run_dir, config=config or {})

    @property
    def tensorboard(self) -> bool:
        return self._tb is not None

    def write(self, record: dict[str, Any]) -> None:
        """One step's record; ``record["step"]`` is the x axis."""
        with writing(self.path):
            try:
                self._file.write(json.dumps(record) + "\n")
                self._file.flush()
            except OSError:
                self._failed = True
                raise
        scalars = {
            key: value
            for key, value in record.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "step"
        }
        if self._tb is not None:
            for key, value in scalars.items():
                self._tb.add_scalar(key, value, record["step"])
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(scalars, step=record["step"])

    def close(self) -> None:
        # after a failed write, closing fails on the same buffer: that error was raised already
        with contextlib.suppress(OSError) if self._failed else writing(self.path):
            self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_metrics(run_dir: str) -> list[dict[str, Any]]:
    """The step records of ``run_dir`` in file order; UserError naming the file and line when
    the directory has no metrics or a line is not JSON."""
    path = os.path.join(run_dir, METRICS_FILE)
    if not os.path.isfile(path):
        raise UserError(
            f"{run_dir}: no {METRICS_FILE} here (a run directory of 'harts demo', or of 'harts train --run-dir'?)"
        )
    records = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise UserError(f"{path}, line {i}: not JSON ({err.msg})") from None
    if not records:
        raise UserError(f"{path}: no steps recorded")
    return records


def truncate_metrics(run_dir: str, steps: int) -> int:
    """Keep the records of steps ``0 .. steps - 1`` in ``run_dir/metrics.jsonl`` (rewritten
    atomically: written aside, then renamed); returns how many were dropped. A run that died
    after its last checkpoint had written rows for steps the resumed run computes again."""
    path = os.path.join(run_dir, METRICS_FILE)
    if not os.path.isfile(path):
        return 0
    with open(path, encoding="utf-8") as f:
        lines = [line for line in f if line.strip()]
    # a last line cut off mid-write (the process was killed) is not JSON: it is dropped too
    keep = []
    for line in lines:
        try:
            if json.loads(line)["step"] < steps:
                keep.append(line if line.endswith("\n") else line + "\n")
        except (json.JSONDecodeError, KeyError, TypeError):
            continue
    if len(keep) == len(lines):
        return 0
    tmp = path + ".tmp"
    with writing(path):
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                f.writelines(keep)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    return len(lines) - len(keep)
