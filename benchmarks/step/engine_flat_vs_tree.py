"""Flat trajectories through the engine against the same batch given as a tree.

A Tinker-style client sends one token list per trajectory; the engine finds the shared
prefixes itself (``harts.trainer.engine``). A batch that arrives as an explicit rollout tree
(``RolloutBatch.tree``) skips that search. This runs one step's batch of a synthetic agentic
workload through ``Engine.forward_backward`` (importance sampling, the batch's own advantages
and sampler log-probs) three ways, on the same model and execution settings:

    baseline   trajectory-wise (``ExecutionConfig(mode="trajectory")``), the batch as a tree
    tree       compact, the batch as a tree
    flat       compact, the batch as a list of dicts of Python lists (conversion, prefix
               detection and planning inside the timed call)

and prints each one's seconds, the speedups over the baseline and ``flat / tree`` (the share
of the tree's speedup that flat input keeps: ``t_tree / t_flat``), plus JSON. Gradients are
zeroed between calls (no optimizer step), so every call sees the same weights. Each compact
variant runs ``--repeats`` times, alternating, after one untimed warm-up; the median is
reported. The baseline runs once, after a warm-up on its first few trajectories.

    python -m benchmarks.step.engine_flat_vs_tree --model ling3_tiny --pattern KKKM --workload medium \
        --device cuda --dtype bfloat16 --la-backend auto --recompute --json out.json
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from benchmarks._runner import (
    add_device_argument,
    add_dtype_argument,
    add_json_argument,
    device_of,
    parse,
    parser,
    run,
    sync,
    write_json,
)
from harts.models.config import HybridConfig
from harts.models.execution.config import ExecutionConfig
from harts.models.hybrid_lm import HybridLM
from harts.trainer.engine import Engine
from harts.tree import workloads
from harts.tree.batch import RolloutBatch


def _flat(batch: RolloutBatch) -> list[dict[str, Any]]:
    """The batch as a client sends it: per-target weights (its action mask), advantages and
    sampler log-probs, as Python lists."""
    out = []
    for j in range(batch.num_trajectories):
        a, b = int(batch.offsets[j]), int(batch.offsets[j + 1])
        assert batch.old_logprobs is not None
        out.append(
            {
                "tokens": batch.tokens[a:b].tolist(),
                "weights": batch.action_mask[a + 1 : b].astype(float).tolist(),
                "advantages": batch.advantages[a + 1 : b].tolist(),
                "logprobs": batch.old_logprobs[a + 1 : b].tolist(),
            }
        )
    return out


def _timed(engine: Engine, inputs: Any, device: torch.device) -> tuple[float, float]:
    """(seconds, loss) of one forward_backward, gradients dropped afterwards."""
    sync(device)
    t0 = time.perf_counter()
    out = engine.forward_backward(inputs, "importance_sampling")
    sync(device)
    seconds = time.perf_counter() - t0
    engine.optimizer.zero_grad(set_to_none=True)
    return seconds, out.loss


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__, __file__)
    p.add_argument("--model", default="tiny", help="HybridConfig preset")
    p.add_argument("--pattern", default=None, help="layer pattern override, e.g. KKKM")
    p.add_argument("--workload", default="small")
    p.add_argument("--step", type=int, default=0)
    add_device_argument(p, "cpu")
    add_dtype_argument(p, ["float32", "float64", "bfloat16"], "float32")
    p.add_argument("--capacity", type=int, default=65_536)
    p.add_argument("--la-backend", default="reference")
    p.add_argument("--recompute", action="store_true", help="activation recomputation, the MoE block kept")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-baseline", action="store_true")
    add_json_argument(p)
    args = parse(p, argv)

    device = device_of(args.device)
    batch = workloads.generate(args.workload, step=args.step)
    fields: dict[str, Any] = {"dtype": args.dtype}
    if args.pattern:
        fields["layer_pattern"] = args.pattern
    config = HybridConfig.preset(args.model, **fields)
    if batch.vocab_size and batch.vocab_size > config.vocab_size:
        config = config.replace(vocab_size=batch.vocab_size)
    execution = ExecutionConfig(
        linear_attention_backend=args.la_backend,
        recompute=args.recompute,
        recompute_skip=("moe",) if args.recompute and config.num_experts else (),
    )
    with torch.device(device):
        model = HybridLM(config, seed=0)
    compact = Engine(model, execution, capacity=args.capacity)
    flat = _flat(batch)
    raw = batch.num_tokens

    def timed(name: str) -> Callable[[], tuple[float, float]]:
        return lambda: _timed(compact, batch if name == "tree" else flat, device)

    t0 = time.perf_counter()
    timed("tree")()  # warm-up: compilation, autotuning, allocator
    warmup = time.perf_counter() - t0
    times: dict[str, list[float]] = {"tree": [], "flat": []}
    losses: dict[str, float] = {}
    for _ in range(args.repeats):
        for name in ("tree", "flat"):
            sec, loss = timed(name)()
            times[name].append(sec)
            losses[name] = loss
    result: dict[str, Any] = {
        "model": args.model,
        "pattern": config.layer_pattern,
        "workload": args.workload,
        "step": args.step,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": args.dtype,
        "capacity": args.capacity,
        "la_backend": args.la_backend,
        "recompute": args.recompute,
        "raw_tokens": raw,
        "trajectories": batch.num_trajectories,
        "warmup_seconds": warmup,
        "seconds": {k: statistics.median(v) for k, v in times.items()},
        "runs": times,
        "loss": losses,
    }
    if not args.no_baseline:
        baseline = Engine(model, ExecutionConfig.of(execution, mode="trajectory"), capacity=args.capacity)
        _timed(baseline, batch.select(np.arange(min(3, batch.num_trajectories))), device)
        result["seconds"]["baseline"], result["loss"]["baseline"] = _timed(baseline, batch, device)
    sec = result["seconds"]
    result["flat_share_of_tree_speedup"] = sec["tree"] / sec["flat"]
    if "baseline" in sec:
        result["speedup"] = {k: sec["baseline"] / sec[k] for k in ("tree", "flat")}
    print(
        f"{args.model} {config.layer_pattern} on {result['device']}, {args.workload} step {args.step}: {raw:,} raw tokens"
    )
    print(f"{'input':<10} {'seconds':>9} {'speedup':>8} {'loss':>14}")
    for k in ("baseline", "tree", "flat"):
        if k in sec:
            sp = result.get("speedup", {}).get(k, 1.0 if k == "baseline" else float("nan"))
            print(f"{k:<10} {sec[k]:>9.3f} {sp:>7.2f}x {result['loss'][k]:>14.6g}")
    print(f"flat keeps {result['flat_share_of_tree_speedup']:.3f} of the tree's speedup (t_tree / t_flat)")
    write_json(args, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(run(main))
