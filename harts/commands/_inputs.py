"""Shared command-line inputs: a workload preset or batch file, and a model preset or checkpoint."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Iterator
from typing import Any


def add_workload_arguments(p: argparse.ArgumentParser, default: str = "tiny") -> None:
    p.add_argument(
        "--workload", default=default, metavar="NAME|FILE",
        help=f"built-in workload preset (tiny, small, medium, swe) or a batch file (.jsonl/.parquet); default {default}",
    )
    p.add_argument("--steps", type=int, default=None, help="steps to run (default: the preset's; 1 for a file)")
    p.add_argument("--seed", type=int, default=0)


def add_model_arguments(p: argparse.ArgumentParser, default_dtype: str = "float32") -> None:
    p.add_argument("--model", default="tiny", metavar="PRESET|PATH",
                   help="model preset (tiny, ling3_tiny) or a transformers checkpoint directory "
                        "(BailingHybrid / Qwen3-Next / Kimi Linear); default tiny")
    p.add_argument("--pattern", default=None, help="override a preset's layer pattern, e.g. KKKM")
    p.add_argument("--dtype", default=default_dtype, choices=["float32", "float64", "bfloat16"])
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    p.add_argument("--la-backend", default="reference", choices=["reference", "fla", "auto"],
                   help="linear-attention core: torch reference, fla-core (CUDA), or auto; default reference")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads on CPU; default 1, 0 = torch's default")


def batch_sources(
    files: list[str], workload: str | None, steps: int | None, seed: int, *, default: str = "small"
) -> list[tuple[str, Callable[[], Any]]]:
    """``(label, make_batch)`` per step: each file is one step, or the preset's steps (lazy)."""
    from harts.tree.batch import RolloutBatch
    from harts.tree.workloads import PRESETS, generate

    if files and workload:
        raise ValueError("give FILEs or --workload, not both")
    if files:
        return [(f, lambda f=f: RolloutBatch.load(f)) for f in files]
    name = workload or default
    if name not in PRESETS:
        raise ValueError(f"unknown workload {name!r}; presets: {', '.join(PRESETS)}")
    n = PRESETS[name].steps if steps is None else steps
    return [(f"{name}[{s}]", lambda s=s: generate(name, step=s, seed=seed)) for s in range(n)]


def workload_batches(args: argparse.Namespace) -> Iterator[Any]:
    """Yield the RolloutBatch of every requested step."""
    from harts.tree.batch import RolloutBatch
    from harts.tree.workloads import PRESETS, generate

    w = args.workload
    if w in PRESETS:
        n = PRESETS[w].steps if args.steps is None else args.steps
        for s in range(n):
            yield generate(w, step=s, seed=args.seed)
    elif os.path.exists(w):
        batch = RolloutBatch.load(w)
        for _ in range(1 if args.steps is None else args.steps):
            yield batch
    else:
        raise ValueError(f"--workload {w!r} is neither a preset ({', '.join(PRESETS)}) nor an existing file")


def build_model(args: argparse.Namespace, vocab_size: int) -> Any:
    """The model named by ``--model`` on ``--device`` (threads set first)."""
    import torch

    from harts.models.loading import load_model

    if args.threads < 0:
        raise ValueError(f"--threads must be >= 0, got {args.threads}")
    if args.threads:
        torch.set_num_threads(args.threads)
    return load_model(args.model, vocab_size=vocab_size, dtype=args.dtype, layer_pattern=args.pattern,
                      seed=args.seed, device=args.device)
