"""Several GPUs against one: a correctness comparison and a scaling run (``scripts/multi_gpu.sh``).

Launch each part with ``torchrun --nproc-per-node N -m benchmarks.step.multi_gpu PART ...`` (or plain
``python -m`` for one process). NCCL on CUDA, gloo on CPU (the CPU path is what the tests run).

``correctness``: one step's gradients (no update) on a fixed model and global batch, with the
step plan's ``--replicas`` fixed, so one process (every replica's microbatches in sequence) and
N ranks compute the same microbatches. Writes the loss, MoE objective, expert counts and the
gradient norm of every parameter group (embedding, each layer's mixer / router / experts /
shared experts / dense MLP / norms, final norm, head). ``compare A B N`` checks N ranks' figures
against one-process run A with tolerances from the difference of two one-process reruns A, B:

    tol = max(4 |A - B|, floor * |A|)      (floor: --floor, default 1e-5 for float32's reduction order)

``scaling``: ``--steps`` steps of the workload at capacity T on the launch's ranks, the model
FSDP2-sharded (``--ep`` for experts, ``--cp`` for Ulysses context parallelism and ``--tp`` for
tensor parallelism with sequence parallelism: each group of ``cp x tp`` ranks splits every
microbatch's T compact rows, so T is per group), for each ``--modes`` (``compact`` = harts,
``trajectory`` = the baseline, its raw-token microbatches at capacity T), after ``--warmup`` untimed steps. Per step: step time (slowest rank), raw
tokens/s/GPU, MFU (the model FLOPs the mode executes, counted as ``harts bench`` counts them:
compact rows and tree-visible pairs for harts; ``harts.models.flops``), effective MFU (the step's
trajectory-wise model FLOPs over the same time: what harts' prefix sharing is worth), and each
replica's measured compute time (its microbatches, from the plan to the end of its last
backward) next to the time predicted from the plan's per-replica work (compact tokens for harts,
raw tokens for the baseline), scaled to the same mean; each rank's peak device memory.
``efficiency ONE MANY``: context-parallel scaling efficiency of two ``scaling`` results at the
same T and workload, ``t_1 / (C * t_C)`` per step (1.0: C ranks are C times as fast), and the
per-rank peak memory ratio (1/C: activations split C ways).

Both parts follow ``harts train``: the LM head runs at action positions only unless
``--logprobs all`` (``ExecutionConfig.logprob_positions``), and the FLOPs count the logit rows
computed.
"""

from __future__ import annotations

import argparse
import json
import re
from typing import Any

from benchmarks._runner import add_dtype_argument, parse, parser, run, write_json

__all__ = ["main"]


