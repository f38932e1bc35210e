"""The trained weights on disk, in a form every ``--model DIR`` loads.

``save_weights(model, out)`` writes a transformers checkpoint (``save_hf_checkpoint``) when the
model came from one (it carries ``hf_source``), and harts' own weights directory
(``harts.integrations.native``: ``config.json`` with model_type "harts" + ``model.safetensors``)
otherwise, e.g. for a preset. Both load back with ``load_model(out)`` and ``--model out``.
``export_hf(model, out)`` writes the transformers checkpoint alone, for models that have a
transformers class (``has_hf_class``).

Files appear atomically: they are written into a hidden directory inside ``out``, then renamed
into place, so an interrupted save never leaves half a checkpoint. A model sharded over ranks is
gathered: every rank calls these, rank 0 writes.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from harts.models.hybrid_lm import HybridLM

__all__ = ["export_hf", "has_hf_class", "load_state", "save_weights"]


def has_hf_class(model: HybridLM) -> bool:
    """Whether ``model`` came from a transformers checkpoint, so that one can be written back."""
    return bool(getattr(model, "hf_source", None))


def _is_writer() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _write_into(out: str, write: Callable[[str], None]) -> None:
    """``write(tmp)`` into a hidden directory of ``out``, then its files renamed into ``out``."""
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
