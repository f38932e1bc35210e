"""harts' own weights directory, for models no transformers class describes (the presets).

    config.json          {"model_type": "harts", "harts_config": HybridConfig.to_dict()}
    model.safetensors    the model's state dict (harts names)

``--model DIR`` and ``Engine.from_spec(DIR)`` load it like a transformers checkpoint. Tensors go
through safetensors and the config through JSON, so loading runs no code from the directory.
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

__all__ = ["NATIVE_MODEL_TYPE", "is_native", "load_native", "save_native", "save_native_state"]

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
    path.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().contiguous().cpu() for k, v in state.items()}
    save_file(sd, str(path / "model.safetensors.tmp"))
    os.replace(path / "model.safetensors.tmp", path / "model.safetensors")
    fields = {"model_type": NATIVE_MODEL_TYPE, "harts_config": config.to_dict()}
    (path / "config.json").write_text(json.dumps(fields, indent=2, sort_keys=True))


def load_native(
    path: str | os.PathLike[str], *, dtype: str | None = None, device: str | torch.device = "cpu"
) -> HybridLM:
    """The model in directory ``path`` (``save_native``), on ``device``, in ``dtype`` if given.
    ``device="meta"`` reads the config only. ``UserError`` naming the file for a bad config or
    weights that do not fit it."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
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
    with torch.device("meta" if torch.device(device).type == "meta" else device):
        model = HybridLM(config, seed=0)
    if torch.device(device).type == "meta":
        return model
    weights = path / "model.safetensors"
    try:
        sd = load_file(str(weights))
    except (FileNotFoundError, SafetensorError, OSError) as err:
        raise UserError(f"{weights}: not readable ({err})") from None
    expected = model.state_dict()
    for name, t in sd.items():
        if name in expected and tuple(t.shape) != tuple(expected[name].shape):
            raise UserError(
                f"{weights}: tensor {name} has shape {tuple(t.shape)}, the config needs {tuple(expected[name].shape)}"
            )
    missing, unexpected = sorted(set(expected) - set(sd)), sorted(set(sd) - set(expected))
    if missing or unexpected:
        raise UserError(f"{weights}: missing tensors {missing[:5]}, unexpected tensors {unexpected[:5]}")
    model.load_state_dict({k: v.to(expected[k].dtype) for k, v in sd.items()})
    return model
