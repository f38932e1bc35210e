"""``ServeConfig``: everything ``harts serve`` is started with, checked before anything loads."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harts.errors import UserError

__all__ = ["API_KEY_ENV", "ServeConfig"]

#: the environment variable ``harts serve`` reads the API key from when ``--api-key`` is not given
API_KEY_ENV = "HARTS_SERVE_API_KEY"


@dataclass(kw_only=True, slots=True)
class ServeConfig:
    """How ``harts serve`` runs (``harts serve --help`` describes each option)."""

    #: a preset name (``tiny``, ``ling3_tiny``) or a transformers checkpoint directory
    model: str
    #: the name clients pass as ``base_model``; None: the preset's name or the directory's name
    model_name: str | None = None
    #: every request must carry this key in ``X-API-Key`` (the tinker SDK wants a ``tml-`` prefix)
    api_key: str
    host: str = "127.0.0.1"
    port: int = 8000
    #: checkpoints live under ``<state_dir>/runs/<model_id>/``; client paths never leave it
    state_dir: Path = Path("harts-serve")
    device: str = "cpu"
    dtype: str = "float32"
    #: a preset's first N decoder layers (None: all)
    layers: int | None = None
    #: ``ExecutionConfig`` fields of every engine (recompute, attention, linear_attention_backend, ...)
    execution: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    #: tokens per engine microbatch; also the longest datum / prompt + completion served
    capacity: int = 65536
    #: training runs (LoRA engines) held in memory at once
    max_models: int = 4
    #: largest request body (after decompression), bytes
    max_request_bytes: int = 256 << 20
    #: largest ``num_samples`` of one sampling request
    max_samples: int = 256
    #: in-memory weight snapshots for sampling clients, across all runs (oldest dropped first)
    max_snapshots: int = 32
    #: how long one ``retrieve_future`` waits for its result before answering "try again"
    poll_seconds: float = 30.0
    #: torch CPU threads for the engines (None: torch's default)
    threads: int | None = None

    def __post_init__(self) -> None:
        if not self.api_key:
            raise UserError(f"--api-key: no API key; pass --api-key tml-... or set {API_KEY_ENV}")
        if not self.api_key.startswith("tml-"):
            raise UserError("--api-key: must start with 'tml-' (the tinker SDK refuses any other key)")
        if not 0 < self.port < 65536:
            raise UserError(f"--port: {self.port} is not a TCP port (1-65535)")
        if self.capacity < 2:
            raise UserError(f"--capacity: {self.capacity}; at least 2 tokens")
        self.state_dir = Path(self.state_dir)
        if self.state_dir.exists() and not self.state_dir.is_dir():
            raise UserError(f"--state-dir: {self.state_dir} exists and is not a directory")

    @property
    def served_name(self) -> str:
        """The name clients pass as ``base_model`` (``model_name`` or one derived from ``model``)."""
        if self.model_name:
            return self.model_name
        return os.path.basename(os.path.normpath(self.model)) if os.path.isdir(self.model) else self.model

    def serves(self, base_model: str) -> bool:
        """True when ``base_model`` names the served model (its name, ``--model`` as given, or that path)."""
        names = {self.served_name, self.model}
        if os.path.isdir(self.model):
            names.add(os.path.abspath(self.model))
        return base_model in names
