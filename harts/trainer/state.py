"""A trainer's state on disk without pickle: tensors in safetensors, everything else in JSON.

A state directory holds

    state.json            format, the model's HybridConfig, the adapter config, the optimizer's
                          param groups and step count, and the caller's own fields
    model.safetensors     ``model.state_dict()`` (adapters included)
    optimizer.safetensors the optimizer's per-parameter tensors, as ``<param name>/<key>``
    rng.safetensors       torch's CPU generator and, where present, every CUDA generator

Nothing here can execute code on load: safetensors holds raw tensors and JSON holds data. A
state is written to a temporary sibling directory and renamed into place, so a crash in the middle
of a save leaves the previous state whole (replacing one moves the old copy aside first; a crash
between the two renames leaves that copy, which ``read_state`` and the next ``write_state`` use).
A missing, truncated or garbled file is a ``UserError`` naming it.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from harts.errors import UserError
from harts.outputs import moved_aside, replace_dir, restore_dir, writing

__all__ = ["STATE_FORMAT", "load_optimizer", "read_state", "restore_rng", "write_state"]

#: bumped whenever the layout above changes
STATE_FORMAT = "harts-trainer-state/1"


def _param_names(model: torch.nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in model.named_parameters()}


def _optimizer_tensors(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[dict[str, torch.Tensor], list]:
    """(per-parameter tensors by ``<name>/<key>``, param groups with parameter names)."""
    names = _param_names(model)
    tensors: dict[str, torch.Tensor] = {}
    groups = []
    for group in optimizer.param_groups:
        settings = {k: (list(v) if isinstance(v, tuple) else v) for k, v in group.items() if k != "params"}
        groups.append({**settings, "params": [names[id(p)] for p in group["params"]]})
        for p in group["params"]:
            for key, value in optimizer.state.get(p, {}).items():
                if not isinstance(value, torch.Tensor):
                    value = torch.tensor(value)
                tensors[f"{names[id(p)]}/{key}"] = value.detach().contiguous().cpu()
    return tensors, groups


def _rng_tensors() -> dict[str, torch.Tensor]:
    out = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            out[f"cuda{i}"] = s
    return out


def write_state(
    path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, fields: dict[str, Any]
) -> None:
    """Write ``model``, ``optimizer``, torch's RNG state and ``fields`` (JSON data) to directory
    ``path``, atomically: a previous state at ``path`` is replaced only once the new one is whole.
    A write that fails (a full disk) is an ``OutputPathError`` naming ``path``; the previous state
    stays."""
    with writing(path):
        _write_state(Path(path), model, optimizer, fields)


def _write_state(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, fields: dict[str, Any]) -> None:
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    restore_dir(path)  # a replacement that died between its two renames left the old state aside
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        model_sd = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
        save_file(model_sd, str(tmp / "model.safetensors"))
        opt_tensors, groups = _optimizer_tensors(model, optimizer)
        save_file(opt_tensors, str(tmp / "optimizer.safetensors"))
        save_file(_rng_tensors(), str(tmp / "rng.safetensors"))
        meta = {"format": STATE_FORMAT, "param_groups": groups, **fields}
        (tmp / "state.json").write_text(json.dumps(meta, indent=2, sort_keys=True))
        replace_dir(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _load_tensors(file: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not file.is_file():
        raise UserError(f"{file}: missing from the trainer state (was it written by Engine.save_state?)")
    try:
        return load_file(str(file))
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        raise UserError(f"{file}: not a readable safetensors file ({err}); use an earlier state") from None


def read_state(path: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor], dict[str, torch.Tensor], dict]:
    """(``state.json``'s fields, model tensors, optimizer tensors, RNG tensors) of directory ``path``."""
    path = Path(path)
    if not path.is_dir() and moved_aside(path).is_dir():
        path = moved_aside(path)  # a replacing write_state was killed between its two renames
    if not path.is_dir():
        raise UserError(f"{path}: no trainer state directory there")
    meta_file = path / "state.json"
    try:
        meta = json.loads(meta_file.read_text())
    except FileNotFoundError:
        raise UserError(f"{meta_file}: missing (not a trainer state written by Engine.save_state)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UserError(f"{meta_file}: not readable JSON ({err}); use an earlier state") from None
    if not isinstance(meta, dict) or meta.get("format") != STATE_FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise UserError(f"{meta_file}: format {found!r}, expected {STATE_FORMAT!r}")
    return (
        meta,
        _load_tensors(path / "model.safetensors"),
        _load_tensors(path / "optimizer.safetensors"),
        _load_tensors(path / "rng.safetensors"),
    )


def load_optimizer(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, groups: list, tensors: dict[str, torch.Tensor], where: str
) -> None:
    """Give ``optimizer`` (over ``model``'s parameters) the saved ``groups`` and per-parameter
    ``tensors``; ``UserError`` naming ``where`` if they belong to other parameters."""
    params = dict(model.named_parameters())
    if len(groups) != len(optimizer.param_groups):
        raise UserError(
            f"{where}: {len(groups)} optimizer groups saved, this trainer has {len(optimizer.param_groups)}"
        )
    state: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
    for saved, group in zip(groups, optimizer.param_groups):
        mine = [_param_names(model)[id(p)] for p in group["params"]]
        if saved.get("params") != mine:
            raise UserError(f"{where}: the saved optimizer trains other parameters than this trainer's")
        for key, value in saved.items():
            if key != "params":
                group[key] = tuple(value) if key == "betas" else value
    for key, value in tensors.items():
        name, _, field = key.rpartition("/")
        if name not in params:
            raise UserError(f"{where}: optimizer state for unknown parameter {name!r}")
        p = params[name]
        # the step count stays on the host (torch keeps it there unless capturable/fused)
        state.setdefault(p, {})[field] = value if field == "step" else value.to(p.device, p.dtype)
    optimizer.state.clear()
    optimizer.state.update(state)


def restore_rng(tensors: dict[str, torch.Tensor]) -> None:
    """Set torch's generators from ``_rng_tensors``' output (CUDA ones only where present)."""
    torch.set_rng_state(tensors["cpu"])
    if torch.cuda.is_available():
        states = [tensors[f"cuda{i}"] for i in range(torch.cuda.device_count()) if f"cuda{i}" in tensors]
        if len(states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(states)
