"""The model a run trains, named by a ``ModelSpec``: a preset or a weights directory, with its
device, dtype, backends and vocabulary checked before any storage is made.

``build_model(spec, vocab_size)`` checks the spec (``check_model``: the preset and its
``layers``; ``check_device``; ``check_la_backend``; ``check_vocab``: the vocabulary the batches
need fits the model and, for a preset, the device) and loads it (``load_model``);
``build_model_and_attention`` also chooses the FlexAttention backend while the model's values
are made. Every error is a ``harts.errors.UserError`` naming the command-line option the field
comes from (``--model``, ``--layers``, ``--device``, ...), since the commands build their model
here.

Module level imports only the standard library (the command line's ``--help`` stays instant).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harts.errors import UserError

if TYPE_CHECKING:
    import torch

    from harts.models.config import HybridConfig
    from harts.models.execution.config import ExecutionConfig
    from harts.models.hybrid_lm import HybridLM

__all__ = [
    "BuiltModel",
    "ModelSpec",
    "build_model",
    "build_model_and_attention",
    "check_device",
    "check_la_backend",
    "check_model",
    "check_vocab",
    "checkpoint_errors",
    "flex_backends",
]


@dataclass(kw_only=True, frozen=True)
class ModelSpec:
    """Which model to build, where, and how it runs."""

    #: a preset name (``harts.models.config.PRESET_NAMES``) or a weights directory (transformers
    #: checkpoint or harts' own)
    model: str = "tiny"
    #: a preset's layer pattern instead of its own (presets only)
    pattern: str | None = None
    #: keep a preset's first N decoder layers (presets only)
    layers: int | None = None
    #: parameter dtype (None: the preset's or checkpoint's)
    dtype: str | None = None
    device: str = "cpu"
    #: the linear-attention core (``harts.ops.linear_attn.dispatch``)
    la_backend: str = "reference"
    #: full attention: auto, gather or mask (``ExecutionConfig.attention``)
    attention: str = "auto"
    #: torch intra-op threads on the CPU; 0 lets torch choose
    threads: int = 1
    #: a preset's initialisation seed
    seed: int = 0


def check_model(spec: ModelSpec) -> None:
    """``--model`` names a preset or a checkpoint directory, and ``--layers`` (when given) fits it:
    1 .. the preset's depth (after ``--pattern``); a checkpoint keeps its layers."""
    from harts.integrations.loading import is_checkpoint

    layers = spec.layers
    if is_checkpoint(spec.model):
        if layers is not None:
            raise UserError(
                f"--layers {layers}: for model presets only; the checkpoint --model {spec.model} keeps all its "
                "layers (drop --layers)"
            )
        return
    from harts.models.config import HybridConfig, preset_key

    overrides: dict[str, Any] = {"layer_pattern": spec.pattern} if spec.pattern else {}
    try:
        key = preset_key(spec.model)
    except ValueError:
        raise UserError(model_not_found(spec.model)) from None
    try:
        config = HybridConfig.preset(key, **overrides)
    except ValueError as err:
        raise UserError(f"--model {spec.model!r}: {err} (or give a checkpoint directory)") from None
    if layers is not None:
        config.first_layers(layers, name=f"--model {key}", option="--layers")


def model_not_found(name: str) -> str:
    """The line for a ``--model`` that is neither a preset nor a directory: a Hub id (``org/name``)
    gets the download into a local directory (harts reads checkpoints from disk only), a path the
    directory it should be, anything else the presets."""
    import re

    from harts.models.config import PRESET_NAMES, preset_key

    tail = name.rstrip("/").rsplit("/", 1)[-1]
    try:
        twin = f"; --model {preset_key(tail)} is its preset (its shapes, random weights)"
    except ValueError:
        twin = f"; or a preset: {', '.join(PRESET_NAMES)}"
    path = Path(name).expanduser()
    if re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", name) and not path.parent.is_dir():
        local = os.path.join("checkpoints", tail)
        return (
            f"--model {name}: no such directory, and harts does not download from the Hugging Face Hub: download "
            f"it first (hf download {name} --local-dir {local}), then pass --model {local}{twin}"
        )
    if os.sep in name or name.startswith(("~", ".")):
        what = "is a file, not" if path.is_file() else "no such directory: give"
        return (
            f"--model {name}: {what} a transformers checkpoint directory (config.json and *.safetensors; a Hub "
            f"model is downloaded with: hf download ORG/NAME --local-dir DIR){twin}"
        )
    known = ", ".join(PRESET_NAMES)
    return f"--model {name!r}: unknown model preset {name!r}; known: {known} (or give a checkpoint directory)"


