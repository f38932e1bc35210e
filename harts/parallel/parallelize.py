"""Apply data and expert parallelism to a ``HybridLM`` from outside (torchtitan's ``parallelize``).

    state = init_parallel(ParallelConfig(dp=2, ep=2), device, model.config.num_experts)
    model = parallelize(model, state)

* row splitting first (``apply_row_split``) when ``cp * tp > 1``: the forward runs on this
  rank's 1/(cp tp) of each microbatch's rows, with all-to-alls over ``cp`` around every token
  mixer (Ulysses context parallelism);
* tensor parallelism (``apply_tensor_parallel``) when ``tp > 1``: projections split by heads /
  columns over ``tp``, rows gathered before and reduce-scattered after every mixer and MLP
  (sequence parallelism); the shards are left out of FSDP and summed in ``finish_gradients``;
* expert parallelism (``apply_expert_parallel``) when ``ep > 1``;
* FSDP2 ``fully_shard`` on every decoder layer, then on the root (embedding, final norm, head),
  over all ranks (``state.fsdp_mesh``). The expert blocks are left out of FSDP
  (``ignored_params``): they are already split over ``ep``, and their gradients are summed over
  ``dp`` by ``finish_gradients``;
* gradients are summed, not averaged (divide factor 1): every microbatch loss is already
  divided by the whole step's denominator (``harts.trainer.step``);
* a bfloat16 model keeps bf16 parameters and reduces gradients in float32
  (``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``); float32 / float64 models
  run without mixed precision; ``cpu_offload`` puts the shards on the host (``CPUOffloadPolicy``).

Gradient reduction happens once per step: ``set_gradient_sync(model, last)`` before each
microbatch's backward turns FSDP's reduce-scatter on for the last one only.
"""

from __future__ import annotations

from typing import TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate

from harts.parallel.context_parallel import apply_row_split
from harts.parallel.expert_parallel import apply_expert_parallel, expert_parameters
from harts.parallel.mesh import ParallelState
from harts.parallel.tensor_parallel import apply_tensor_parallel, check_tensor_parallel, tensor_parallel_parameters

M = TypeVar("M", bound=nn.Module)

__all__ = ["parallelize", "set_gradient_sync", "finish_gradients", "clip_grad_norm", "is_parallelized"]


def parallelize(model: M, state: ParallelState) -> M:
    """Shard ``model`` in place for ``state`` (no-op on one process); returns it."""
    if not state.distributed:
        return model
    if state.row_ranks > 1:
        check_tensor_parallel(model.config, state.tp)  # type: ignore[arg-type]
        apply_row_split(model, state)  # type: ignore[arg-type]
    if state.tp > 1:
        apply_tensor_parallel(model, state)  # type: ignore[arg-type]
    if state.ep > 1:
        apply_expert_parallel(model, state)
    ignored = set(expert_parameters(model)) | set(tensor_parallel_parameters(model)) or None
    dtype = next(p.dtype for p in model.parameters())
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if dtype == torch.bfloat16
        else MixedPrecisionPolicy()
    )
    offload = CPUOffloadPolicy() if state.config.cpu_offload else OffloadPolicy()
    for module in [*model.layers, model]:  # type: ignore[misc]
        fully_shard(module, mesh=state.fsdp_mesh, mp_policy=mp, offload_policy=offload, ignored_params=ignored)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            # plain SUM collectives (gloo has no PREMUL_SUM; with factor 1 there is nothing to scale)
            m.set_force_sum_reduction_for_comms(True)
    return model


def is_parallelized(model: nn.Module) -> bool:
    return isinstance(model, FSDPModule)


def set_gradient_sync(model: nn.Module, sync: bool) -> None:
    """FSDP reduce-scatters gradients in the coming backward only when ``sync`` (the last microbatch)."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(sync)


def finish_gradients(model: nn.Module, state: ParallelState) -> None:
    """After the step's last backward: sum the gradients of the parameters FSDP does not hold
    over the ranks that hold the same block: expert blocks over ``dp x cp x tp``, tensor-parallel
    shards over ``dp x ep x cp`` (FSDP has reduced everything else)."""
    groups = []
    experts = expert_parameters(model)
    if experts and state.world_size // state.ep > 1:
        groups.append((experts, state.expert_replica_group()))
    shards = tensor_parallel_parameters(model)
    if shards and state.world_size // state.tp > 1:
        assert state.tp_mesh is not None
        groups.append((shards, state.tp_mesh.get_group("dp")))
    for p in experts + shards:
        if p.grad is None:  # no rank sent this block a row in any microbatch
            p.grad = torch.zeros_like(p)
    for params, group in groups:
        locals_ = [p.grad.to_local() for p in params]  # type: ignore[union-attr]
        # summed in at least float32, as FSDP reduces the other gradients of a bf16 model
        work = torch.promote_types(locals_[0].dtype, torch.float32)
        flat = torch.cat([g.reshape(-1).to(work) for g in locals_])
        dist.all_reduce(flat, group=group)
        offset = 0
        for g in locals_:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


def _replication(t: DTensor) -> int:
    """How many ranks hold each element of ``t`` (the product of its replicated mesh dims)."""
    n = 1
    for size, pl in zip(t.device_mesh.shape, t.placements):
        if isinstance(pl, Replicate):
            n *= size
    return n


@torch.no_grad()
def clip_grad_norm(model: nn.Module, max_norm: float, state: ParallelState) -> float:
    """``torch.nn.utils.clip_grad_norm_`` over sharded gradients (FSDP DTensors and expert blocks
    on different meshes): the squared norms of the local shards are summed over all ranks
    (replicated elements counted once), then every gradient is scaled as torch does."""
    params = [p for p in model.parameters() if p.grad is not None]
    if not state.distributed:
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    sq = torch.zeros((), dtype=torch.float64, device=state.device)
    for p in params:
        g = p.grad
        if isinstance(g, DTensor):
            sq += g.to_local().double().pow(2).sum() / _replication(g)
        else:
            sq += g.double().pow(2).sum() / state.world_size  # type: ignore[union-attr]
    dist.all_reduce(sq)
    total = float(sq.sqrt())
    coef = min(max_norm / (total + 1e-6), 1.0)
    for p in params:
        g = p.grad
        (g.to_local() if isinstance(g, DTensor) else g).mul_(coef)  # type: ignore[union-attr]
    return total