def _setup(args: argparse.Namespace) -> tuple[Any, Any, Any, list]:
    """Process group, batches, model (parallelized) and optimizer-free state for ``args``."""
    import torch
    import torch.distributed as dist

    from harts.experiments.mesh_bench import shard_model
    from harts.integrations.loading import load_model
    from harts.parallel.mesh import ParallelConfig, setup_process_group
    from harts.tree.workloads import workload_steps

    device = setup_process_group(args.device)
    torch.set_num_threads(args.threads) if args.threads else None
    batches = [make() for _, make in workload_steps(args.workload, args.steps, seed=args.seed)]
    vocab = max(int(b.tokens.max()) + 1 for b in batches)
    world = dist.get_world_size() if dist.is_initialized() else 1
    # several ranks: structure on the meta device, values after sharding (no rank holds the whole model)
    model = load_model(
        args.model,
        vocab_size=vocab,
        dtype=args.dtype,
        layer_pattern=args.pattern,
        layers=args.layers,
        seed=args.seed,
        device="meta" if world > 1 else device,
    )
    config = ParallelConfig(dp=world // (args.ep * args.cp * args.tp), ep=args.ep, cp=args.cp, tp=args.tp)
    if world > 1:
        state = shard_model(model, config, device, spec=args.model, seed=args.seed)
    else:
        from harts.parallel.build import moe_experts
        from harts.parallel.mesh import init_parallel

        state = init_parallel(config, device, moe_experts(model))
    return model, state, batches, [device]


def _group(name: str) -> str:
    """Parameter group of a parameter name (layer index kept)."""
    m = re.match(r"layers\.(\d+)\.(\w+?)(?:\.(\w+))?\.", name)
    if m is None:
        return name.split(".")[0]
    layer, part, sub = m.groups()
    if part == "mlp" and sub in ("gate", "experts", "shared_experts", "shared_expert_gate"):
        return f"layers.{layer}.mlp.{sub}"
    return f"layers.{layer}.{part}"


def correctness(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from torch.distributed.tensor import DTensor

    from harts.models.execution.config import ExecutionConfig
    from harts.trainer.step import TrainConfig, accumulate_step_gradients

    model, state, batches, _ = _setup(args)
    execution = ExecutionConfig(
        mode=args.mode,
        recompute=args.recompute,
        recompute_skip=args.recompute_skip,
        linear_attention_backend=args.la_backend,
        logprob_positions=args.logprobs,
    )
    cfg = TrainConfig(capacity=args.capacity, replicas=args.replicas, execution=execution)
    acc = accumulate_step_gradients(model, batches[0], cfg, parallel=state)
    squares: dict[str, float] = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        squares[_group(name)] = squares.get(_group(name), 0.0) + float(g.double().pow(2).sum())
    return {
        "world_size": state.world_size,
        "replicas": args.replicas,
        "dtype": args.dtype,
        "logprobs": args.logprobs,
        "loss": acc.loss,
        "moe_objective": acc.moe_objective,
        "expert_counts": acc.expert_counts.tolist() if acc.expert_counts is not None else None,
        "grad_norms": {k: v**0.5 for k, v in sorted(squares.items())},
        "microbatches": acc.microbatches,
        "device": str(torch.device(state.device)),
    }


def compare(a: dict, b: dict, n: dict, floor: float) -> dict[str, Any]:
    """N ranks' figures against run ``a`` with tolerances from reruns ``a``, ``b`` (module docstring)."""
    import numpy as np

    def flat(r: dict) -> dict[str, float]:
        out = {"loss": r["loss"], "moe_objective": r["moe_objective"]}
        out.update({f"grad_norm[{k}]": v for k, v in r["grad_norms"].items()})
        if r["expert_counts"] is not None:
            counts = np.asarray(r["expert_counts"], dtype=np.float64)
            out.update({f"expert_counts[{i}][{e}]": float(c) for (i, e), c in np.ndenumerate(counts)})
        return out

    fa, fb, fn = flat(a), flat(b), flat(n)
    if fa.keys() != fn.keys() or fa.keys() != fb.keys():
        raise ValueError(f"the runs report different quantities: {sorted(set(fa) ^ set(fn) | set(fa) ^ set(fb))}")
    rows, failed = [], []
    for k in fa:
        tol = max(4 * abs(fa[k] - fb[k]), floor * abs(fa[k]))
        err = abs(fn[k] - fa[k])
        rows.append({"quantity": k, "one": fa[k], "rerun": fb[k], "many": fn[k], "error": err, "tolerance": tol})
        if err > tol:
            failed.append(k)
    return {"world_size": n["world_size"], "floor": floor, "passed": not failed, "failed": failed, "rows": rows}


def efficiency(one: dict, many: dict) -> dict[str, Any]:
    """Scaling of ``many`` (one row group: C = cp x tp ranks that split every microbatch's rows)
    against ``one`` (one rank), per mode and step: ``t_1 / (C t_C)`` and the per-rank peak
    memory ratio max_C / max_1."""
    group = many.get("cp", 1) * many.get("tp", 1)
    if one["world_size"] != 1 or many["world_size"] != group:
        raise ValueError("efficiency compares one rank with one row group (world size = --cp x --tp)")
    if one["capacity"] != many["capacity"]:
        raise ValueError(f"different T: {one['capacity']} and {many['capacity']}")
    c = many["world_size"]
    out: dict[str, Any] = {
        "cp": many.get("cp", 1),
        "tp": many.get("tp", 1),
        "ranks": c,
        "capacity": one["capacity"],
        "modes": {},
    }
    for mode, steps in many["modes"].items():
        rows = []
        for a, b in zip(one["modes"][mode], steps):
            pa, pb = a.get("peak_gib_per_rank") or [None], b.get("peak_gib_per_rank") or [None]
            ratio = max(pb) / max(pa) if None not in pa + pb else None
            rows.append(
                {
                    "step": a["step"],
                    "seconds_one": a["step_seconds"],
                    "seconds_many": b["step_seconds"],
                    "efficiency": a["step_seconds"] / (c * b["step_seconds"]),
                    "peak_ratio": ratio,
                }
            )
        out["modes"][mode] = rows
    return out


def scaling(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from harts.experiments.mesh_bench import time_mesh_step
    from harts.models.execution.config import ExecutionConfig
    from harts.models.flops import FlopModel, peak_tflops
    from harts.trainer.step import TrainConfig, train_step

    model, state, batches, _ = _setup(args)
    flops = FlopModel.from_model(model)
    peak = peak_tflops(torch.device(state.device))
    result: dict[str, Any] = {
        "world_size": state.world_size,
        "ep": args.ep,
        "cp": args.cp,
        "tp": args.tp,
        "capacity": args.capacity,
        "logprobs": args.logprobs,
        "modes": {},
    }
    for mode in args.modes:
        # fused log-probs on both sides, as in ``harts bench``: the baseline's plain log_softmax
        # would hold [positions, V] logits (70 GiB for a 65 k-token microbatch at V = 157 k)
        execution = ExecutionConfig(
            mode=mode,
            recompute=args.recompute,
            recompute_skip=args.recompute_skip,
            attention=args.attention,
            linear_attention_backend=args.la_backend,
            fused_logprobs=True,
            logprob_positions=args.logprobs,
        )
        cfg = TrainConfig(capacity=args.capacity, execution=execution)
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
        for _ in range(args.warmup):  # untimed: kernel autotuning, allocator warm-up
            train_step(model, optimizer, batches[0], cfg, parallel=state)
        result["modes"][mode] = [
            time_mesh_step(model, optimizer, batch, cfg, state, step=i, peak_tflops=peak, flops=flops).to_dict()
            for i, batch in enumerate(batches)
        ]
    return result


def _raw_flops(*args: Any, **kwargs: Any) -> float:
    """``harts.experiments.mesh_bench.raw_step_flops`` (imported when called: ``compare`` and
    ``efficiency`` run without torch)."""
    from harts.experiments.mesh_bench import raw_step_flops

    return raw_step_flops(*args, **kwargs)


def _executed_flops(*args: Any, **kwargs: Any) -> float:
    """``harts.experiments.mesh_bench.executed_step_flops`` (imported when called)."""
    from harts.experiments.mesh_bench import executed_step_flops

    return executed_step_flops(*args, **kwargs)


def _parser() -> argparse.ArgumentParser:
    p = parser(__doc__, __file__)
    sub = p.add_subparsers(dest="part", required=True)
    for name in ("correctness", "scaling"):
        s = sub.add_parser(name)
        s.add_argument("--out", dest="json_out", required=True, metavar="FILE", help="JSON file (rank 0 writes)")
        s.add_argument("--model", default="tiny")
        s.add_argument("--pattern", default=None)
        s.add_argument("--layers", type=int, default=None, help="a preset's first N decoder layers")
        s.add_argument("--workload", default="tiny")
        s.add_argument("--steps", type=int, default=1)
        s.add_argument("--seed", type=int, default=0)
        add_dtype_argument(s, ["float32", "float64", "bfloat16"], "float32")
        s.add_argument("--device", default="cpu")
        s.add_argument("--capacity", type=int, default=65_536)
        s.add_argument("--ep", type=int, default=1)
        s.add_argument("--cp", type=int, default=1, help="Ulysses context-parallel degree (T is per CP group)")
        s.add_argument("--tp", type=int, default=1, help="tensor-parallel degree with sequence parallelism")
        s.add_argument("--recompute", action="store_true")
        s.add_argument(
            "--recompute-skip",
            type=lambda text: tuple(n.strip() for n in text.split(",") if n.strip()),
            default=(),
            metavar="CORES",
            help="with --recompute: cores whose forward is kept (attention, linear_attention)",
        )
        s.add_argument("--attention", default="auto", choices=["auto", "gather", "mask"])
        s.add_argument("--la-backend", default="reference", choices=["reference", "fla", "tree", "tree_linked", "auto"])
        s.add_argument("--threads", type=int, default=0)
        s.add_argument(
            "--logprobs",
            default="actions",
            choices=["actions", "all"],
            help="LM head at action positions only (the training default) or at every position",
        )
    sub.choices["correctness"].add_argument("--replicas", type=int, required=True, help="plan replicas (fixed)")
    sub.choices["correctness"].add_argument("--mode", default="compact", choices=["compact", "trajectory"])
    sub.choices["scaling"].add_argument("--modes", nargs="+", default=["compact", "trajectory"])
    sub.choices["scaling"].add_argument("--warmup", type=int, default=1, help="untimed steps per mode first")
    e = sub.add_parser("efficiency")
    e.add_argument("one", help="scaling result of one rank")
    e.add_argument("many", help="scaling result of one row group (cp x tp ranks), same T and workload")
    e.add_argument("--out", dest="json_out", required=True, metavar="FILE", help="JSON file of the efficiencies")
    c = sub.add_parser("compare")
    c.add_argument("one")
    c.add_argument("rerun")
    c.add_argument("many")
    c.add_argument("--floor", type=float, default=1e-5)
    c.add_argument("--out", dest="json_out", required=True, metavar="FILE", help="JSON file of the comparison")
    return p


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    args = parse(p, argv)
    if args.part not in ("compare", "efficiency"):
        from harts.models.execution.config import check_recompute_skip

        try:
            check_recompute_skip(args.recompute_skip, args.recompute)
        except ValueError as err:
            p.error(f"--recompute-skip: {err}")  # exits 2 with the message, no traceback
    if args.part == "efficiency":
        one, many = (json.loads(open(f).read()) for f in (args.one, args.many))
        result = efficiency(one, many)
        for mode, rows in result["modes"].items():
            for r in rows:
                print(f"{mode} step {r['step']}: efficiency {r['efficiency']:.3f}, peak memory ratio {r['peak_ratio']}")
        write_json(args, result, quiet=True)
        return 0
    if args.part == "compare":
        runs = [json.loads(open(f).read()) for f in (args.one, args.rerun, args.many)]
        result = compare(runs[0], runs[1], runs[2], floor=args.floor)
        print(f"{len(result['rows'])} quantities, failed: {result['failed'] or 'none'}")
        write_json(args, result, quiet=True)
        return 0 if result["passed"] else 1
    import torch.distributed as dist

    result = correctness(args) if args.part == "correctness" else scaling(args)
    if not dist.is_initialized() or dist.get_rank() == 0:
        write_json(args, result)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(run(main))
