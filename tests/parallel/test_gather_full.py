"""The test helper that assembles sharded tensors (``gather_full``) checks what it assembles:
uneven and 2-D shards come back whole, and replicas that disagree fail."""

from __future__ import annotations

import torch

from tests.parallel._dist import spawn


def _gather(disagree: bool) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    from tests.parallel._dist import gather_full

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    g = torch.Generator().manual_seed(0)
    whole = {"uneven": torch.randn(5, 3, dtype=torch.float64, generator=g), "two_d": torch.randn(6, 4, generator=g)}
    tensors = {
        "uneven": distribute_tensor(whole["uneven"], mesh["dp"], [Shard(0)]),
        "two_d": distribute_tensor(whole["two_d"], mesh, [Shard(0), Shard(1)]),
        "plain": whole["two_d"],
    }
    local = whole["uneven"][:2].clone()
    if disagree and rank == 3:
        local[0, 0] += 1e-6
    tensors["replicated"] = DTensor.from_local(local, mesh, [Replicate(), Replicate()], run_check=False)
    try:
        got = gather_full(tensors)
    except AssertionError as e:
        return {"error": str(e)}
    return {"got": got, "whole": whole}


def test_gather_full_assembles_shards(tmp_path):
    out = spawn(4, _gather, False, tmp=str(tmp_path))
    got, whole = out["got"], out["whole"]
    assert torch.equal(got["uneven"], whole["uneven"])
    assert torch.equal(got["two_d"], whole["two_d"])
    assert torch.equal(got["plain"], whole["two_d"])
    assert torch.equal(got["replicated"], whole["uneven"][:2])


def test_gather_full_refuses_replicas_that_disagree(tmp_path):
    out = spawn(4, _gather, True, tmp=str(tmp_path))
    assert "replicated" in out["error"] and "replica of rank" in out["error"], out
