"""The trained weights on disk, in a form every ``--model DIR`` loads.

``save_weights(model, out)`` writes a transformers checkpoint (``save_hf_checkpoint``) when the
model came from one (it carries ``hf_source``), and harts' own weights directory
(``harts.integrations.native``: ``config.json`` with model_type "harts" + ``model.safetensors``)
otherwise, e.g. for a preset. Both load back with ``load_model(out)`` and ``--model out``.
``export_hf(model, out)`` writes the transformers checkpoint alone, for models that have a
transformers class (``has_hf_class``).

Files appear atomically: they are written into a hidden directory inside ``out``, then renamed
into place, so an interrupted save never leaves half a checkpoint. A write that fails (a full
disk) is an ``OutputPathError`` naming ``out`` (``harts.outputs.writing``), what was written
removed. A model sharded over ranks is
gathered: every rank calls these, rank 0 writes.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from harts.models.hybrid_lm import HybridLM
from harts.outputs import writing

__all__ = ["ADAPTER_FORMAT", "export_hf", "has_hf_class", "load_adapter", "load_state", "save_adapter", "save_weights"]


def has_hf_class(model: HybridLM) -> bool:
    """Whether ``model`` came from a transformers checkpoint, so that one can be written back."""
    return bool(getattr(model, "hf_source", None))


def _is_writer() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _write_into(out: str, write: Callable[[str], None]) -> None:
    """``write(tmp)`` into a hidden directory of ``out``, then its files renamed into ``out``."""
    with writing(out):
        os.makedirs(out, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".harts-save-", dir=out)
        try:
            write(tmp)
            for name in sorted(os.listdir(tmp)):
                os.replace(os.path.join(tmp, name), os.path.join(out, name))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def export_hf(model: HybridLM, out: str) -> None:
    """A transformers checkpoint of ``model`` in ``out`` (``ValueError`` unless ``has_hf_class``)."""
    from harts.integrations.hf import save_hf_checkpoint

    if not has_hf_class(model):
        raise ValueError("the model has no transformers class to export to (it was not loaded from one)")
    if not _is_writer():
        save_hf_checkpoint(model, out)  # its part of the gather; writes nothing
        return

    def write(tmp: str) -> None:
        save_hf_checkpoint(model, tmp)

    _write_into(out, write)


def save_weights(model: HybridLM, out: str) -> str:
    """``model``'s weights in ``out`` (module docstring); returns the format written:
    "transformers" or "harts"."""
    if has_hf_class(model):
        export_hf(model, out)
        return "transformers"
    from harts.integrations.native import save_native_state

    full = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}
    if _is_writer():
        _write_into(out, lambda tmp: save_native_state(model.config, full, tmp))
    return "harts"


def load_state(path: str) -> dict[str, torch.Tensor]:
    """The state dict ``save_weights`` wrote in harts' format to ``path`` (host tensors)."""
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "model.safetensors"))


