"""Build a model too large for one device: meta-device structure, sharding, then values per shard.

    model = load_model(spec, ..., device="meta")        # structure only, no storage
    state = init_parallel(config, device, experts)
    model = parallelize(model, state)                   # EP + FSDP2 on meta tensors
    materialize(model, state, spec=spec, seed=seed)     # storage and values, this rank's shards

(``build_parallel_model`` runs the four.) No rank ever holds the whole model on its device:

* a preset (random init): every parameter and buffer is drawn on the host from its own
  generator, seeded by (seed, tensor name) (``harts.models.init``), and the rank keeps its
  shard. Values do not depend on the number of ranks: the model equals the one built whole
  with the same seed and then sharded. Host memory: one full tensor at a time.
* a checkpoint (transformers', or harts' own weights directory that ``harts train --save``
  writes): rank 0 reads it into a full host state dict (harts names and layouts, in the dtypes
  ``load_model`` gives them: ``read_pretrained``, ``read_native``) and torch's
  ``set_model_state_dict(..., full_state_dict=True, broadcast_from_rank0=True)`` broadcasts it one
  tensor at a time; every rank keeps its shard, so the sharded model holds the values the one
  loaded whole does, bit for bit. Host memory: the whole checkpoint on rank 0, one tensor on the
  other ranks. A checkpoint rank 0 cannot read (damaged, another model's) is the same
  ``UserError`` on every rank, before any rank waits for the broadcast.

On one process (no mesh) the same path builds the whole model, without the round trip through
host memory of the unsharded construction (``harts train --meta-init``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

from harts.errors import UserError
from harts.models.hybrid_lm import HybridLM
from harts.models.init import init_specs, init_value
from harts.parallel.agree import agree
from harts.parallel.mesh import ParallelConfig, ParallelState, init_parallel
from harts.parallel.parallelize import parallelize

__all__ = ["build_parallel_model", "materialize", "moe_experts"]


def moe_experts(model: HybridLM) -> int:
    """Experts per MoE layer, 0 for a dense model (what ``init_parallel`` checks ``--ep`` against)."""
    return model.config.num_experts if any(layer.is_moe for layer in model.layers) else 0


@torch.no_grad()
def _fill(t: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's part of ``full`` (the tensor's global value, on the host) into ``t``."""
    if isinstance(t, DTensor):
        # every rank holds ``full`` already (same seed): no communication (src_data_rank=None)
        part = distribute_tensor(full, t.device_mesh, t.placements, src_data_rank=None)
        t.to_local().copy_(part.to_local())
    else:
        t.copy_(full)


@torch.no_grad()
def materialize(model: HybridLM, state: ParallelState, *, spec: str, seed: int) -> HybridLM:
    """Give a meta-device ``HybridLM`` (already ``parallelize``d for ``state``) storage on
    ``state.device`` and the values ``load_model(spec, seed=seed)`` would give it; every rank
    calls it. Returns ``model``.

    ``spec`` names a preset or a checkpoint directory (``load_model``'s first argument); a
    checkpoint is read with the model's own ``dtype`` and ``chunk_size``.
    """
    from harts.integrations.loading import is_checkpoint

    # full shapes (DTensors report the global shape), taken while the tensors are still meta
    specs = init_specs(model)
    # FSDP2 CPU offload keeps the parameter shards on the host (the buffers go to the device at
    # the end: ``set_model_state_dict`` wants all tensors on one device)
    model.to_empty(device="cpu" if state.config.cpu_offload else state.device)
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    if not is_checkpoint(spec):
        for name, s in specs.items():
            _fill(tensors[name], init_value(s, seed))
        return _buffers_to(model, state.device)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    # buffers outside the state dict (a correction bias the architecture does not load) start as
    # the unsharded model's do
    persistent = set(model.state_dict())
    for name in dict(model.named_buffers()):
        if name not in persistent:
            _fill(tensors[name], init_value(specs[name], seed))
    full_sd: dict[str, Any] = {}
    problem: UserError | None = None
    if not state.distributed or dist.get_rank() == 0:
        try:
            full_sd = _full_state(spec, model.config)
        except UserError as err:
            problem = err
    problem = agree(problem)  # the other ranks would wait for a broadcast that never comes
    if problem is not None:
        raise problem
    if not state.distributed:
        model.load_state_dict(full_sd, strict=True)
    else:
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(model, full_sd, options=options)
    return _buffers_to(model, state.device)


def _full_state(spec: str, config: Any) -> dict[str, torch.Tensor]:  # noqa: ANN401 - a HybridConfig
    """Checkpoint ``spec``'s full state dict on the host, as ``load_model(spec)`` loads it into a
    model of ``config`` (its dtype and chunk size)."""
    from harts.integrations.native import is_native, read_native

    if is_native(spec):
        return read_native(spec, dtype=config.dtype)[1]
    from harts.integrations.hf import read_pretrained

    return read_pretrained(spec, dtype=config.dtype, chunk_size=config.chunk_size)[1]


def _buffers_to(model: HybridLM, device: torch.device) -> HybridLM:
    for module in model.modules():
        for name, buf in module.named_buffers(recurse=False):
            module._buffers[name] = buf.to(device)
    return model


def build_parallel_model(
    spec: str,
    config: ParallelConfig,
    device: str | torch.device,
    *,
    vocab_size: int | None = None,
    dtype: str | None = None,
    layer_pattern: str | None = None,
    layers: int | None = None,
    seed: int = 0,
) -> tuple[HybridLM, ParallelState]:
    """``load_model`` on the meta device, ``init_parallel``, ``parallelize``, ``materialize``
    (module docstring): the sharded model and its mesh. ``layers`` keeps a preset's first
    decoder layers (their values do not depend on how many are kept: each tensor is drawn by
    its name)."""
    from harts.integrations.loading import load_model

    model = load_model(
        spec, vocab_size=vocab_size, dtype=dtype, layer_pattern=layer_pattern, layers=layers, seed=seed, device="meta"
    )
    state = init_parallel(config, device, moe_experts(model))
    model = parallelize(model, state)
    materialize(model, state, spec=spec, seed=seed)
    return model, state
