"""Integrations with other libraries; each lives in its own subpackage with optional dependencies.

``harts.integrations.hf``: load transformers hybrid models (BailingHybrid / Ling 3.0,
Qwen3-Next, Qwen3.5, Kimi Linear, Nemotron-H, Granite 4.0-H) into ``HybridLM`` and save them back. Importing this package does not
import transformers; the entry points below load it on first use.
"""

from __future__ import annotations

from typing import Any

__all__ = ["from_hf", "from_pretrained", "to_hf_state_dict", "save_hf_checkpoint", "inspect_checkpoint"]


def from_hf(hf_model: Any, **kwargs: Any) -> Any:
    from harts.integrations.hf import from_hf as impl

    return impl(hf_model, **kwargs)


def from_pretrained(path: str, **kwargs: Any) -> Any:
    from harts.integrations.hf import from_pretrained as impl

    return impl(path, **kwargs)


def to_hf_state_dict(model: Any, **kwargs: Any) -> Any:
    from harts.integrations.hf import to_hf_state_dict as impl

    return impl(model, **kwargs)


def save_hf_checkpoint(model: Any, path: str, **kwargs: Any) -> Any:
    from harts.integrations.hf import save_hf_checkpoint as impl

    return impl(model, path, **kwargs)


def inspect_checkpoint(path: str) -> Any:
    from harts.integrations.hf import inspect_checkpoint as impl

    return impl(path)
