"""Putting ``harts serve`` together: the served model's facts, the engine factory, uvicorn.

``make_service`` reads what clients are told about the model (vocabulary, architecture,
tokenizer, end-of-sequence tokens) from its structure alone (the meta device: no weights are
loaded until a client creates a training run) and returns the ``Service``; ``serve`` runs it
with uvicorn until SIGINT / SIGTERM, within the connection limits of ``harts.serve.connections``.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harts.errors import UserError
from harts.serve.config import ServeConfig
from harts.serve.service import ModelInfo, Service
from harts.serve.tokenizer import TOKENIZER_FILES

if TYPE_CHECKING:
    from harts.models.hybrid_lm import HybridLM
    from harts.trainer.engine import Engine
    from harts.trainer.lora import LoraConfig

__all__ = ["exposure_warning", "make_service", "model_info", "serve"]

log = logging.getLogger("harts.serve")


def _eos_tokens(directory: Path) -> tuple[int, ...]:
    """``eos_token_id`` of a checkpoint's generation_config.json, else its config.json."""
    for name in ("generation_config.json", "config.json"):
        try:
            data = json.loads((directory / name).read_text())
        except (OSError, ValueError):
            continue
        eos = data.get("eos_token_id") if isinstance(data, dict) else None
        if eos is not None:
            return tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))
    return ()


def _check_port(host: str, port: int) -> None:
    """``UserError`` when ``host:port`` cannot be bound (in use, or not an address of this machine)."""
    import socket

    try:
        with socket.create_server((host, port), reuse_port=False):
            pass
    except OSError as err:
        raise UserError(f"--host {host} --port {port}: cannot listen there ({err.strerror or err})") from None


def exposure_warning(host: str) -> str | None:
    """The warning ``serve`` logs when ``host`` is not a loopback address (None when it is):
    anyone who can reach the port can try keys, and keys, data and weights cross the network
    in plain HTTP."""
    import ipaddress
    import socket

    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        addresses = set()
    if addresses and all(ipaddress.ip_address(str(a).split("%")[0]).is_loopback for a in addresses):
        return None
    return (
        f"--host {host} is not a loopback address: the server is reachable from other machines, and API keys, "
        "data and weights travel over plain HTTP; bind 127.0.0.1 (reach it over an SSH tunnel) or serve it "
        "behind a TLS proxy"
    )


def check_execution(config: ServeConfig, model: HybridLM) -> None:
    """The execution settings can run the model on the device (``UserError`` naming the option)."""
    from harts.trainer.build import check_la_backend
    from harts.trainer.checks import check_recompute_layers

    check_la_backend(config.execution.linear_attention_backend, config.device, model.config.chunk_size, config.model)
    check_recompute_layers(config.execution, model)


def model_info(config: ServeConfig) -> ModelInfo:
    """The served model's facts, from its structure on the meta device (module docstring)."""
    from harts.integrations.loading import load_model

    try:
        model = load_model(config.model, dtype=config.dtype, layers=config.layers, device="meta")
    except (ValueError, OSError, KeyError) as err:  # UserError is a ValueError
        raise UserError(f"--model {config.model!r}: {err}") from None
    check_execution(config, model)
    vocab = model.config.vocab_size
    if config.tokenizer is not None:
        return _named_tokenizer(config, vocab)
    if not os.path.isdir(config.model):
        return ModelInfo(vocab_size=vocab, arch="harts", tokenizer_id=None, eos_tokens=())
    directory = Path(config.model)
    has_tokenizer = any((directory / f).is_file() for f in TOKENIZER_FILES)
    return ModelInfo(
        vocab_size=vocab,
        arch=_arch(directory),
        tokenizer_id=str(directory.resolve()) if has_tokenizer else None,
        eos_tokens=_eos_tokens(directory),
    )


def _arch(directory: Path) -> str:
    """transformers' ``model_type`` of a checkpoint directory (``harts`` when it names none)."""
    try:
        return str(json.loads((directory / "config.json").read_text()).get("model_type", "harts"))
    except (OSError, ValueError, AttributeError):
        return "harts"


