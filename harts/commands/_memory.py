"""The memory check a command runs before it builds a model: ``harts.models.memory``'s estimate
of the peak against what the device has now, and one line naming the knob when it does not fit.

``add_force_argument`` gives a command ``--force`` (run anyway); each command that builds a model
calls ``check_memory`` with its capacity before ``build_model``, and ``harts train`` hands
``train_memory_check`` to its runtime, which calls it once the batches fixed the vocabulary.

What the host has (``available_bytes``) is the least of the kernel's ``MemAvailable``, the room
under a cgroup's memory limit, and the room under the process's address-space limit (``ulimit -v``,
``RLIMIT_AS``): that limit counts every mapping, so its room is the limit less the process's
virtual size now (``VmSize``), not less what it holds in memory. The check's line names the limit
that set the number, if one did.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harts.errors import UserError

if TYPE_CHECKING:
    from harts.models.config import HybridConfig
    from harts.models.execution.config import ExecutionConfig
    from harts.models.memory import MemoryEstimate
    from harts.trainer.build import ModelSpec
    from harts.trainer.lora import LoraConfig
    from harts.trainer.step import TrainConfig

__all__ = [
    "Available",
    "add_force_argument",
    "available_bytes",
    "check_memory",
    "run_memory_check",
    "train_memory_check",
]


def add_force_argument(p: argparse.ArgumentParser) -> None:
    """``--force``: build and run even when the memory estimate exceeds what the device has."""
    p.add_argument(
        "--force",
        action="store_true",
        help="run even when the estimated peak memory (parameters, gradients, optimizer state, "
        "one microbatch's activations and logits) exceeds what the device has free; checked before any work",
    )


def check_memory(
    spec: ModelSpec,
    vocab_size: int | None,
    *,
    capacity: int,
    execution: ExecutionConfig | None = None,
    optimizer: bool = True,
    shards: int = 1,
    force: bool = False,
    rows_option: str | None = "--capacity",
    where: str | None = None,
    frozen_base: bool = False,
    compression: float = 1.0,
    models_beside: int = 0,
) -> MemoryEstimate | None:
    """Raise a one-line ``UserError`` (the estimate, what is available, the largest term, the
    knob) unless the model ``spec`` names, with ``vocab_size`` (None: its own), fits one training step of
    ``capacity`` rows per microbatch on its device under ``execution`` (default: the chunked LM
    head), with AdamW state when ``optimizer``, its state sharded ``shards`` ways; ``force``
    skips it. ``rows_option``: the flag that sets ``capacity`` (None: the batch's size does,
    as in ``harts compare``); ``where``: the largest token id's place, for the vocabulary check
    (``build_model``'s, made first: its message names the token); ``frozen_base``: LoRA
    training, no gradients or optimizer state for the base weights; ``compression``: the batches'
    largest semantic / compact positions, which sizes compact attention's gathered ancestor views
    (``gathered_view_rows``); ``models_beside``: more copies of the model's weights held beside
    the one that trains (``harts serve``'s sampling engines), one microbatch running at a time.
    Returns the estimate (None when skipped or the device's memory is unknown)."""
    if force:
        return None
    from harts.models.execution.config import ExecutionConfig
    from harts.models.memory import estimate_memory, format_bytes, gathered_view_rows
    from harts.trainer.build import check_device, check_model, check_vocab

    check_device(spec.device)  # before asking it how much memory it has
    check_model(spec)  # --model and --layers first: the vocabulary's check reads the preset
    if vocab_size is not None:
        check_vocab(spec, vocab_size, where, training=optimizer)
    have = available_bytes(spec.device)
    config = _model_config(spec, vocab_size)
    if have is None or config is None:
        return None
    cfg = ExecutionConfig(fused_logprobs=True) if execution is None else execution
    dev = "cpu" if spec.device.split(":")[0] == "cpu" else "cuda"
    total = _device_total(spec.device)

    def estimate(**changes: Any) -> MemoryEstimate:
        kw: dict[str, Any] = dict(
            capacity=capacity,
            dtype=spec.dtype,
            optimizer=optimizer,
            shards=shards,
            device_total_bytes=total,
            frozen_base=frozen_base,
            models=1 + models_beside,
        )
        kw.update(changes)
        kw["view_rows"] = gathered_view_rows(kw["capacity"], compression)
        return estimate_memory(kw.pop("config", config), kw.pop("execution", cfg), device_type=dev, **kw)

    est = estimate()
    if est.total <= have:
        return est
    name, size = est.largest
    raise UserError(
        f"not enough memory on {spec.device}: one step is estimated at {format_bytes(est.total)}, "
        f"{format_bytes(have)} available{_limited_by(have)}; the largest term is {name} {format_bytes(size)} "
        f"(then {est.summary(skip=1, top=3)}); {_knob(spec, cfg, est, have, estimate, config, rows_option)}; "
        "--force runs anyway"
    )


def run_memory_check(
    spec: ModelSpec, *, capacity: int, execution: ExecutionConfig, force: bool
) -> Callable[[LoraConfig | None], None]:
    """``harts serve``'s check of one more training run against the memory free now (the served
    weights, the runs already held and the sampling engines are in memory then): a ``UserError``
    naming the knob unless it fits with one step at ``capacity`` under ``execution``.

    A LoRA run adds its adapters, their gradients and AdamW state (four tensors of the adapters'
    size, float32 or wider; ``adapter_parameters`` counts them from the model's structure); a run
    without LoRA (``None``) adds a whole model with gradients and AdamW state."""
    from harts.models.memory import estimate_memory, format_bytes, gathered_view_rows

    # the served model's config and its structure on the meta device, made once, on first use
    served: list[tuple[HybridConfig, Any]] = []

    def check(lora: LoraConfig | None) -> None:
        if lora is None:
            check_memory(
                spec, None, capacity=capacity, execution=execution, optimizer=True, force=force, rows_option=None
            )
            return
        if force:
            return
        have = available_bytes(spec.device)
        if have is None:
            return
        if not served:
            config = _model_config(spec, None)
            if config is None:
                return
            import torch

            from harts.models.hybrid_lm import HybridLM

            with torch.device("meta"):
                served.append((config, HybridLM(config, seed=0)))
        config, structure = served[0]
        from harts.trainer.lora import adapter_parameters

        dev = "cpu" if spec.device.split(":")[0] == "cpu" else "cuda"
        est = estimate_memory(
            config,
            execution,
            capacity=capacity,
            dtype=spec.dtype,
            optimizer=False,
            frozen_base=True,
            device_type=dev,
            device_total_bytes=_device_total(spec.device),
            view_rows=gathered_view_rows(capacity, 1.0),
        )
        step = est.total - est.terms["parameters"]
        width = 8 if (spec.dtype or config.dtype) == "float64" else 4
        per_rank = 4 * width * adapter_parameters(structure, replace(lora, rank=1))
        need = per_rank * lora.rank
        if need + step <= have:
            return
        fits = (have - step) // per_rank if have > step else 0
        knob = (
            f"rank {fits} fits, or fewer targets (train_mlp / train_attn / train_unembed)"
            if fits >= 1
            else "no rank fits beside one step: release runs (close a ServiceClient) or restart with a smaller --capacity"
        )
        raise UserError(
            f"not enough memory on {spec.device} for rank-{lora.rank} adapters: with their gradients and AdamW "
            f"state they need {format_bytes(need)}, one step {format_bytes(step)} beside them, and "
            f"{format_bytes(have)} is free now{_limited_by(have)}; {knob}"
        )

    return check


def train_memory_check(
    force: bool, *, frozen_base: bool = False
) -> Callable[[ModelSpec, int, str, TrainConfig, int, float], None]:
    """``check_memory`` as ``harts train``'s runtime calls it before building the model: with
    the run's capacity and execution (the chunked head), AdamW state, FSDP over the ranks, and
    the batches' largest compression; ``frozen_base``: LoRA (``--lora``), no gradient or AdamW
    state for the base weights."""

    def check(spec: ModelSpec, vocab_size: int, where: str, train: TrainConfig, world: int, compression: float) -> None:
        execution = replace(train.execution, fused_logprobs=True)
        check_memory(
            spec,
            vocab_size,
            capacity=train.capacity,
            execution=execution,
            shards=world,
            force=force,
            where=where,
            compression=compression,
            frozen_base=frozen_base,
        )

    return check


def _knob(  # noqa: ANN001
    spec: ModelSpec,
    execution: ExecutionConfig,
    est: MemoryEstimate,
    have: int,
    estimate,
    config: HybridConfig,
    rows_option: str | None,
) -> str:
    """What fixes it: when the model's state alone (no rows) does not fit, fewer layers, a smaller
    vocabulary, a GPU or more ranks; otherwise a capacity that fits, or recomputation."""
    from harts.models.memory import format_bytes

    hints: list[str] = []
    if estimate(capacity=0).total > have:
        depth = config.num_hidden_layers
        if not os.path.isdir(spec.model):
            layers = _largest_fitting(lambda n: estimate(config=config.first_layers(n)).total, have, depth)
            alone = _largest_fitting(lambda n: estimate(config=config.first_layers(n), capacity=0).total, have, depth)
            if layers:
                hints.append(f"a smaller --layers ({layers} of {depth} fit)")
            elif alone:
                hints.append(f"a smaller --layers (the state of {alone} of {depth} fits) with a smaller --capacity")
        if 2 * config.vocab_size * config.hidden_size > est.parameters // 2:
            hints.append(_vocab_hint(config))
        if est.device_type == "cpu" and _cuda_available():
            hints.append("--device cuda")
        hints.append("more ranks (torchrun: FSDP shards parameters, gradients and optimizer state)")
    else:
        fits = _largest_fitting(lambda c: estimate(capacity=c).total, have, est.capacity)
        if fits:
            hints.append(f"{rows_option} {fits:,}" if rows_option else f"a batch of at most {fits:,} tokens")
        if est.largest[0] == "lm_head":
            hints.append(_vocab_hint(config))
        if not execution.recompute:
            with_recompute = estimate(execution=replace(execution, recompute=True)).total
            if with_recompute <= have:
                hints.append(f"--recompute (estimate {format_bytes(with_recompute)})")
        if est.device_type == "cpu" and _cuda_available():
            hints.append("--device cuda")
    return "use " + " or ".join(hints)


def _vocab_hint(config: HybridConfig) -> str:
    return f"fewer than {config.vocab_size:,} token ids (remap them to a dense range 0..V-1)"


def _largest_fitting(peak, have: int, top: int) -> int | None:  # noqa: ANN001
    """The largest n in 1 .. top - 1 with ``peak(n) <= have`` (peak grows with n), or None."""
    lo, hi = 0, top
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if peak(mid) <= have:
            lo = mid
        else:
            hi = mid
    return lo or None


def _model_config(spec: ModelSpec, vocab_size: int | None) -> HybridConfig | None:
    """The ``HybridConfig`` ``build_model`` will build: a preset with ``--pattern`` / ``--layers``
    and the batch's vocabulary, or a checkpoint's own (its structure read on the meta device;
    None when it does not load: ``build_model`` reports that)."""
    from harts.models.config import HybridConfig
    from harts.trainer.build import check_model

    check_model(spec)
    if os.path.isdir(spec.model):
        from harts.integrations.loading import load_model

        try:
            return load_model(spec.model, vocab_size=vocab_size, dtype=spec.dtype, device="meta").config
        except Exception:  # noqa: BLE001 - build_model raises its own error for it
            return None
    fields: dict[str, Any] = {"layer_pattern": spec.pattern} if spec.pattern else {}
    if vocab_size is not None:
        fields["vocab_size"] = vocab_size
    return HybridConfig.preset(spec.model, layers=spec.layers, **fields)


class Available(int):
    """A number of bytes ``available_bytes`` found, and the limit that set it (``limit``, a few
    words for the check's line; "" when it is simply what the machine has free)."""

    limit: str

    def __new__(cls, value: int, limit: str = "") -> Available:
        self = super().__new__(cls, value)
        self.limit = limit
        return self


def _limited_by(have: int) -> str:
    """`` (<the limit>)`` for the check's line when a limit set ``have`` (module docstring)."""
    limit = getattr(have, "limit", "")
    return f" ({limit})" if limit else ""


def available_bytes(device: str) -> int | None:
    """Memory a new allocation can use now: on the CPU the least of the kernel's
    ``MemAvailable``, a cgroup's limit and the address-space limit (module docstring), as an
    ``Available`` naming the limit that set it; on CUDA the device's free memory and what this
    process's caching allocator holds unused; None when unknown."""
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            return None
        index = dev.index or 0
        # what torch's caching allocator holds but no tensor uses is free to this process too
        cached = torch.cuda.memory_reserved(index) - torch.cuda.memory_allocated(index)
        return int(torch.cuda.mem_get_info(index)[0]) + int(cached)
    if dev.type != "cpu":
        return None
    free = _meminfo_available()
    found = [Available(free)] if free is not None else []
    found += [room for room in (_cgroup_room(), _address_space_room()) if room is not None]
    return min(found) if found else None


def _meminfo_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _address_space_room() -> Available | None:
    """The soft address-space limit (``RLIMIT_AS``) less this process's virtual size now, or None
    without a limit: every mapping counts against it, reserved or touched."""
    import resource

    from harts.models.memory import format_bytes

    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    if limit == resource.RLIM_INFINITY or limit < 0:
        return None
    mapped = _virtual_size()
    return Available(
        max(0, limit - mapped),
        f"the address-space limit, ulimit -v {format_bytes(limit)}, less the {format_bytes(mapped)} this process "
        "maps already",
    )


def _virtual_size() -> int:
    """This process's virtual size in bytes (``/proc/self/statm``'s first field, in pages); 0 when
    unknown, which overstates the room under an address-space limit by that much."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _cgroup_room() -> Available | None:
    """The cgroup's memory limit minus what it holds that cannot be reclaimed (its usage less
    its inactive page cache; cgroup v2, then v1), or None without a limit."""
    for folder, limit_name, usage_name, cache_key in (
        ("/sys/fs/cgroup", "memory.max", "memory.current", "inactive_file"),
        ("/sys/fs/cgroup/memory", "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"),
    ):
        try:
            limit_text = Path(folder, limit_name).read_text().strip()
            if limit_text == "max":
                return None
            limit, usage = int(limit_text), int(Path(folder, usage_name).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit >= 1 << 60:  # v1 writes a huge number for "no limit"
            return None
        cache = 0
        try:
            for line in Path(folder, "memory.stat").read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == cache_key:
                    cache = int(value)
        except (OSError, ValueError):
            pass
        from harts.models.memory import format_bytes

        held = max(0, usage - cache)
        return Available(
            max(0, limit - held),
            f"the cgroup's memory limit {format_bytes(limit)} less the {format_bytes(held)} it holds",
        )
    return None


def _device_total(device: str) -> int | None:
    import torch

    dev = torch.device(device)
    if dev.type == "cuda" and torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(dev.index or 0).total_memory)
    return None


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()
