"""Who runs what: the (dp, ep, cp, tp) device mesh of a run and the checks that it fits the world.

``harts train --dp D --ep E --cp C --tp P`` runs on ``D * E * C * P`` ranks (``torchrun
--nproc-per-node D*E*C*P``). The ``C * P`` consecutive ranks of a *row group* run the same
microbatches, each holding ``1 / (C P)`` of the compact rows between the token mixers and FFNs
(``context_parallel.py``): Ulysses context parallelism over ``cp``, tensor parallelism with
sequence parallelism over ``tp`` (``tensor_parallel.py``). Every row group is one data replica
of the step plan (the plan has ``D * E`` replicas, paper §3.2) and runs its replica's
microbatches in slot order. The mesh dimensions say how the *parameters* are spread:

* ``tp``: the attention, linear-attention and MLP projections are split by heads / columns into
  ``tp`` shards; the ranks that hold the same shard sum its gradients
  (``ParallelState.tp_mesh``);
* ``ep``: each MoE layer's E experts are split into ``ep`` contiguous blocks; tokens travel to
  the rank that owns their expert (``expert_parallel.py``);
* ``dp`` (and ``cp``, ``tp``): the ranks that own the same expert block hold those experts as
  replicas and sum their gradients (``ParallelState.expert_mesh``); every other parameter is
  FSDP2-sharded over all ranks.

Rank ``r`` sits at ``(dp, ep, cp, tp) = (r // (E C P), (r // (C P)) % E, (r // P) % C, r % P)``:
the TP and CP groups, whose collectives run around every token mixer, are the innermost
dimensions (neighbouring ranks, on one host where a host holds C P devices).

One process (no process group) is the same program with D = E = C = P = 1 and no mesh.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from harts.errors import UserError

__all__ = [
    "ParallelConfig",
    "ParallelState",
    "check_all_to_all",
    "check_layout",
    "check_local_devices",
    "init_parallel",
    "launch_mesh",
    "launch_rank",
    "launch_world_size",
    "setup_process_group",
]


@dataclass(kw_only=True, slots=True)
class ParallelConfig:
    """How a run is spread over ranks (``harts train --dp D --ep E``)."""

    #: ranks that hold the same expert block (non-expert parameters are sharded over all ranks)
    dp: int = 1
    #: expert-parallel degree: each MoE layer's experts are split into ``ep`` blocks
    ep: int = 1
    #: Ulysses context-parallel degree: the ranks that split one microbatch's compact rows
    cp: int = 1
    #: tensor-parallel degree (with sequence parallelism): the ranks that split the projections
    tp: int = 1
    #: FSDP2 CPU offload of the sharded parameters, gradients and optimizer state
    cpu_offload: bool = False

    @property
    def world_size(self) -> int:
        return self.dp * self.ep * self.cp * self.tp

    @property
    def replicas(self) -> int:
        """Data replicas of the step plan: one per row group (cp x tp ranks)."""
        return self.dp * self.ep

    def _words(self) -> str:
        cp = f" x --cp {self.cp}" if self.cp > 1 else ""
        tp = f" x --tp {self.tp}" if self.tp > 1 else ""
        return f"--dp {self.dp} x --ep {self.ep}{cp}{tp} = {self.world_size} ranks"

    def check(self, world_size: int, num_experts: int) -> None:
        """Clear errors for a mesh that does not match the launch or does not divide the experts."""
        self.check_world(world_size)
        self.check_experts(num_experts)

    def check_world(self, world_size: int) -> None:
        """A one-line error unless every degree is a positive integer and the mesh has the
        launch's ``world_size`` ranks (it names both numbers); no model is needed."""
        for name, v in (("dp", self.dp), ("ep", self.ep), ("cp", self.cp), ("tp", self.tp)):
            if int(v) != v or v < 1:
                raise UserError(f"--{name} must be a positive integer, got {v!r}")
        if self.world_size != world_size:
            other = self.ep * self.cp * self.tp
            raise UserError(
                f"{self._words()}, but the launch has {world_size} (torchrun --nproc-per-node "
                f"{self.world_size}, or --dp {world_size // other} for {world_size} ranks)"
                if world_size % other == 0
                else f"{self._words()}, but the launch has {world_size} (torchrun --nproc-per-node "
                f"{self.world_size}); --ep {self.ep} x --cp {self.cp} x --tp {self.tp} = {other} does not "
                f"divide {world_size}"
            )

    def check_experts(self, num_experts: int) -> None:
        """A one-line error unless ``ep`` divides the model's ``num_experts`` experts per MoE
        layer (0: a dense model, which only ``ep`` 1 fits)."""
        if self.ep > 1:
            if num_experts == 0:
                raise UserError(f"--ep {self.ep}: the model has no MoE layers to split; use --ep 1")
            if num_experts % self.ep:
                raise UserError(
                    f"--ep {self.ep} does not divide the model's {num_experts} experts per MoE layer; "
                    f"use a divisor of {num_experts}"
                )


