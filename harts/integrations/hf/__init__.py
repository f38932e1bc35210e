"""Hugging Face transformers integration (the ``harts[hf]`` extra: transformers, safetensors).

One adapter module per architecture (``bailing_hybrid``, ``qwen3_next``, ``kimi_linear``,
``qwen3_5``, ``nemotron_h``, ``granitemoehybrid``) maps the transformers config to a ``HybridConfig`` (naming every unsupported
option) and the state dict names/layouts both ways; ``api`` holds the entry points re-exported
here.
"""

from harts.integrations.hf.api import (
    ADAPTERS,
    ConversionReport,
    adapter_for,
    from_hf,
    from_pretrained,
    inspect_checkpoint,
    pretrained_config,
    read_pretrained,
    save_hf_checkpoint,
    to_hf_state_dict,
)
from harts.integrations.hf.base import UnsupportedConfigError

__all__ = [
    "ADAPTERS",
    "ConversionReport",
    "UnsupportedConfigError",
    "adapter_for",
    "from_hf",
    "from_pretrained",
    "inspect_checkpoint",
    "pretrained_config",
    "read_pretrained",
    "save_hf_checkpoint",
    "to_hf_state_dict",
]
