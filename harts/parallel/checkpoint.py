"""Resumable, sharded training checkpoints with ``torch.distributed.checkpoint`` (DCP), no pickle.

API (what a training loop calls; works on one process without a process group, and on any
number of ranks, every rank calling each function)::

    path = save_checkpoint(run_dir, step=s, model=model, optimizer=opt, scheduler=None,
                           data_state={"next_step": s}, extra={"workload": ...})
    ckpt = latest_checkpoint(run_dir)          # Path of the newest complete checkpoint, or None
    meta = read_checkpoint(ckpt)               # its step, data_state and extra, no weights read
    state = load_checkpoint(ckpt or run_dir, model=model, optimizer=opt, scheduler=None)
    state.step, state.data_state, state.extra  # continue from here

Layout of one checkpoint, ``RUN_DIR/checkpoints/step-00000005/``::

    dcp/              tensors only, sharded: the model, the optimizer's per-parameter state and
                      every model buffer (the MoE expert bias is a buffer, also when not
                      persistent: the loop updates it, so a resumed run needs it). Each rank
                      writes its own shards (FSDP2 DTensors, expert blocks); DCP reshards on
                      load, so a checkpoint saved on N ranks loads on M. Its metadata is
                      ``metadata.json`` (``harts.parallel.dcp_json``)
    meta.json         format, step, world size at save, data_state, extra, the scheduler's state
                      and the optimizer's param groups (written last: it marks the checkpoint
                      complete)
    data.safetensors  the tensors inside data_state / extra / the scheduler state (meta.json
                      refers to them by key)
    rng/rank{r}.safetensors  RNG states of rank r: python, numpy, torch CPU, CUDA (when used)
    hf/               only for a model loaded from a transformers checkpoint: the weights gathered
                      from the shards as a checkpoint transformers, ``harts convert`` and
                      ``--model`` load (``save_hf_checkpoint``)

Nothing is unpickled on load: JSON is data, safetensors holds raw tensors, and DCP's tensor
files are read with ``torch.load(weights_only=True)`` (tensors and plain containers only). A
truncated, garbled or missing file is a ``DamagedCheckpoint`` (a ``UserError``) naming the file
and the previous checkpoint; ``load_checkpoint(run_dir, fallback=True)`` goes back to the newest
checkpoint that loads instead.

A checkpoint is written into ``checkpoints/.tmp-step-…`` and renamed when every rank has
finished, so a save killed at any point leaves the previous checkpoints as they were (rank 0
renames; the run directory must be on a file system every rank sees). A write that fails (a full
disk) fails the save on every rank alike, as an ``OutputPathError`` naming the checkpoint; what
was written of it is removed. Replacing a checkpoint of
the same step moves the old one to ``.old-step-…`` first; should the process die between the two
renames, that copy is what ``latest_checkpoint`` finds. ``step`` is the number of completed
optimizer steps. RNG states restore on the ranks that saved them (a rank with no saved state,
after resuming on more ranks, keeps its own).
"""

from __future__ import annotations

import contextlib
import json
import random
import shutil
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from harts.errors import OutputPathError, UserError
from harts.outputs import os_error_of, replace_dir, writing
from harts.parallel.agree import agree
from harts.parallel.dcp_json import DamagedCheckpoint, JsonReader, JsonWriter, TensorLoadPlanner, read_metadata

__all__ = [
    "CHECKPOINT_FORMAT",
    "CheckpointState",
    "DamagedCheckpoint",
    "checkpoint_path",
    "latest_checkpoint",
    "load_checkpoint",
    "read_checkpoint",
    "save_checkpoint",
]