# ---------------------------------------------------------------- LoRA adapters alone
#: ``adapter_config.json``'s ``format`` in harts' adapter layout (PEFT's has ``peft_type`` instead)
ADAPTER_FORMAT = "harts-lora/1"
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def save_adapter(model: HybridLM, out: str) -> str:
    """The LoRA adapters of ``model`` alone (not the frozen base) in ``out``, as PEFT names its
    files: ``adapter_config.json`` + ``adapter_model.safetensors``, atomically as the weights.
    Returns the layout written:

    * "peft" for a model loaded from transformers: PEFT's own layout, written by PEFT
      (``harts.trainer.lora.save_peft_adapter``; PEFT adds its model card, ``README.md``), which
      ``peft.PeftModel.from_pretrained`` and vLLM load onto that transformers checkpoint;
    * "harts" for any other (a preset, harts' own weights): no transformers model names PEFT's
      modules there, so the config holds ``ADAPTER_FORMAT``, the ``LoraConfig`` and the model's
      ``HybridConfig``, and the tensors are the adapters under their harts names
      (``harts.trainer.lora.adapter_module``).

    ``load_adapter`` reads both back onto the base they were trained over."""
    import json
    from dataclasses import asdict

    from harts.trainer.lora import adapter_module, lora_config_of, save_peft_adapter

    cfg = lora_config_of(model)
    if cfg is None:
        raise ValueError("save_adapter: the model has no LoRA adapters")
    if has_hf_class(model):
        _write_into(out, lambda tmp: save_peft_adapter(model, tmp))
        return "peft"

    def write(tmp: str) -> None:
        from safetensors.torch import save_file

        tensors = {k: v.detach().cpu().contiguous() for k, v in adapter_module(model).state_dict().items()}
        save_file(tensors, os.path.join(tmp, ADAPTER_WEIGHTS))
        fields = {"format": ADAPTER_FORMAT, "lora": asdict(cfg), "model_config": model.config.to_dict()}
        with open(os.path.join(tmp, ADAPTER_CONFIG), "w") as fh:
            json.dump(fields, fh, indent=2, sort_keys=True)

    _write_into(out, write)
    return "harts"


def load_adapter(model: HybridLM, path: str) -> list[torch.nn.Parameter]:
    """The adapters ``save_adapter`` wrote to ``path``, put on ``model`` (the plain base they were
    trained over, in any dtype): ``apply_lora`` with the saved settings, then the saved factors,
    bit for bit. Returns the adapter parameters. ``UserError`` naming ``path`` for a directory
    that holds no adapter, or one saved for another model (the first setting that differs),
    before ``model`` changes; for a tensor missing or of another shape, after (``model`` then
    has fresh adapters)."""
    import json

    from safetensors.torch import load_file

    from harts.errors import UserError
    from harts.trainer.lora import LoraConfig, adapter_module, apply_lora, load_peft_adapter

    try:
        with open(os.path.join(path, ADAPTER_CONFIG)) as fh:
            saved = json.load(fh)
    except (OSError, ValueError) as err:
        raise UserError(f"{path}: no readable {ADAPTER_CONFIG} ({err})") from None
    if isinstance(saved, dict) and "peft_type" in saved:
        return load_peft_adapter(model, path)
    if not isinstance(saved, dict) or saved.get("format") != ADAPTER_FORMAT:
        raise UserError(f"{path}/{ADAPTER_CONFIG}: neither harts' ({ADAPTER_FORMAT}) nor PEFT's adapter layout")
    # the config as JSON keeps it (tuples as lists); the dtype may differ: the adapters are float32
    mine = json.loads(json.dumps(model.config.to_dict(), default=str))
    theirs: dict[str, Any] = saved["model_config"] if isinstance(saved.get("model_config"), dict) else {}
    for key in sorted((set(theirs) | set(mine)) - {"dtype"}):
        if theirs.get(key) != mine.get(key):
            raise UserError(
                f"{path}: the adapter was saved for another model ({key}: saved {theirs.get(key)!r}, "
                f"this model {mine.get(key)!r})"
            )
    try:
        tensors = load_file(os.path.join(path, ADAPTER_WEIGHTS))
        cfg = LoraConfig(**saved["lora"])
    except (OSError, ValueError, TypeError, KeyError) as err:
        raise UserError(f"{path}: not a readable adapter ({type(err).__name__}: {err})") from None
    params = apply_lora(model, cfg)
    module = adapter_module(model)
    expected = module.state_dict()
    for name in sorted(set(expected) | set(tensors)):
        if name not in tensors or name not in expected or tensors[name].shape != expected[name].shape:
            raise UserError(
                f"{path}/{ADAPTER_WEIGHTS}: {name} is missing, unexpected or of another shape for rank-{cfg.rank} "
                f"LoRA on {', '.join(cfg.targets)}"
            )
    with torch.no_grad():
        for name, t in expected.items():
            t.copy_(tensors[name])
    return params
