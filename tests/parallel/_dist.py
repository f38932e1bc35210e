"""Run a function on N gloo processes (spawned, CPU) and collect what rank 0 saved."""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

from harts import HybridConfig, HybridLM


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: seconds a rank may run before it prints every thread's stack and exits (a rank stuck in a
#: collective fails its test with the stacks instead of holding the suite until CI's limit)
RANK_TIMEOUT = 600


def _entry(rank: int, world: int, store: str, fn: Callable[..., Any], args: tuple, out: str) -> None:
    import faulthandler

    import torch.distributed as dist

    faulthandler.dump_traceback_later(RANK_TIMEOUT, exit=True)
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    # a file store, not a TCP port: a port picked free can be taken by another test process
    # (pytest -n) before the ranks bind it, and a rank that cannot rendezvous aborts
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        result = fn(*args)
        if rank == 0:
            torch.save(result, out)
    finally:
        dist.destroy_process_group()
    # Done: leave without the interpreter's teardown. With expert parallelism (all-to-all through
    # functional collectives) a rank that had finished its work and destroyed its group still
    # aborted now and then in torch's C++ teardown ("terminate called without an active
    # exception", SIGABRT; about 1 run in 10 of the EP2 test here, once in CI), after every
    # result was computed and saved; a clean exit code is all spawn needs from here.
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(world: int, fn: Callable[..., Any], *args: Any, tmp: str) -> Any:
    """``fn(*args)`` on ``world`` gloo ranks; returns rank 0's result (``fn`` must be importable)."""
    out = os.path.join(tmp, f"result-{world}-{fn.__name__}.pt")
    store = os.path.join(tmp, f"store-{uuid.uuid4().hex}")  # new for every spawn
    mp.start_processes(_entry, args=(world, store, fn, args, out), nprocs=world, join=True, start_method="spawn")
    return torch.load(out, weights_only=False)


def moe_model(seed: int = 0, **over: Any) -> HybridLM:
    """float64 tiny MoE model (4 experts, top-2, shared expert; layers 1.. are MoE)."""
    torch.manual_seed(seed)
    cfg = HybridConfig.tiny(dtype="float64", vocab_size=256, **over)
    return HybridLM(cfg)


def full_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter gradient at its full shape (one collective on every rank under a mesh)."""
    return gather_full({n: p.grad for n, p in model.named_parameters() if p.grad is not None})


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter at its full shape (one collective on every rank under a mesh)."""
    return gather_full(dict(model.named_parameters()))


def gather_full(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` with every DTensor assembled to its full shape from all ranks' local shards.

    One ``all_gather_object`` of every rank's shards and their global offsets (the offsets DCP
    writes with), then each rank places them: replicas of a region (TP-, EP- or CP-replicated
    dims) must agree to 1e-12 relative, and every element must come from some rank. Not
    ``DTensor.full_tensor``: that is one functional-collective all-gather per mesh dim and tensor,
    and a 4-rank gloo run once stalled in one of those waits after its step under full-suite load
    (never reproduced); one plain c10d collective per call keeps the check off that path.
    """
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    out: dict[str, torch.Tensor] = {}
    mine: dict[str, tuple[tuple[int, ...], tuple[int, ...], torch.Tensor]] = {}
    for name, t in tensors.items():
        if not isinstance(t, DTensor):
            out[name] = t.detach().clone()
            continue
        assert not any(p.is_partial() for p in t.placements), (name, t.placements)
        shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        local = t.to_local().detach().clone()
        assert tuple(local.shape) == tuple(shape), (name, tuple(local.shape), tuple(shape))
        mine[name] = (tuple(t.shape), tuple(offset), local)
    if not mine:
        return out
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    for name, (shape, _, first) in mine.items():
        full = torch.zeros(shape, dtype=first.dtype)
        seen = torch.zeros(shape, dtype=torch.bool)
        for rank, pieces in enumerate(every):
            if name not in pieces:
                continue
            _, offset, local = pieces[name]
            region = tuple(slice(o, o + n) for o, n in zip(offset, local.shape))
            old, known = full[region], seen[region]
            if known.any():
                scale = max(float(local.abs().max()), 1e-30)
                err = float((old[known] - local[known]).abs().max()) / scale
                assert err <= 1e-12, (name, "replica of rank", rank, "differs", err)
            full[region] = local
            seen[region] = True
        assert bool(seen.all()), (name, "elements no rank holds", int((~seen).sum()))
        out[name] = full
    return out


def assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], tol: float = 1e-9) -> None:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    for name in a:
        assert a[name].shape == b[name].shape, name
        scale = max(float(b[name].abs().max()), 1e-30)
        err = float((a[name] - b[name]).abs().max()) / scale
        assert err <= tol, (name, err)