CHECKPOINTS = "checkpoints"
META = "meta.json"
DATA = "data.safetensors"
#: bumped whenever the layout above changes
CHECKPOINT_FORMAT = "harts-checkpoint/2"
_TENSOR, _TUPLE = "__tensor__", "__tuple__"


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
    #: newer checkpoints ``fallback=True`` passed over, one line each (why)
    skipped: list[str] = field(default_factory=list)


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    """DCP warns that it assumes one process when there is no process group: that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def checkpoint_path(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / CHECKPOINTS / f"step-{step:08d}"


def _step_of(p: Path) -> int | None:
    name = p.name.removeprefix(".old-")
    digits = name.removeprefix("step-")
    return int(digits) if name.startswith("step-") and digits.isdigit() else None


def checkpoints(run_dir: str | Path) -> list[Path]:
    """The complete checkpoints under ``run_dir``, newest first (by step). A ``.old-step-…`` copy
    stands in for its step when a replacing save died before renaming the new one into place."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found: dict[int, Path] = {}
    for p in sorted(root.iterdir(), key=lambda p: p.name.startswith(".old-")):
        step = _step_of(p)
        if step is not None and step not in found and (p / META).is_file():
            found[step] = p
    return [found[s] for s in sorted(found, reverse=True)]


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The complete checkpoint with the most steps under ``run_dir`` (None if there is none)."""
    done = checkpoints(run_dir)
    return done[0] if done else None


# ------------------------------------------------------------ JSON with tensors beside it
def _to_json(obj: Any, tensors: dict[str, torch.Tensor], where: str) -> Any:  # noqa: ANN401
    """``obj`` as JSON data; each tensor goes into ``tensors`` and is referred to by its key."""
    if isinstance(obj, torch.Tensor):
        key = f"t{len(tensors)}"
        # a copy of its own: safetensors refuses tensors that share storage (tied weights)
        tensors[key] = obj.detach().cpu().contiguous().clone()
        return {_TENSOR: key}
    if isinstance(obj, dict):
        bad = [k for k in obj if not isinstance(k, str)]
        if bad:
            raise TypeError(f"{where}: JSON keeps string keys only, got {bad[0]!r}")
        return {k: _to_json(v, tensors, f"{where}.{k}") for k, v in obj.items()}
    if isinstance(obj, tuple):
        return {_TUPLE: [_to_json(v, tensors, where) for v in obj]}
    if isinstance(obj, list):
        return [_to_json(v, tensors, where) for v in obj]
    if isinstance(obj, np.generic):
        return obj.item()
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"{where}: a {type(obj).__name__} cannot go into a checkpoint (JSON data and tensors only)")


def _from_json(obj: Any, tensors: dict[str, torch.Tensor], where: str) -> Any:  # noqa: ANN401
    if isinstance(obj, dict):
        if set(obj) == {_TENSOR}:
            if obj[_TENSOR] not in tensors:
                raise DamagedCheckpoint(f"{where}: refers to tensor {obj[_TENSOR]!r}, which {DATA} does not hold")
            return tensors[obj[_TENSOR]]
        if set(obj) == {_TUPLE} and isinstance(obj[_TUPLE], list):
            return tuple(_from_json(v, tensors, where) for v in obj[_TUPLE])
        return {k: _from_json(v, tensors, where) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_from_json(v, tensors, where) for v in obj]
    return obj


def _save_tensors(tensors: dict[str, torch.Tensor], file: Path, metadata: dict[str, str] | None = None) -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(file), metadata=metadata)


def _load_tensors(file: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, the header's metadata) of safetensors ``file``; ``DamagedCheckpoint`` naming it."""
    from safetensors import SafetensorError, safe_open

    if not file.is_file():
        raise DamagedCheckpoint(f"{file}: missing")
    try:
        with safe_open(str(file), framework="pt") as fh:
            return {k: fh.get_tensor(k) for k in fh.keys()}, dict(fh.metadata() or {})  # noqa: SIM118
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        raise DamagedCheckpoint(f"{file}: not a readable safetensors file ({err})") from None


