"""Random initialisation of a ``HybridLM``, one tensor at a time, seeded by (seed, tensor name).

    specs = init_specs(model)                 # name -> InitSpec, from an unsharded (or meta) model
    full = init_value(specs[name], seed)      # that tensor's full value, on the host
    init_weights(model, seed)                 # every parameter and buffer of an unsharded model

Why per name: a model too large for one device is built on the meta device, sharded, and only
then given storage (``harts.parallel.build``); each rank then generates every tensor it holds a
shard of and keeps its shard. Drawing each tensor from its own generator, seeded by the model
seed and the tensor's name, makes the values independent of construction order, of the number
of ranks and of the sharding: the sharded model equals the one built whole on one process.
``init_value`` holds one full tensor on the host; ``init_weights`` only one float32 scratch
buffer of at most ``DRAW_CHUNK`` entries per host thread.

Values are drawn in float32 on the CPU and then cast to the model's dtype (as the layers did
before: float32 construction, then ``.to(dtype)``), so a float64 model and a bfloat16 model of
the same seed hold the same numbers up to rounding.

A tensor of more than ``DRAW_CHUNK`` entries is drawn in chunks of ``DRAW_CHUNK`` consecutive
(flat) entries, chunk i from a generator of its own seeded by (seed, name, i), the chunks on a
pool of host threads: torch's CPU generator is sequential (about 14 ns per normal draw), so the
7.8 B parameters of the full ``ling3_tiny`` took over a minute of the cold start drawn in one
stream per tensor. The values depend on (seed, name) only, never on the thread count; tensors
up to ``DRAW_CHUNK`` entries keep the one-stream values they always had. ``init_weights`` runs
every stream and chunk of the whole model on the pool and casts while copying in place (the
same values as one tensor at a time through ``init_value``, in a fraction of its time).

Distributions (the layers' own choices, by module and tensor):
``nn.Linear`` / ``nn.Embedding`` weights, the router and the experts: normal(0, initializer_range);
the depthwise short convolutions: uniform(+-1/sqrt(kernel_size)) (torch's ``Conv1d`` default);
``A_log``: log(uniform(1, 16)); ``dt_bias``, Mamba-2's skip ``D`` and norm weights: ones (zeros for zero-centred
norms); the router's correction bias (a buffer): zeros.
"""

from __future__ import annotations

import hashlib
import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["DRAW_CHUNK", "InitSpec", "init_specs", "init_value", "init_weights", "tensor_seed", "draw_seed"]

#: entries per independently seeded chunk of a large tensor's draw (module docstring)
DRAW_CHUNK = 1 << 24


def _settle_vml_dispatch() -> None:
    """Make the process's first MKL VML call (torch's CPU ``log_``, ``exp_``, ... where torch is
    built with MKL) here, on the importing thread, before any pool of this module runs.

    MKL detects the CPU type for VML on the first call and caches it without synchronisation:
    the detecting thread stores the raw type it read, then the type VML indexes its kernel
    tables by. Another thread's first VML call that reads the cache in between takes a kernel
    from the wrong row (on an AVX-512 Intel host, a low-accuracy one). The ``log_`` of the
    ``A_log`` draws were the first VML calls of a freshly spawned process, two of them side by
    side on the pool's threads, and one came back a few 1e-6 off. Once settled, the cache never
    changes again, so every later call, on any thread, takes the kernel a lone call would."""
    torch.ones(1, device="cpu").log_()


_settle_vml_dispatch()


@dataclass(frozen=True, slots=True)
class InitSpec:
    """How one parameter or buffer is drawn."""

    #: the tensor's name in ``model.state_dict()`` / ``named_parameters()``
    name: str
    #: "normal" | "uniform" | "log_uniform" | "ones" | "zeros"
    kind: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    #: std for "normal"; (low, high) bounds for "uniform" / "log_uniform"
    a: float = 0.0
    b: float = 0.0