def check_device(spec: str) -> None:
    """``--device`` names a device this torch build can use, or raise naming the fix."""
    import torch

    try:
        dev = torch.device(spec)
    except (RuntimeError, ValueError):
        raise UserError(f"--device {spec!r} is not a device name; use cpu, cuda, cuda:1, ...") from None
    if dev.type == "cpu":
        return
    if dev.type == "cuda":
        if not torch.backends.cuda.is_built():
            raise UserError(
                f"--device {spec}: this torch build ({torch.__version__}) has no CUDA support; "
                "run on --device cpu or install a CUDA build of torch"
            )
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            raise UserError(f"--device {spec}: no CUDA device is visible (check CUDA_VISIBLE_DEVICES and the driver)")
        if dev.index is not None and dev.index >= n:
            raise UserError(f"--device {spec}: only {n} CUDA device(s) visible (cuda:0..cuda:{n - 1})")
        return
    if dev.type == "mps" and torch.backends.mps.is_available():
        return
    raise UserError(f"--device {spec}: not available here; use cpu or cuda")


def check_la_backend(backend: str, device: str, chunk_size: int | None = None, model: str | None = None) -> None:
    """``--la-backend`` can run on ``--device`` (fla needs CUDA and fla-core) and, once the model
    is known (``chunk_size`` of ``--model``), at its linear-attention chunk size."""
    import torch

    from harts.ops.linear_attn.dispatch import linear_attn_op

    try:
        linear_attn_op(backend, torch.device(device), chunk_size)
    except ValueError as err:
        with_model = f" with --model {model}" if model else ""
        raise UserError(
            f"--la-backend {backend} on --device {device}{with_model}: {err}; use --la-backend auto "
            "(or reference, which runs on any device)"
        ) from None


_DTYPE_BYTES = {"float32": 4, "float64": 8, "bfloat16": 2}


def _memory_bytes(device: str) -> int | None:
    """Total memory of ``device`` (RAM for cpu), or None when unknown."""
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        return int(torch.cuda.get_device_properties(dev.index or 0).total_memory)
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_vocab(spec: ModelSpec, vocab_size: int, where: str | None = None, *, training: bool = True) -> None:
    """The vocabulary the batch needs fits the model named by ``--model``.

    A checkpoint must already cover it (read from its config.json, before loading). A preset's
    embedding and output layers are sized from it: refuse when they alone would not fit the
    device's memory (parameters + gradients, + two AdamW moments when ``training``).
    """
    from harts.integrations.loading import is_checkpoint

    origin = f" for {where}" if where else ""
    if is_checkpoint(spec.model):
        cfg_path = Path(spec.model) / "config.json"
        try:
            cfg = json.loads(cfg_path.read_text())
        except (OSError, ValueError):
            return  # load_model reports an unreadable checkpoint
        if isinstance(cfg, dict) and isinstance(cfg.get("harts_config"), dict):
            cfg = cfg["harts_config"]  # harts' own weights directory (harts.integrations.native)
        have = cfg.get("vocab_size") if isinstance(cfg, dict) else None
        if isinstance(have, int) and vocab_size > have:
            raise UserError(
                f"the batch needs vocab_size >= {vocab_size:,}{origin}, but the checkpoint --model "
                f"{spec.model} has a vocabulary of {have:,}: the batch was tokenized for another model"
            )
        return
    from harts.models.config import HybridConfig
    from harts.trainer.checks import published_vocab

    try:
        cfg = HybridConfig.preset(spec.model)
    except ValueError as err:
        raise UserError(f"--model {spec.model!r}: {err} (or give a checkpoint directory)") from None
    dtype = spec.dtype or cfg.dtype
    copies = (1 if cfg.tie_word_embeddings else 2) * (4 if training else 2)
    need = vocab_size * cfg.hidden_size * _DTYPE_BYTES.get(dtype, 4) * copies
    have = _memory_bytes(spec.device)
    if have is not None and need > have and vocab_size == published_vocab(spec.model):
        # the preset's own vocabulary, not one the batch asked for (harts.trainer.checks.needed_vocab)
        raise UserError(
            f"--model {spec.model}: the preset's embedding and output layers (vocabulary {vocab_size:,}, "
            f"hidden {cfg.hidden_size:,}) would take {need / 2**30:,.1f} GiB "
            f"({'training' if training else 'forward + backward'}), more than the {have / 2**30:,.1f} GiB "
            f"of {spec.device}: use a device with more memory, or a smaller model"
        )
    if have is not None and need > have:
        raise UserError(
            f"the batch needs vocab_size >= {vocab_size:,}{origin}: the {spec.model} preset's "
            f"embedding and output layers would then take {need / 2**30:,.1f} GiB "
            f"({'training' if training else 'forward + backward'}), more than the {have / 2**30:,.1f} GiB "
            f"of {spec.device}. Token ids index the embedding table: remap them to a dense range "
            "0..V-1, or use a checkpoint (--model DIR) whose vocabulary covers them"
        )


def checkpoint_errors() -> tuple[type[BaseException], ...]:
    """What reading a malformed checkpoint raises: ValueError / OSError, and safetensors' own error."""
    errors: tuple[type[BaseException], ...] = (ValueError, OSError)
    try:
        from safetensors import SafetensorError
    except ImportError:  # pragma: no cover - safetensors is an optional extra
        return errors
    return (*errors, SafetensorError)


