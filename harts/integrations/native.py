"""harts' own weights directory, for models no transformers class describes (the presets).

    config.json          {"model_type": "harts", "harts_config": HybridConfig.to_dict()}
    model.safetensors    the model's state dict (harts names)

``--model DIR`` and ``Engine.from_spec(DIR)`` load it like a transformers checkpoint. Tensors go
through safetensors and the config through JSON, so loading runs no code from the directory.
Each file is written aside and renamed into place; a write that fails (a full disk) is an
``OutputPathError`` naming the directory, and leaves no half-written file under a final name.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from harts.errors import UserError
from harts.models.config import HybridConfig
from harts.models.hybrid_lm import HybridLM
from harts.outputs import writing

__all__ = ["NATIVE_MODEL_TYPE", "is_native", "load_native", "read_native", "save_native", "save_native_state"]

NATIVE_MODEL_TYPE = "harts"


def is_native(path: str | os.PathLike[str]) -> bool:
    """Whether directory ``path`` holds harts' own weights (its config.json says model_type "harts")."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(config, dict) and config.get("model_type") == NATIVE_MODEL_TYPE


def save_native(model: HybridLM, path: str | os.PathLike[str]) -> None:
    """Write ``model``'s config and weights to directory ``path`` (created; files replaced)."""
    save_native_state(model.config, model.state_dict(), path)


def save_native_state(config: HybridConfig, state: dict[str, torch.Tensor], path: str | os.PathLike[str]) -> None:
    """``save_native`` of a model's ``config`` and full (not sharded) ``state`` dict."""
    from safetensors.torch import save_file

    path = Path(path)
    sd = {k: v.detach().contiguous().cpu() for k, v in state.items()}
    fields = {"model_type": NATIVE_MODEL_TYPE, "harts_config": config.to_dict()}
    weights, config_file = path / "model.safetensors.tmp", path / "config.json.tmp"
    with writing(path):
        try:
            path.mkdir(parents=True, exist_ok=True)
            save_file(sd, str(weights))
            config_file.write_text(json.dumps(fields, indent=2, sort_keys=True))
            os.replace(weights, path / "model.safetensors")
            os.replace(config_file, path / "config.json")
        finally:
            weights.unlink(missing_ok=True)
            config_file.unlink(missing_ok=True)


def read_native(
    path: str | os.PathLike[str], *, dtype: str | None = None
) -> tuple[HybridConfig, dict[str, torch.Tensor]]:
    """(config, full state dict on the host, each tensor in the model's dtype for it) of directory
    ``path``: what ``load_native`` loads into a model, and what rank 0 broadcasts to a model
    sharded over ranks (``harts.parallel.build.materialize``), so both hold the same values."""
    config = _read_config(Path(path), dtype)
    with torch.device("meta"):
        structure = HybridLM(config, seed=0)
    return config, _read_weights(Path(path), structure.state_dict())


def load_native(
    path: str | os.PathLike[str], *, dtype: str | None = None, device: str | torch.device = "cpu"
) -> HybridLM:
    """The model in directory ``path`` (``save_native``), on ``device``, in ``dtype`` if given.
    ``device="meta"`` reads the config only. ``UserError`` naming the file for a bad config or
    weights that do not fit it."""
    path = Path(path)
    config = _read_config(path, dtype)
    meta = torch.device(device).type == "meta"
    with torch.device("meta" if meta else device):
        model = HybridLM(config, seed=0)
    if not meta:
        model.load_state_dict(_read_weights(path, model.state_dict()))
    return model


def _read_config(path: Path, dtype: str | None) -> HybridConfig:
    config_file = path / "config.json"
    raw: Any = json.loads(config_file.read_text())
    fields = raw.get("harts_config")
    if not isinstance(fields, dict):
        raise UserError(f"{config_file}: model_type 'harts' needs a 'harts_config' object")
    try:
        config = HybridConfig.from_dict(fields if dtype is None else {**fields, "dtype": dtype})
        config.validate()
    except (TypeError, ValueError) as err:
        raise UserError(f"{config_file}: {err}") from None
    return config


def _read_weights(path: Path, expected: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``path/model.safetensors`` on the host, each tensor cast to the dtype of its ``expected``
    namesake (a model's state dict: shapes and dtypes); ``UserError`` unless it holds exactly
    those tensors in those shapes."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    weights = path / "model.safetensors"
    try:
        sd = load_file(str(weights))
    except (FileNotFoundError, SafetensorError, OSError) as err:
        raise UserError(f"{weights}: not readable ({err})") from None
    for name, t in sd.items():
        if name in expected and tuple(t.shape) != tuple(expected[name].shape):
            raise UserError(
                f"{weights}: tensor {name} has shape {tuple(t.shape)}, the config needs {tuple(expected[name].shape)}"
            )
    missing, unexpected = sorted(set(expected) - set(sd)), sorted(set(sd) - set(expected))
    if missing or unexpected:
        raise UserError(f"{weights}: missing tensors {missing[:5]}, unexpected tensors {unexpected[:5]}")
    return {k: v.to(expected[k].dtype) for k, v in sd.items()}
