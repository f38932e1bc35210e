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
    """Every parameter gradient, gathered to its full shape (collective under a mesh)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for n, p in model.named_parameters():
        g = p.grad
        if g is None:
            continue
        out[n] = (g.full_tensor() if isinstance(g, DTensor) else g).detach().clone()
    return out


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}


def assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], tol: float = 1e-9) -> None:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    for name in a:
        assert a[name].shape == b[name].shape, name
        scale = max(float(b[name].abs().max()), 1e-30)
        err = float((a[name] - b[name]).abs().max()) / scale
        assert err <= tol, (name, err)