def build_model(
    spec: ModelSpec, vocab_size: int, *, where: str | None = None, training: bool = True, meta: bool = False
) -> HybridLM:
    """The model named by ``--model`` on ``--device`` (device, vocabulary and threads checked first;
    ``where`` names the largest token id for the vocabulary error).

    ``meta``: its structure on the meta device only (several ranks, ``--meta-init``); the caller
    shards it and gives it values with ``harts.parallel.build.materialize``."""
    import torch

    from harts.models.execution.config import ExecutionConfig, attention_head_dim_range

    check_model(spec)
    check_device(spec.device)
    check_la_backend(spec.la_backend, spec.device)
    check_vocab(spec, vocab_size, where, training=training)
    if spec.threads < 0:
        raise UserError(f"--threads must be >= 0, got {spec.threads}")
    if spec.threads:
        torch.set_num_threads(spec.threads)
    model = _load_model(spec, vocab_size, "meta" if meta else spec.device)
    # device and fla-core were checked before loading; now the model's chunk size too
    check_la_backend(spec.la_backend, spec.device, model.config.chunk_size, spec.model)
    attention = spec.attention
    try:  # the model's attention head dims against FlexAttention's
        ExecutionConfig(attention=attention).resolved_attention(
            torch.device(spec.device).type, *attention_head_dim_range(model.config.attention_head_dims)
        )
    except ValueError as err:
        raise UserError(f"--attention {attention} with --model {spec.model}: {err}") from None
    return model


def _load_model(spec: ModelSpec, vocab_size: int, device: str) -> HybridLM:
    """``--model`` (a preset or a checkpoint) on ``device``, a bad checkpoint as a ``UserError``."""
    from harts.integrations.loading import load_model

    try:
        return load_model(
            spec.model,
            vocab_size=vocab_size,
            dtype=spec.dtype,
            layer_pattern=spec.pattern,
            layers=spec.layers,
            seed=spec.seed,
            device=device,
        )
    except checkpoint_errors() as err:
        if isinstance(err, UserError):  # it names the file already
            raise
        raise UserError(f"--model {spec.model}: {err}") from None


@dataclass
class BuiltModel:
    """``build_model_and_attention``'s result: the model, its FlexAttention backends, and how long
    each half took (they ran side by side, so the wall time is about the longer one)."""

    model: HybridLM
    #: FlexAttention backend per full-attention layer kind, e.g. {"M": "flash"} (``flex_backends``)
    flex: dict[str, str]
    #: seconds making the model's storage and values (on a helper thread)
    model_seconds: float
    #: seconds choosing the FlexAttention backend (on the calling thread, beside the model)
    attention_seconds: float


def build_model_and_attention(
    spec: ModelSpec, vocab_size: int, execution: ExecutionConfig, *, where: str | None = None
) -> BuiltModel:
    """``build_model(spec, vocab_size, where=where)``, and the FlexAttention backend that
    ``execution`` runs on ``spec.device``, chosen while the model's values are made.

    Both are cold-start costs of a large model: FLASH's probe compiles FA4's forward and backward
    (``flex_backends``), and a preset's initial values are drawn on the host's threads (a
    checkpoint is read instead). Every check ``build_model`` makes runs first, on a
    structure-only (meta) model; then a helper thread makes the model while this thread probes
    (torch.compile stays on the calling thread; the draws release the GIL). An error on either
    side is raised here, after both have ended."""
    import threading
    import time

    import torch

    shell = build_model(spec, vocab_size, where=where, meta=True)  # every check; no storage
    made: dict[str, Any] = {}

    def make() -> None:
        began = time.perf_counter()
        try:
            made["model"] = _load_model(spec, vocab_size, spec.device)
        except BaseException as err:  # noqa: BLE001 - raised on the calling thread below
            made["error"] = err
        made["seconds"] = time.perf_counter() - began

    helper = threading.Thread(target=make, name="harts-build-model", daemon=True)
    helper.start()
    began = time.perf_counter()
    try:
        flex = flex_backends(shell.config, execution, torch.device(spec.device))
        attention_seconds = time.perf_counter() - began
    finally:
        helper.join()
    if "error" in made:
        raise made["error"]
    return BuiltModel(made["model"], flex, made["seconds"], attention_seconds)


def flex_backends(config: HybridConfig, execution: ExecutionConfig, device: torch.device) -> dict[str, str]:
    """Which FlexAttention backend ("flash" / "triton") each full-attention layer kind of a model
    with ``config`` runs under ``execution`` on ``device``: {"M": ..., "A": ...}; empty where the
    mask path does not run (the CPU, ``--attention gather``). The kernel record's choice
    (``harts.models.execution.backends.resolve_backends``, its one owner), made here before the
    first step so that FLASH's probe runs once per head shape, not inside it; a bad choice
    (``--attention mask`` outside FlexAttention's head dims, FLASH asked for and unusable) is a
    ``UserError``."""
    from harts.models.execution.backends import resolve_backends

    if not config.attention_head_dims or device.type != "cuda":
        return {}
    try:
        record = resolve_backends(execution, config, device, config.torch_dtype())
    except (ValueError, RuntimeError) as exc:
        raise UserError(str(exc)) from exc
    return {choice.kind: choice.backend for choice in record.flex}
