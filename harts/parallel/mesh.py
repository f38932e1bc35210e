"""Who runs what: the (dp, ep) device mesh of a run and the checks that it fits the world.

``harts train --dp D --ep E`` runs on ``D * E`` ranks (``torchrun --nproc-per-node D*E``).
Every rank is one data replica of the step plan (the plan has ``D * E`` replicas, paper §3.2):
it runs its replica's microbatches in slot order. The two mesh dimensions say how the
*parameters* are spread:

* ``ep``: each MoE layer's E experts are split into ``ep`` contiguous blocks; tokens travel to
  the rank that owns their expert (``expert_parallel.py``);
* ``dp``: the ``dp`` ranks that own the same expert block hold those experts as replicas and
  sum their gradients; every other parameter is FSDP2-sharded over all ``D * E`` ranks.

One process (no process group) is the same program with D = E = 1 and no mesh.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from harts.errors import UserError

__all__ = ["ParallelConfig", "ParallelState", "init_parallel", "launch_world_size", "setup_process_group"]


@dataclass(kw_only=True, slots=True)
class ParallelConfig:
    """How a run is spread over ranks (``harts train --dp D --ep E``)."""

    #: ranks that hold the same expert block (non-expert parameters are sharded over all ranks)
    dp: int = 1
    #: expert-parallel degree: each MoE layer's experts are split into ``ep`` blocks
    ep: int = 1
    #: FSDP2 CPU offload of the sharded parameters, gradients and optimizer state
    cpu_offload: bool = False

    @property
    def world_size(self) -> int:
        return self.dp * self.ep

    def check(self, world_size: int, num_experts: int) -> None:
        """Clear errors for a mesh that does not match the launch or does not divide the experts."""
        for name, v in (("dp", self.dp), ("ep", self.ep)):
            if int(v) != v or v < 1:
                raise UserError(f"--{name} must be a positive integer, got {v!r}")
        if self.world_size != world_size:
            raise UserError(
                f"--dp {self.dp} x --ep {self.ep} = {self.world_size} ranks, but the launch has "
                f"{world_size} (torchrun --nproc-per-node {self.world_size}, or --dp {world_size // self.ep}"
                f" --ep {self.ep} for {world_size} ranks)"
                if world_size % self.ep == 0
                else f"--dp {self.dp} x --ep {self.ep} = {self.world_size} ranks, but the launch has "
                f"{world_size} (torchrun --nproc-per-node {self.world_size})"
            )
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
    #: [dp, ep] mesh (names "dp", "ep"); None on one process
    mesh: DeviceMesh | None = None
    #: 1-D mesh over all ranks that FSDP2 shards the non-expert parameters over
    fsdp_mesh: DeviceMesh | None = None

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def ep(self) -> int:
        return self.config.ep

    @property
    def dp(self) -> int:
        return self.config.dp

    def group(self, dim: str) -> dist.ProcessGroup:
        assert self.mesh is not None, "no mesh on one process"
        return self.mesh.get_group(dim)


def launch_world_size() -> int:
    """Ranks in this launch: ``WORLD_SIZE`` set by torchrun (1 without it)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def setup_process_group(device: str) -> str:
    """Under torchrun (``WORLD_SIZE`` > 1): join the process group (NCCL for CUDA, gloo for CPU)
    and return this rank's device (``cuda`` becomes ``cuda:LOCAL_RANK``); else ``device`` as is."""
    if launch_world_size() <= 1 or dist.is_initialized():
        return device
    if device.startswith("cuda"):
        if device == "cuda":
            device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
        torch.cuda.set_device(torch.device(device))
        dist.init_process_group("nccl", device_id=torch.device(device))
    else:
        dist.init_process_group("gloo")
    return device


def init_parallel(config: ParallelConfig, device: torch.device | str, num_experts: int) -> ParallelState:
    """The mesh for ``config`` on the current process group (checked against its world size).

    Without a process group the world is one process and ``config`` must be D = E = 1.
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
    mesh = init_device_mesh(device.type, (config.dp, config.ep), mesh_dim_names=("dp", "ep"))
    fsdp_mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("fsdp",))
    return ParallelState(
        config=config, rank=dist.get_rank(), world_size=world, device=device, mesh=mesh, fsdp_mesh=fsdp_mesh
    )