@dataclass
class ParallelState:
    """The mesh of a running job: built by ``init_parallel``, read by ``parallelize`` and the loop."""

    config: ParallelConfig
    rank: int
    world_size: int
    device: torch.device
    #: [dp, ep, cp, tp] mesh (names "dp", "ep", "cp", "tp"); None on one process
    mesh: DeviceMesh | None = None
    #: 1-D mesh over all ranks that FSDP2 shards the non-expert parameters over
    fsdp_mesh: DeviceMesh | None = None
    #: [dp * cp, ep] mesh of the expert blocks (names "dp", "ep"): dim "dp" holds the ranks that
    #: own the same block (replicas, gradients summed), dim "ep" the blocks; None on one process
    expert_mesh: DeviceMesh | None = None
    #: [world / tp, tp] mesh of the tensor-parallel shards (names "dp", "tp"): dim "dp" holds the
    #: ranks with the same shard (gradients summed), dim "tp" the shards; None on one process
    tp_mesh: DeviceMesh | None = None
    #: [replicas, cp * tp] mesh (names "replica", "rows"): dim "rows" is this rank's row group,
    #: the ranks that split each microbatch's rows; None on one process
    rows_mesh: DeviceMesh | None = None

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def ep(self) -> int:
        return self.config.ep

    @property
    def dp(self) -> int:
        return self.config.dp

    @property
    def cp(self) -> int:
        return self.config.cp

    @property
    def tp(self) -> int:
        return self.config.tp

    @property
    def row_ranks(self) -> int:
        """Ranks of a row group (``cp * tp``): they split each microbatch's rows."""
        return self.cp * self.tp

    @property
    def replicas(self) -> int:
        """Data replicas that run distinct microbatches: ``world_size / (cp tp)``."""
        return self.world_size // self.row_ranks

    @property
    def replica_rank(self) -> int:
        """This rank's data replica (its row group's index)."""
        return self.rank // self.row_ranks

    @property
    def cp_rank(self) -> int:
        """This rank's place in its context-parallel group."""
        return (self.rank // self.tp) % self.cp

    @property
    def tp_rank(self) -> int:
        """This rank's place in its tensor-parallel group (which shard of the projections)."""
        return self.rank % self.tp

    @property
    def row_rank(self) -> int:
        """This rank's place in its row group: it holds the ``row_rank``-th block of the rows."""
        return self.rank % self.row_ranks

    def group(self, dim: str) -> dist.ProcessGroup:
        assert self.mesh is not None, "no mesh on one process"
        return self.mesh.get_group(dim)

    def expert_replica_group(self) -> dist.ProcessGroup:
        """The ranks holding the same expert block (dp x cp x tp), whose expert gradients are summed."""
        assert self.expert_mesh is not None, "no mesh on one process"
        return self.expert_mesh.get_group("dp")


def check_layout(world: int, *, ep: int = 1, cp: int = 1, tp: int = 1, capacity: int | None = None) -> None:
    """One-line UserErrors, before any model is built, for degrees that cannot split ``world``
    ranks (each of ``ep``, ``cp``, ``tp`` and their product must divide it) or a microbatch
    ``capacity`` that the ``cp * tp`` ranks of a row group cannot split evenly (each holds
    ``capacity / (cp tp)`` rows). The data-parallel degree is what remains: ``world / (ep cp tp)``."""
    for name, v in (("ep", ep), ("cp", cp), ("tp", tp)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise UserError(f"--{name} must be a positive integer, got {v!r}")
        if v > world or world % v:
            raise UserError(f"--{name} {v} does not divide the {world} rank(s) of this launch")
    other = ep * cp * tp
    if world % other:
        raise UserError(f"--ep {ep} x --cp {cp} x --tp {tp} = {other} does not divide the {world} ranks")
    rows = cp * tp
    if capacity is not None and capacity % rows:
        raise UserError(
            f"--cp {cp} x --tp {tp} = {rows} does not divide --capacity {capacity} "
            "(each rank of a row group holds capacity / (cp tp) rows)"
        )


def launch_mesh(
    world: int,
    *,
    dp: int | None = None,
    ep: int = 1,
    cp: int = 1,
    tp: int = 1,
    capacity: int | None = None,
    cpu_offload: bool = False,
) -> ParallelConfig:
    """The mesh that ``--dp/--ep/--cp/--tp`` ask of a launch of ``world`` ranks (``dp`` None:
    ``world / (ep cp tp)``), checked before any model is built so that a bad layout costs one
    line naming both numbers rather than a model (``check_layout``, then the mesh has ``world``
    ranks). The model's heads and experts are checked once its structure is known
    (``check_context_parallel``, ``check_tensor_parallel``, ``ParallelConfig.check_experts``)."""
    check_layout(world, ep=ep, cp=cp, tp=tp, capacity=capacity)
    config = ParallelConfig(dp=dp or world // (ep * cp * tp), ep=ep, cp=cp, tp=tp, cpu_offload=cpu_offload)
    config.check_world(world)
    return config


def launch_world_size() -> int:
    """Ranks in this launch: ``WORLD_SIZE`` set by torchrun (1 without it)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def launch_rank() -> int:
    """This process's rank in the launch: ``RANK`` set by torchrun (0 without it), known before
    the process group exists, so that one rank alone prints or checks an output path."""
    return int(os.environ.get("RANK", "0") or 0)


def setup_process_group(device: str) -> str:
    """Under torchrun (``WORLD_SIZE`` > 1): join the process group (NCCL for CUDA, gloo for CPU)
    and return this rank's device (``cuda`` becomes ``cuda:LOCAL_RANK``); else ``device`` as is."""
    if launch_world_size() <= 1 or dist.is_initialized():
        return device
    if device.startswith("cuda"):
        check_local_devices(int(os.environ.get("LOCAL_WORLD_SIZE", launch_world_size())))
        if device == "cuda":
            device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
        torch.cuda.set_device(torch.device(device))
        dist.init_process_group("nccl", device_id=torch.device(device))
    else:
        dist.init_process_group("gloo")
    return device


def check_local_devices(local_ranks: int) -> None:
    """UserError when this host starts more ranks than it has CUDA devices (one device a rank),
    before any process group or model exists."""
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if local_ranks > have:
        raise UserError(
            f"{local_ranks} ranks on this host (torchrun --nproc-per-node {local_ranks}) need {local_ranks} CUDA "
            f"devices, one a rank; this host has {have} (the mesh --dp x --ep x --cp must fit them)"
        )


def init_parallel(config: ParallelConfig, device: torch.device | str, num_experts: int) -> ParallelState:
    """The mesh for ``config`` on the current process group (checked against its world size).

    Without a process group the world is one process and ``config`` must be D = E = C = P = 1.
    Context parallelism is refused here, before any model is built, on a backend whose
    all-to-all does not run (``check_all_to_all``).
    """
    device = torch.device(device)
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    config.check(world, num_experts)
    if config.cpu_offload and (device.type != "cuda" or world == 1):
        raise UserError(
            "--cpu-offload moves the FSDP2 shards from the GPUs to host memory: it needs --device cuda "
            f"and several ranks (torchrun); this run has {world} rank(s) on {device.type}"
        )
    if world == 1:
        return ParallelState(config=config, rank=0, world_size=1, device=device)
    dims = (config.dp, config.ep, config.cp, config.tp)
    mesh = init_device_mesh(device.type, dims, mesh_dim_names=("dp", "ep", "cp", "tp"))
    fsdp_mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("fsdp",))
    ranks = torch.arange(world).view(*dims)
    # rank (d, e, c, t) holds expert block e; its replicas are every (d, c, t)
    by_expert = ranks.permute(0, 2, 3, 1).reshape(world // config.ep, config.ep)
    rows = config.cp * config.tp
    state = ParallelState(
        config=config,
        rank=dist.get_rank(),
        world_size=world,
        device=device,
        mesh=mesh,
        fsdp_mesh=fsdp_mesh,
        expert_mesh=DeviceMesh(device.type, by_expert, mesh_dim_names=("dp", "ep")),
        tp_mesh=DeviceMesh(device.type, ranks.reshape(world // config.tp, config.tp), mesh_dim_names=("dp", "tp")),
        rows_mesh=DeviceMesh(device.type, ranks.reshape(world // rows, rows), mesh_dim_names=("replica", "rows")),
    )
    if config.cp > 1:
        check_all_to_all(state.group("cp"), device, config.cp)
    return state


def check_all_to_all(group: dist.ProcessGroup, device: torch.device, cp: int) -> None:
    """UserError when ``group``'s backend cannot run the all-to-all that context parallelism
    exchanges rows with (one tiny exchange, tried on every rank of the group)."""
    backend = dist.get_backend(group)
    x = torch.zeros(cp, device=device)
    try:
        dist.all_to_all_single(torch.empty_like(x), x, group=group)
    except (RuntimeError, NotImplementedError, ValueError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UserError(
            f"--cp {cp} exchanges rows by all-to-all, which the {backend} backend on {device.type} cannot run "
            f"({first}); use nccl on CUDA or gloo on CPU"
        ) from None