# ------------------------------------------------------------------------- RNG states
def _rng_state() -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """This process's RNG states as tensors, and the few scalars beside them (safetensors metadata)."""
    version, mt, gauss = random.getstate()
    kind, key, pos, has_gauss, cached = np.random.get_state()
    tensors = {
        "python": torch.tensor(mt, dtype=torch.int64),
        "numpy": torch.from_numpy(np.asarray(key, dtype=np.int64)),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        tensors["cuda"] = torch.cuda.get_rng_state()
    scalars = {"python": [version, gauss], "numpy": [kind, int(pos), int(has_gauss), float(cached)]}
    return tensors, {"harts": json.dumps(scalars)}


def _read_rng(file: Path) -> dict[str, Any]:
    tensors, header = _load_tensors(file)
    try:
        scalars = json.loads(header["harts"])
        version, gauss = scalars["python"]
        kind, pos, has_gauss, cached = scalars["numpy"]
        python = (int(version), tuple(int(v) for v in tensors["python"].tolist()), gauss)
        key = tensors["numpy"].numpy().astype(np.uint32)
        state: dict[str, Any] = {"python": python, "numpy": (str(kind), key, int(pos), int(has_gauss), float(cached))}
        state["torch"] = tensors["torch"]
        if tensors["torch"].dtype != torch.uint8:
            raise ValueError("the torch state is not uint8")
    except (KeyError, TypeError, ValueError, json.JSONDecodeError) as err:
        raise DamagedCheckpoint(f"{file}: not the RNG states harts writes ({type(err).__name__}: {err})") from None
    if "cuda" in tensors:
        state["cuda"] = tensors["cuda"]
    return state


def _set_rng_state(state: dict[str, Any], file: Path) -> None:
    try:
        random.setstate(state["python"])
        np.random.set_state(state["numpy"])
        torch.set_rng_state(state["torch"])
    except (TypeError, ValueError, RuntimeError) as err:
        raise DamagedCheckpoint(f"{file}: the RNG states do not load ({err})") from None
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# ------------------------------------------------------------------ state dict halves
def _split_tensors(tree: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the tensors of a nested dict, with its nesting; everything else, with its nesting)."""
    tensors: dict[str, Any] = {}
    plain: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, torch.Tensor):
            tensors[key] = value
        elif isinstance(value, dict):
            t, p = _split_tensors(value)
            if t:
                tensors[key] = t
            if p or not t:
                plain[key] = p
        else:
            plain[key] = value
    return tensors, plain


def _merge(tree: dict[str, Any], plain: dict[str, Any]) -> None:
    for key, value in plain.items():
        if isinstance(value, dict) and isinstance(tree.get(key), dict):
            _merge(tree[key], value)
        else:
            tree[key] = value


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, torch.Tensor]:
    """DCP's key of every tensor of a nested dict (the path joined by dots)."""
    out: dict[str, torch.Tensor] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out |= _flat(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


def _halves(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict, dict, dict]:
    """(DCP's tensors, the plain rest of the optimizer and model state, the two state dicts)."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    model_t, model_p = _split_tensors(model_sd)
    optim_t, optim_p = _split_tensors(dict(optim_sd["state"]))  # type: ignore[arg-type]
    tensors = {"model": model_t, "optim": optim_t, "buffers": dict(model.named_buffers())}
    plain = {"model": model_p, "optim_state": optim_p, "param_groups": optim_sd["param_groups"]}
    return tensors, plain, model_sd, optim_sd


def save_checkpoint(
    run_dir: str | Path,
    *,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any | None = None,  # noqa: ANN401
    data_state: dict[str, Any],
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write checkpoint ``step`` of ``run_dir`` (layout in the module docstring); returns its path.

    Every rank must call it. An existing checkpoint of the same step is replaced. ``data_state``,
    ``extra`` and the scheduler's state hold JSON data (str keys; tuples kept) and tensors.

    Raises:
        OutputPathError: a file could not be written (a full disk, a read-only directory), on
            every rank alike; the message names the checkpoint, and the checkpoints before it are
            as they were (what was written of this one is removed).
    """
    rank, world = _rank_world()
    final = checkpoint_path(run_dir, step)
    tmp = final.parent / f".tmp-{final.name}"

    def prepare() -> None:
        if rank == 0:
            _remove_leftovers(final.parent)
            (tmp / "rng").mkdir(parents=True)

    def write() -> None:
        tensors, plain, _, _ = _halves(model, optimizer)
        with _quiet_single_process():
            dcp.save(tensors, storage_writer=JsonWriter(tmp / "dcp"))
        rng, rng_header = _rng_state()
        _save_tensors(rng, tmp / "rng" / f"rank{rank}.safetensors", rng_header)
        if getattr(model, "hf_source", None):
            from harts.integrations.hf import save_hf_checkpoint

            save_hf_checkpoint(model, str(tmp / "hf"))  # collective gather, rank 0 writes
        if rank == 0:
            data: dict[str, torch.Tensor] = {}
            meta = {
                "format": CHECKPOINT_FORMAT,
                "step": step,
                "world_size": world,
                "data_state": _to_json(dict(data_state), data, "data_state"),
                "extra": _to_json(dict(extra or {}), data, "extra"),
                "scheduler": _to_json(scheduler.state_dict() if scheduler is not None else None, data, "scheduler"),
                "state": _to_json(plain, data, "optimizer"),
            }
            _save_tensors(data, tmp / DATA)
            (tmp / META).write_text(json.dumps(meta, indent=1))  # last: the checkpoint is complete

    for phase in (prepare, write, lambda: _publish(tmp, final) if rank == 0 else None):
        # the barrier between the phases tells every rank of another's failed write
        problem = agree(_written(final, phase))
        if problem is not None:
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise problem
    return final


def _written(final: Path, phase: Callable[[], None]) -> UserError | None:
    """Run ``phase`` of writing checkpoint ``final``; its failed write as an ``OutputPathError``
    naming the checkpoint and the one before it (None when it wrote all it had to)."""
    try:
        with writing(final):
            try:
                phase()
            except CheckpointException as err:
                inner = _unwrap(err)  # DCP's wrapper of a rank's failed write
                raise (inner if os_error_of(inner) is not None else err) from None
    except OutputPathError as err:
        done = [p for p in checkpoints(final.parent.parent) if p != final]
        before = f"; the previous checkpoint {done[0]} is whole" if done else ""
        return OutputPathError(f"checkpoint {err}{before}")
    return None


def _remove_leftovers(root: Path) -> None:
    """What saves killed halfway left under ``root``: ``.tmp-…`` directories, and ``.old-…``
    copies whose checkpoint is back in place (one without it is the checkpoint: it stays)."""
    if not root.is_dir():
        return
    for p in root.iterdir():
        stale = p.name.startswith(".tmp-step-")
        stale |= p.name.startswith(".old-step-") and (root / p.name.removeprefix(".old-")).is_dir()
        if stale:
            shutil.rmtree(p, ignore_errors=True)


def _publish(tmp: Path, final: Path) -> None:
    """Rename ``tmp`` to ``final``; an existing ``final`` is moved aside to ``.old-…`` first and
    removed after. Without ``final``, an ``.old-…`` copy is the checkpoint (a replacement died
    between the renames): ``checkpoints`` lists it, and it goes only once the new one is in place."""
    replace_dir(tmp, final, final.parent / f".old-{final.name}")


def _resolve(ckpt_or_run_dir: str | Path) -> list[Path]:
    """The checkpoint ``ckpt_or_run_dir`` names: itself, or a run directory's, newest first."""
    path = Path(ckpt_or_run_dir)
    if (path / META).is_file():
        return [path]
    found = checkpoints(path)
    if found:
        return found
    legacy = [p for p in (path, *sorted((path / CHECKPOINTS).glob("step-*"))) if (p / "meta.pt").is_file()]
    if legacy:
        raise UserError(
            f"{legacy[-1]}: a checkpoint of an older harts (meta.pt, a pickle), not loaded since unpickling "
            "can run code; start a new run"
        )
    raise UserError(f"{path}: no complete checkpoint (no {META}, nor {CHECKPOINTS}/step-*/{META})")


def read_checkpoint(ckpt: str | Path) -> CheckpointState:
    """The step, data_state, extra and world size of checkpoint ``ckpt`` (a ``step-…`` directory),
    without reading its weights; ``DamagedCheckpoint`` naming a bad ``meta.json`` / ``data.safetensors``."""
    path = Path(ckpt)
    meta = _read_meta(path)
    return CheckpointState(
        path=path,
        step=meta["step"],
        data_state=meta["data_state"],
        extra=meta["extra"],
        world_size=meta["world_size"],
    )


def _read_meta(path: Path) -> dict[str, Any]:
    file = path / META
    try:
        meta = json.loads(file.read_text())
    except FileNotFoundError:
        raise DamagedCheckpoint(f"{file}: missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise DamagedCheckpoint(f"{file}: not readable JSON ({err})") from None
    if not isinstance(meta, dict) or meta.get("format") != CHECKPOINT_FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise DamagedCheckpoint(f"{file}: format {found!r}, expected {CHECKPOINT_FORMAT!r}")
    keys = ("step", "world_size", "data_state", "extra", "scheduler", "state")
    missing = [k for k in keys if k not in meta]
    if missing or not isinstance(meta["step"], int) or not isinstance(meta["data_state"], dict):
        raise DamagedCheckpoint(f"{file}: not a harts checkpoint's metadata (missing or bad: {missing or 'step'})")
    tensors, _ = _load_tensors(path / DATA)
    return {k: _from_json(meta[k], tensors, str(file)) for k in keys}


def _check_fits(tensors: dict[str, Any], metadata: Any, path: Path, extra: dict[str, Any]) -> None:  # noqa: ANN401
    """UserError unless every tensor of this model and optimizer is in the checkpoint, in its shape."""
    saved = metadata.state_dict_metadata
    flags = ", ".join(f"--{k} {v}" for k, v in extra.items() if k != "command" and not isinstance(v, dict))
    run = f"harts {extra['command']}" if isinstance(extra.get("command"), str) else "a run"
    origin = f"it was saved by {run}{' with ' + flags[:200] if flags else ''}"
    for key, t in _flat(tensors).items():
        if key not in saved:
            raise UserError(f"{path}: holds no {key}, so not this model's checkpoint ({origin})")
        if tuple(saved[key].size) != tuple(t.size()):
            raise UserError(
                f"{path}: {key} was saved as {list(saved[key].size)}, this model has {list(t.size())}, so not "
                f"this model's checkpoint ({origin})"
            )


def _unwrap(err: CheckpointException) -> BaseException:
    """The first rank's own exception inside DCP's wrapper."""
    for _rank, (exc, _trace) in sorted(err.failures.items()):
        return exc
    return err


def _load_one(
    path: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any | None,  # noqa: ANN401
    check: Callable[[CheckpointState], None] | None,
) -> CheckpointState:
    rank, _ = _rank_world()
    rng_file = path / "rng" / f"rank{rank}.safetensors"
    # every small file first, and the shapes: a bad one leaves the model and optimizer untouched;
    # every rank learns of another's bad file (its own RNG file), so that all of them stop, or
    # all go back to the previous checkpoint, together
    problem: UserError | None = None
    try:
        meta = _read_meta(path)
        state = CheckpointState(
            path=path,
            step=meta["step"],
            data_state=meta["data_state"],
            extra=meta["extra"],
            world_size=meta["world_size"],
        )
        if check is not None:
            check(state)
        metadata = read_metadata(path / "dcp")
        rng = _read_rng(rng_file) if rng_file.is_file() else None
        tensors, _, model_sd, optim_sd = _halves(model, optimizer)
        _check_fits(tensors, metadata, path, state.extra)
    except UserError as err:
        problem = err
    problem = agree(problem)
    if problem is not None:
        raise problem
    try:
        with _quiet_single_process():
            # DCP loads in place into these (sharded) tensors
            dcp.load(tensors, storage_reader=JsonReader(path / "dcp", metadata), planner=TensorLoadPlanner())
    except CheckpointException as err:
        inner = _unwrap(err)
        if isinstance(inner, UserError):
            raise type(inner)(str(inner)) from None
        raise
    plain = meta["state"]
    _merge(model_sd, plain["model"])
    _merge(optim_sd["state"], plain["optim_state"])
    optim_sd["param_groups"] = plain["param_groups"]
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    if scheduler is not None and meta["scheduler"] is not None:
        scheduler.load_state_dict(meta["scheduler"])
    if rng is not None:
        _set_rng_state(rng, rng_file)
    return state


def load_checkpoint(
    ckpt_or_run_dir: str | Path,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any | None = None,  # noqa: ANN401
    fallback: bool = False,
    check: Callable[[CheckpointState], None] | None = None,
) -> CheckpointState:
    """Restore ``model``, ``optimizer`` (and ``scheduler``) in place from a checkpoint, or from the
    latest one of a run directory; RNG states too. ``model`` must already be parallelized the
    way this run wants (any number of ranks; DCP reshards).

    ``fallback``: a damaged checkpoint of a run directory is passed over for the one before it
    (the result's ``skipped`` says why); without it the damage is the error. ``check`` sees each
    checkpoint's step, data_state and extra before its weights are read (and raises to refuse it:
    a resumed run's flags against the saved ones).

    Raises:
        UserError: no complete checkpoint at ``ckpt_or_run_dir``, or one of another model.
        DamagedCheckpoint: a file of the checkpoint is missing, truncated or garbled (the message
            names it and the previous checkpoint).
    """
    candidates = _resolve(ckpt_or_run_dir)
    skipped: list[str] = []
    for i, path in enumerate(candidates):
        try:
            got = _load_one(path, model, optimizer, scheduler, check)
        except DamagedCheckpoint as err:
            if not fallback or i + 1 == len(candidates):
                raise DamagedCheckpoint(f"{err}; {_previous(path)}") from None
            skipped.append(f"{path.name} skipped: {err}")
            continue
        got.skipped = skipped
        return got
    raise AssertionError("unreachable: _resolve returns at least one checkpoint")


def _previous(path: Path) -> str:
    """Where to go instead of damaged checkpoint ``path``: the newest complete one before it."""
    step = _step_of(path)
    earlier = [p for p in checkpoints(path.parent.parent) if step is not None and (_step_of(p) or 0) < step]
    if not earlier:
        return f"checkpoint {path.name} is damaged and no earlier one is complete"
    return f"checkpoint {path.name} is damaged; the previous one is {earlier[0]} (--resume auto picks it)"
