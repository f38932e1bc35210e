"""``ServeConfig``: everything ``harts serve`` is started with, checked before anything loads."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from harts.errors import UserError
from harts.serve.tenants import DEFAULT_TENANT, check_keys

if TYPE_CHECKING:
    from harts.models.execution.config import ExecutionConfig

__all__ = ["API_KEY_ENV", "ServeConfig"]

#: the environment variable ``harts serve`` reads the API key from when ``--api-key`` is not given
API_KEY_ENV = "HARTS_SERVE_API_KEY"


def _execution() -> ExecutionConfig:
    """An ``ExecutionConfig`` (imported when one is made: this module stays light for ``--help``)."""
    from harts.models.execution.config import ExecutionConfig

    return ExecutionConfig()


@dataclass(kw_only=True, slots=True)
class ServeConfig:
    """How ``harts serve`` runs (``harts serve --help`` describes each option)."""

    #: a preset name (``tiny``, ``ling3_tiny``) or a transformers checkpoint directory
    model: str
    #: the name clients pass as ``base_model``; None: the preset's name or the directory's name
    model_name: str | None = None
    #: a tokenizer directory served with the model (``get_info``'s ``tokenizer_id``, string stop
    #: sequences); None: the checkpoint directory's own tokenizer, if it has one
    tokenizer: str | None = None
    #: the one tenant's key (``default``) when ``tenants`` is None: every request carries a key in
    #: ``X-API-Key``; ``harts.serve.tenants`` says what a key must be
    api_key: str = ""
    #: tenant name -> its key (``--keys-file``); each tenant sees only its own sessions, runs and
    #: checkpoints. None: the one tenant of ``api_key``
    tenants: dict[str, str] | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    #: checkpoints live under ``<state_dir>/runs/<model_id>/``; client paths never leave it
    state_dir: Path = Path("harts-serve")
    device: str = "cpu"
    dtype: str = "float32"
    #: a preset's first N decoder layers (None: all)
    layers: int | None = None
    #: how every engine executes (recompute, attention, linear-attention backend, ...): the same
    #: record ``harts train`` builds from the same options (``harts.trainer.options.execution_config``)
    execution: ExecutionConfig = field(default_factory=_execution)
    seed: int = 0
    #: tokens per engine microbatch; also the longest datum / prompt + completion served
    capacity: int = 65536
    #: training runs (LoRA engines) held in memory at once
    max_models: int = 8
    #: largest request body (after decompression), bytes
    max_request_bytes: int = 256 << 20
    #: largest ``num_samples`` of one sampling request
    max_samples: int = 256
    #: most datums in one ``forward`` / ``forward_backward`` request
    max_datums: int = 16384
    #: most tokens in one ``forward`` / ``forward_backward`` request (each datum's model_input + 1)
    max_batch_tokens: int = 1 << 21
    #: most tokens one sampling request costs: its prompt + ``num_samples`` x ``max_tokens``
    max_sample_tokens: int = 1 << 20
    #: seconds a connection has to send a request's line and headers, from its first byte (or from
    #: connecting); slower connections are closed, so half-sent requests do not pile up
    header_timeout: float = 10.0
    #: seconds a request body may stall between two pieces before the answer is 408 and the
    #: connection closes
    body_timeout: float = 30.0
    #: seconds an idle keep-alive connection stays open
    keep_alive_timeout: int = 5
    #: connections (and requests in progress) at once; past it new requests are answered 503
    max_connections: int = 512
    #: seconds a session may go without a request or heartbeat before it is finished and its
    #: runs released (the tinker SDK heartbeats every 10 s while its client lives)
    session_timeout: float = 120.0
    #: in-memory weight snapshots for sampling clients, across all runs (oldest dropped first)
    max_snapshots: int = 32
    #: how long one ``retrieve_future`` waits for its result before answering "try again"
    poll_seconds: float = 30.0
    #: torch CPU threads for the engines (None: torch's default)
    threads: int | None = None

    def __post_init__(self) -> None:
        from harts.models.execution.config import ExecutionConfig

        if not isinstance(self.execution, ExecutionConfig):  # e.g. a dict of its fields
            raise UserError(f"execution: expected an ExecutionConfig, got {type(self.execution).__name__}")
        if self.tenants is not None:
            if self.api_key:
                raise UserError("--api-key: give --api-key (one tenant) or --keys-file (several), not both")
            check_keys(self.tenants, source="--keys-file")
        elif not self.api_key:
            raise UserError(f"--api-key: no API key; pass --api-key tml-..., set {API_KEY_ENV} or give --keys-file")
        else:
            check_keys({DEFAULT_TENANT: self.api_key}, source="--api-key")
        if not 0 < self.port < 65536:
            raise UserError(f"--port: {self.port} is not a TCP port (1-65535)")
        if self.capacity < 2:
            raise UserError(f"--capacity: {self.capacity}; at least 2 tokens")
        for name in ("max_datums", "max_batch_tokens", "max_sample_tokens", "max_connections", "keep_alive_timeout"):
            if getattr(self, name) < 1:
                raise UserError(f"--{name.replace('_', '-')}: {getattr(self, name)}; at least 1")
        for name in ("header_timeout", "body_timeout"):
            if not getattr(self, name) > 0:
                raise UserError(f"--{name.replace('_', '-')}: {getattr(self, name)}; must be > 0 seconds")
        if not self.session_timeout >= 30:  # NaN too
            raise UserError(
                f"--session-timeout: {self.session_timeout}; at least 30 seconds (the tinker SDK heartbeats every 10 s)"
            )
        if self.tokenizer is not None:
            from harts.serve.tokenizer import load_tokenizer

            if ":" in os.path.abspath(self.tokenizer):
                raise UserError(f"--tokenizer {self.tokenizer}: the tinker SDK cuts a tokenizer id at ':'; move it")
            load_tokenizer(self.tokenizer)  # a missing or broken directory is one line before the model loads
        self.state_dir = Path(self.state_dir)
        if self.state_dir.exists() and not self.state_dir.is_dir():
            raise UserError(f"--state-dir: {self.state_dir} exists and is not a directory")

    @property
    def keys(self) -> dict[str, str]:
        """Tenant name -> key: the keys file's tenants, or ``default`` with ``api_key``."""
        return dict(self.tenants) if self.tenants is not None else {DEFAULT_TENANT: self.api_key}

    @property
    def legacy_owner(self) -> str | None:
        """The tenant of a run whose ``run.json`` names none (written before runs recorded their
        tenant): the one tenant of ``--api-key``; with a keys file, nobody (a tenant adopts such a
        run by adding ``"tenant": "<name>"`` to its ``run.json``)."""
        return DEFAULT_TENANT if self.tenants is None else None

    @property
    def max_json_bytes(self) -> int:
        """Largest JSON request body. Every endpoint but ``forward_backward`` (protobuf) takes JSON,
        the largest a sampling prompt of at most ``capacity`` tokens; a JSON body is parsed in one
        call that holds the interpreter, so it is kept to what such a request needs."""
        return min(self.max_request_bytes, (4 << 20) + 16 * self.capacity)

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