def draw_seed() -> int:
    """A model seed from torch's global CPU generator (``HybridLM(config)`` without ``seed``), so
    ``torch.manual_seed(s); HybridLM(config)`` stays reproducible in ``s``."""
    return int(torch.randint(0, 2**62, (1,), device="cpu").item())


def tensor_seed(seed: int, name: str) -> int:
    """The generator seed of tensor ``name`` under model seed ``seed`` (stable across processes and
    Python runs: a hash of the text, not Python's salted ``hash``)."""
    digest = hashlib.sha256(f"{int(seed)}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _module_specs(prefix: str, module: nn.Module, std: float) -> dict[str, tuple[str, float, float]]:
    """(kind, a, b) of each of ``module``'s own parameters and buffers (not its children's)."""
    from harts.models.layers.kda import ShortConvolution
    from harts.models.layers.moe import Experts, TopKRouter
    from harts.models.layers.norms import GroupRMSNormGated, RMSNorm, RMSNormGated

    own = [n for n, _ in module.named_parameters(recurse=False)] + [n for n, _ in module.named_buffers(recurse=False)]
    out: dict[str, tuple[str, float, float]] = {}
    for n in own:
        # the experts by name too: expert parallelism swaps the module but keeps the names
        if (
            isinstance(module, (nn.Linear, nn.Embedding, Experts))
            or (isinstance(module, TopKRouter) and n == "weight")
            or n in ("gate_up_proj", "up_proj", "down_proj")
        ):
            spec = ("normal", std, 0.0)
        elif isinstance(module, TopKRouter):  # e_score_correction_bias
            spec = ("zeros", 0.0, 0.0)
        elif isinstance(module, ShortConvolution):
            # kaiming_uniform_(a=sqrt(5)) of a depthwise conv: bound 1/sqrt(fan_in), fan_in = kernel size
            bound = 1.0 / math.sqrt(module.weight.shape[1] * module.weight.shape[2])
            spec = ("uniform", -bound, bound)
        elif isinstance(module, RMSNorm):
            spec = ("zeros" if module.unit_offset else "ones", 0.0, 0.0)
        elif isinstance(module, (RMSNormGated, GroupRMSNormGated)) or n in ("dt_bias", "D"):
            spec = ("ones", 0.0, 0.0)
        elif n == "A_log":
            spec = ("log_uniform", 1.0, 16.0)
        else:
            raise AssertionError(f"no initialisation rule for {prefix}{n} ({type(module).__name__})")
        out[prefix + n] = spec
    return out


def init_specs(model: nn.Module) -> dict[str, InitSpec]:
    """``InitSpec`` of every parameter and buffer of an UNSHARDED ``HybridLM`` (on any device,
    meta included); read it before ``parallelize`` replaces the expert modules."""
    std = float(model.config.initializer_range)  # type: ignore[union-attr, arg-type]
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    specs: dict[str, InitSpec] = {}
    for prefix, module in model.named_modules():
        for name, (kind, a, b) in _module_specs(f"{prefix}." if prefix else "", module, std).items():
            t = tensors[name]
            specs[name] = InitSpec(name=name, kind=kind, shape=tuple(t.shape), dtype=t.dtype, a=a, b=b)
    return specs


def init_value(spec: InitSpec, seed: int) -> torch.Tensor:
    """The full value of ``spec``'s tensor under model seed ``seed``: a CPU tensor of its shape and
    dtype, drawn in float32 from generators of its own (``tensor_seed``; in ``DRAW_CHUNK`` chunks
    on host threads for large tensors, module docstring)."""
    if spec.kind in ("ones", "zeros"):
        fill = torch.ones if spec.kind == "ones" else torch.zeros
        return fill(spec.shape, dtype=spec.dtype, device="cpu")
    if spec.kind not in ("normal", "uniform", "log_uniform"):
        raise AssertionError(f"unknown init kind {spec.kind!r}")
    x = torch.empty(spec.shape, dtype=torch.float32, device="cpu")
    flat = x.view(-1)
    n = flat.numel()
    if n <= DRAW_CHUNK:
        _draw(flat, spec, tensor_seed(seed, spec.name))
    else:
        bounds = list(range(0, n, DRAW_CHUNK)) + [n]
        chunks = [
            (flat[lo:hi], tensor_seed(seed, f"{spec.name}#{i}")) for i, (lo, hi) in enumerate(zip(bounds, bounds[1:]))
        ]
        workers = min(len(chunks), _draw_threads())
        with ThreadPoolExecutor(max_workers=workers) as pool:  # torch's kernels release the GIL
            list(pool.map(lambda c: _draw(c[0], spec, c[1]), chunks))
    return x.to(spec.dtype)


def _draw_threads() -> int:
    """Host threads for chunked draws: the CPUs this process may run on (its affinity, which a
    launcher binding ranks to cores sets), else every CPU."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def _draw(out: torch.Tensor, spec: InitSpec, gen_seed: int) -> None:
    """Fill the float32 view ``out`` with ``spec``'s distribution from a generator seeded ``gen_seed``."""
    gen = torch.Generator(device="cpu").manual_seed(gen_seed)
    if spec.kind == "normal":
        out.normal_(0.0, spec.a, generator=gen)
    elif spec.kind == "uniform":
        out.uniform_(spec.a, spec.b, generator=gen)
    else:  # log_uniform
        out.uniform_(spec.a, spec.b, generator=gen).log_()


@torch.no_grad()
def init_weights(model: nn.Module, seed: int) -> None:
    """Set every parameter and buffer of an unsharded, materialised ``model`` to its seeded value:
    exactly ``init_value``'s, written in place.

    Every draw (a tensor of at most ``DRAW_CHUNK`` entries, or one chunk of a larger one) is one
    job on a pool of host threads (``_draw_threads``): drawn in float32 into the thread's own
    reused scratch buffer, then copied into its slice of the tensor, the copy casting to the
    model's dtype (for a GPU model, a synchronous host-to-device copy, after which the scratch is
    reused). The full ``ling3_tiny``'s 7.8 B parameters
    no longer pass through a fresh float32 tensor and a fresh cast copy per tensor on one thread,
    with every page of both touched for the first time (module docstring)."""
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    jobs: list[tuple[torch.Tensor, InitSpec, int]] = []
    for name, spec in init_specs(model).items():
        t = tensors[name]
        if spec.kind in ("ones", "zeros"):
            t.fill_(1.0 if spec.kind == "ones" else 0.0)
        elif not t.is_contiguous():  # not made by ``to_empty``: the plain path
            t.copy_(init_value(spec, seed))
        else:
            flat, n = t.view(-1), t.numel()
            if n <= DRAW_CHUNK:
                jobs.append((flat, spec, tensor_seed(seed, name)))
            else:
                jobs += [
                    (flat[lo : lo + DRAW_CHUNK], spec, tensor_seed(seed, f"{name}#{i}"))
                    for i, lo in enumerate(range(0, n, DRAW_CHUNK))
                ]
    scratch = threading.local()

    def run(job: tuple[torch.Tensor, InitSpec, int]) -> None:
        out, spec, gen_seed = job
        buf = getattr(scratch, "buf", None)
        if buf is None or buf.numel() < out.numel():
            buf = scratch.buf = torch.empty(max(out.numel(), min(DRAW_CHUNK, 1 << 20)), dtype=torch.float32)
        draw = buf[: out.numel()]
        with torch.no_grad():  # grad mode is per thread; the views were made without it
            _draw(draw, spec, gen_seed)
            out.copy_(draw)

    # largest first: the pool's threads end together
    jobs.sort(key=lambda j: -j[0].numel())
    with ThreadPoolExecutor(max_workers=max(1, min(len(jobs), _draw_threads()))) as pool:
        list(pool.map(run, jobs))
    if any(t.is_cuda for t in tensors.values()):
        torch.cuda.synchronize()
