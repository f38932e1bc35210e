"""One way to name a model on the command line: a preset or a transformers checkpoint.

``load_model("tiny")`` builds ``HybridLM(HybridConfig.preset("tiny"))`` with a seeded init
(``layers=N``: the preset's first N decoder layers, ``harts.models.presets``);
``load_model("/path/to/checkpoint")`` loads a local transformers checkpoint directory
(BailingHybrid / Qwen3-Next / Qwen3.5 / Kimi Linear / Nemotron-H / Granite 4.0-H;
``harts.integrations.hf``) or harts' own weights directory (``harts.integrations.native``,
written for models no transformers class describes).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from harts.errors import UserError
from harts.integrations.native import is_native, load_native
from harts.models.config import HybridConfig
from harts.models.hybrid_lm import HybridLM

__all__ = ["load_model", "is_checkpoint"]


def is_checkpoint(spec: str) -> bool:
    """True when ``spec`` names a checkpoint directory rather than a preset."""
    return os.path.isdir(spec)


def load_model(
    spec: str,
    *,
    vocab_size: int | None = None,
    dtype: str | None = None,
    layer_pattern: str | None = None,
    chunk_size: int | None = None,
    layers: int | None = None,
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> HybridLM:
    """A preset (``harts.models.config.PRESET_NAMES``) or a checkpoint directory, on ``device``.

    ``device="meta"``: the model's structure only, no storage and no tensor read from a
    checkpoint; ``harts.parallel.build.materialize`` gives it storage and values after
    sharding (the same values ``seed`` / the checkpoint give here).

    For presets, ``vocab_size``/``dtype``/``layer_pattern``/``chunk_size`` override the
    preset's fields and ``layers`` keeps its first decoder layers. A checkpoint keeps its
    architecture: only ``dtype`` and ``chunk_size`` apply, and ``vocab_size`` is checked (a batch
    must fit the checkpoint's vocabulary); ``layers`` is a UserError for one.
    """
    meta = torch.device(device).type == "meta"
    if layers is not None and is_checkpoint(spec):
        raise UserError(f"layers {layers}: for presets only; the checkpoint {spec} keeps all its layers")
    if is_checkpoint(spec) and is_native(spec):
        if layer_pattern is not None or chunk_size is not None:
            raise ValueError("a saved harts model's architecture is fixed; drop the pattern and chunk-size overrides")
        model = load_native(spec, dtype=dtype, device=device)
        if vocab_size is not None and vocab_size > model.config.vocab_size:
            raise ValueError(
                f"the batch needs vocab_size >= {vocab_size} but the model at {spec} has {model.config.vocab_size}"
            )
        return model
    if is_checkpoint(spec):
        # transformers-side code: only for checkpoints
        from harts.integrations.hf import from_pretrained, pretrained_config

        overrides: dict[str, Any] = {}
        if dtype is not None:
            overrides["dtype"] = dtype
        if chunk_size is not None:
            overrides["chunk_size"] = chunk_size
        if layer_pattern is not None:
            raise ValueError("a checkpoint's layer pattern is fixed; drop the pattern override")
        if meta:
            cfg, source = pretrained_config(spec, **overrides)
            with torch.device("meta"):
                model = HybridLM(cfg)
            model.hf_source = source
        else:
            model = from_pretrained(spec, **overrides)
        if vocab_size is not None and vocab_size > model.config.vocab_size:
            raise ValueError(
                f"the batch needs vocab_size >= {vocab_size} but the checkpoint at {spec} has {model.config.vocab_size}"
            )
        return model.to(device)
    fields: dict[str, Any] = {}
    for name, value in (
        ("vocab_size", vocab_size),
        ("dtype", dtype),
        ("layer_pattern", layer_pattern),
        ("chunk_size", chunk_size),
    ):
        if value is not None:
            fields[name] = value
    config = HybridConfig.preset(spec, layers=layers, **fields)
    torch.manual_seed(seed)
    # storage straight on ``device`` (HybridLM builds on the default device), no host copy first
    with torch.device(device):
        return HybridLM(config, seed=seed)