def _named_tokenizer(config: ServeConfig, vocab: int) -> ModelInfo:
    """``ModelInfo`` with the ``--tokenizer`` directory: its ids must fit the model's vocabulary;
    EOS from the model directory's generation config, else the tokenizer directory's, else the
    tokenizer's own EOS token."""
    from harts.serve.tokenizer import load_tokenizer, tokenizer_eos

    assert config.tokenizer is not None
    tokenizer = load_tokenizer(config.tokenizer)
    if len(tokenizer) > vocab:
        raise UserError(
            f"--tokenizer {config.tokenizer}: its {len(tokenizer)} tokens do not fit the model's vocabulary of {vocab}"
        )
    model_dir = Path(config.model) if os.path.isdir(config.model) else None
    eos = (_eos_tokens(model_dir) if model_dir else ()) or _eos_tokens(Path(config.tokenizer))
    return ModelInfo(
        vocab_size=vocab,
        arch=_arch(model_dir) if model_dir else "harts",
        tokenizer_id=str(Path(config.tokenizer).resolve()),
        eos_tokens=eos or tokenizer_eos(tokenizer),
    )


def make_service(
    config: ServeConfig, *, check_run_memory: Callable[[LoraConfig | None], None] | None = None
) -> Service:
    """The ``Service`` for ``config``: model facts checked now, engines made per training run.
    ``check_run_memory(lora)``: raises a ``UserError`` when one more run with these adapters
    (None: every weight trained, with AdamW state) would not fit the device now; called before
    such a run is built."""
    import torch

    from harts.trainer.build import check_device

    check_device(config.device)
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    info = model_info(config)
    # the served model's weights, built once on the first LoRA run: every LoRA run (and every
    # sampler over a LoRA checkpoint) trains its adapters over these same tensors
    shared: list[HybridLM] = []

    def make_engine(lora: LoraConfig | None, spec: str | None) -> Engine:
        from harts.trainer.engine import Engine

        if lora is not None and spec is None:
            if not shared:
                shared.append(
                    Engine.load_model(
                        config.model, layers=config.layers, dtype=config.dtype, device=config.device, seed=config.seed
                    )
                )
            return Engine.over_base(shared[0], lora, capacity=config.capacity, execution=config.execution)
        return Engine.from_spec(
            spec or config.model,
            layers=None if spec else config.layers,
            dtype=config.dtype,
            device=config.device,
            lora=lora,
            seed=config.seed,
            capacity=config.capacity,
            execution=config.execution,
        )

    return Service(config, info, make_engine, check_run_memory=check_run_memory)


def serve(
    config: ServeConfig,
    *,
    log_level: str = "info",
    json_out: str | None = None,
    check_run_memory: Callable[[LoraConfig | None], None] | None = None,
) -> None:
    """Serve until SIGINT / SIGTERM (uvicorn's handlers: the running request finishes first).
    ``json_out``: where to write the base URL, served model and state directory once listening;
    ``check_run_memory``: as ``make_service`` takes it."""
    import threading

    import uvicorn

    from harts.serve.app import build_app
    from harts.serve.connections import uvicorn_limits

    _check_port(config.host, config.port)
    service = make_service(config, check_run_memory=check_run_memory)
    app = build_app(service)
    logging.basicConfig(level=getattr(logging, log_level.upper(), logging.INFO), format="harts serve: %(message)s")
    warning = exposure_warning(config.host)
    if warning is not None:
        log.warning(warning)
    log.info("tenants (each sees only its own runs and checkpoints): %s", ", ".join(config.keys))
    log.info(
        "serving %r (%s) on http://%s:%d, state in %s",
        config.served_name,
        config.model,
        config.host,
        config.port,
        Path(config.state_dir).resolve(),
    )
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            log_level="warning",
            access_log=False,
            lifespan="off",
            **uvicorn_limits(config),
        )
    )
    if json_out:
        record = {
            "base_url": f"http://{config.host}:{config.port}",
            "model": config.served_name,
            "spec": config.model,
            "state_dir": str(Path(config.state_dir).resolve()),
            "pid": os.getpid(),
        }
        threading.Thread(target=_announce, args=(server, json_out, record), daemon=True).start()
    try:
        server.run()
    finally:
        service.close()


def _announce(server: Any, path: str, record: dict[str, Any]) -> None:
    """Write ``record`` to ``path`` once ``server`` accepts connections."""
    import time

    from harts.outputs import write_json

    while not server.started:
        if server.should_exit:
            return
        time.sleep(0.05)
    write_json(path, record)
