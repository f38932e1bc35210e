"""Resumable, sharded training checkpoints with ``torch.distributed.checkpoint`` (DCP).

API (what a training loop calls; works on one process without a process group, and on any
number of ranks, every rank calling each function)::

    path = save_checkpoint(run_dir, step=s, model=model, optimizer=opt, scheduler=None,
                           data_state={"next_step": s}, extra={"workload": ...})
    ckpt = latest_checkpoint(run_dir)          # Path of the newest complete checkpoint, or None
    state = load_checkpoint(ckpt or run_dir, model=model, optimizer=opt, scheduler=None)
    state.step, state.data_state, state.extra  # continue from here

Layout of one checkpoint, ``RUN_DIR/checkpoints/step-00000005/``::

    dcp/            model + optimizer state, sharded: each rank writes its own shards (FSDP2
                    DTensors, expert blocks); DCP reshards on load, so a checkpoint saved on N
                    ranks loads on M (or on one process, and back)
    meta.pt         step, data_state, extra, scheduler state, world size at save, and every
                    model buffer (the MoE expert bias is a buffer, also when not persistent:
                    the loop updates it, so a resumed run needs it)
    rng/rank{r}.pt  RNG states of rank r: python, numpy, torch CPU, CUDA (when available)
    hf/             only for a model loaded from a transformers checkpoint: the weights gathered
                    from the shards as a checkpoint transformers, ``harts convert`` and
                    ``--model`` load (``save_hf_checkpoint``)

A checkpoint is written into ``checkpoints/.tmp-step-…`` and renamed when every rank has
finished, so an interrupted save never leaves a half checkpoint under a ``step-…`` name (rank 0
renames; the run directory must be on a file system every rank sees). ``step`` is the number
of completed optimizer steps. RNG states restore on the ranks that saved them (a rank with no
saved state, after resuming on more ranks, keeps its own).
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

__all__ = ["CheckpointState", "save_checkpoint", "load_checkpoint", "latest_checkpoint", "checkpoint_path"]

CHECKPOINTS = "checkpoints"


@dataclass
class CheckpointState:
    """What ``load_checkpoint`` restored besides the model, optimizer and scheduler."""

    path: Path
    #: completed optimizer steps
    step: int
    data_state: dict[str, Any]
    extra: dict[str, Any] = field(default_factory=dict)
    #: ranks of the run that saved it
    world_size: int = 1


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


@contextlib.contextmanager
def _quiet_single_process():  # noqa: ANN202
    """DCP warns that it assumes one process when there is no process group: that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def _barrier() -> None:
    if _rank_world()[1] > 1:
        dist.barrier()


def checkpoint_path(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / CHECKPOINTS / f"step-{step:08d}"


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The complete checkpoint with the most steps under ``run_dir`` (None if there is none)."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return None
    done = [p for p in root.iterdir() if p.name.startswith("step-") and (p / "meta.pt").is_file()]
    return max(done, key=lambda p: int(p.name[5:]), default=None)


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_checkpoint(
    run_dir: str | Path,
    *,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any | None = None,
    data_state: dict[str, Any],
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write checkpoint ``step`` of ``run_dir`` (layout in the module docstring); returns its path.

    Every rank must call it. An existing checkpoint of the same step is replaced.
    """
    rank, world = _rank_world()
    final = checkpoint_path(run_dir, step)
    tmp = final.parent / f".tmp-{final.name}"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "rng").mkdir(parents=True)
    _barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    with _quiet_single_process():
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp / "dcp"))
    torch.save(_rng_state(), tmp / "rng" / f"rank{rank}.pt")
    if getattr(model, "hf_source", None):
        from harts.integrations.hf import save_hf_checkpoint

        save_hf_checkpoint(model, str(tmp / "hf"))  # collective gather, rank 0 writes
    if rank == 0:
        meta = {
            "step": step,
            "data_state": dict(data_state),
            "extra": dict(extra or {}),
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "world_size": world,
            "buffers": {n: b.detach().cpu().clone() for n, b in model.named_buffers()},
        }
        torch.save(meta, tmp / "meta.pt")
    _barrier()
    if rank == 0:
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    _barrier()
    return final


def load_checkpoint(
    ckpt_or_run_dir: str | Path,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any | None = None,
) -> CheckpointState:
    """Restore ``model``, ``optimizer`` (and ``scheduler``) in place from a checkpoint, or from the
    latest one of a run directory; RNG states too. ``model`` must already be parallelized the
    way this run wants (any number of ranks; DCP reshards).

    Raises:
        FileNotFoundError: no complete checkpoint at ``ckpt_or_run_dir``.
    """
    path = Path(ckpt_or_run_dir)
    if not (path / "meta.pt").is_file():
        found = latest_checkpoint(path)
        if found is None:
            raise FileNotFoundError(f"{path}: no complete checkpoint (no meta.pt, nor {CHECKPOINTS}/step-*/meta.pt)")
        path = found
    rank, _ = _rank_world()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    with _quiet_single_process():
        # DCP loads in place into these (sharded) state dicts
        dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path / "dcp"))
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    meta = torch.load(path / "meta.pt", weights_only=False)
    buffers = dict(model.named_buffers())
    with torch.no_grad():
        for name, value in meta["buffers"].items():
            if name in buffers:
                buffers[name].copy_(value)
    if scheduler is not None and meta["scheduler"] is not None:
        scheduler.load_state_dict(meta["scheduler"])
    rng = path / "rng" / f"rank{rank}.pt"
    if rng.is_file():
        _set_rng_state(torch.load(rng, weights_only=False))
    return CheckpointState(
        path=path, step=meta["step"], data_state=meta["data_state"], extra=meta["extra"], world_size=meta["world_size"]
    )
