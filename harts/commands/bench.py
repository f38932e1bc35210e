"""``harts bench``: training-step speed of harts against the trajectory-wise baseline.

See ``harts.bench.step_bench``: whole steps, same weights, baseline microbatches packed by raw
tokens, harts microbatches from the prefix-aware planner, both at capacity T. Prints per step
the paper's Table 4 metrics (non-replay compact-row compression, F/B/Grad and Core speedup)
beside each side's time and peak memory, and writes JSON with ``--json``.
"""

from __future__ import annotations

import argparse

from harts.commands._inputs import add_model_arguments, add_workload_arguments

HELP = "Time training steps compactly vs trajectory-wise (F/B/Grad and Core speedup, memory)."


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_workload_arguments(p, default="small")
    add_model_arguments(p)
    p.add_argument("--capacity", type=int, default=65_536, help="microbatch capacity T (tokens)")
    p.add_argument("--recompute", action="store_true", help="full-layer activation recomputation")
    p.add_argument("--attention", default="auto", choices=["auto", "gather", "mask"],
                   help="full attention: one call per branch (gather), one FlexAttention call over "
                        "the tree mask (mask), or mask on CUDA / gather on CPU (auto, default)")
    p.add_argument("--no-warmup", action="store_true", help="skip the untimed first microbatch of each side")
    p.add_argument("--json", dest="json_out", default=None)


def run(args: argparse.Namespace) -> int:
    import json

    from harts.bench.step_bench import bench_step
    from harts.commands._format import format_table
    from harts.commands._inputs import build_model, workload_batches

    results = []
    model = None
    for step, batch in enumerate(workload_batches(args)):
        if model is None:
            vocab = max(int(batch.tokens.max()) + 1, batch.vocab_size or 0)
            model = build_model(args, vocab)
            print(f"model {args.model}: {model.config.layer_pattern}, hidden {model.config.hidden_size}, "
                  f"{model.num_parameters():,} parameters, {args.dtype} on {args.device}; capacity {args.capacity:,}; "
                  f"recompute {'on' if args.recompute else 'off'}", flush=True)
        r = bench_step(model, batch, capacity=args.capacity, step=step, recompute=args.recompute,
                       attention=args.attention, warmup=not args.no_warmup, la_backend=args.la_backend)
        results.append(r)
        print(f"step {step}: baseline {r.baseline.train_seconds:.3f} s, harts {r.harts.train_seconds:.3f} s "
              f"(+{r.harts.plan_seconds:.3f} s planning): F/B/Grad {r.fbg_speedup:.2f}x", flush=True)

    def mem(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.2f}"

    rows = [[r.step, r.paths, r.raw_tokens, f"{r.compression:.2f}x", f"{r.baseline.microbatches}/{r.harts.microbatches}",
             r.harts.calls, r.harts.replay_rows, f"{r.baseline.train_seconds:.3f}", f"{r.harts.train_seconds:.3f}",
             f"{r.harts.plan_seconds:.3f}", f"{r.fbg_speedup:.2f}x", f"{r.core_speedup:.2f}x",
             f"{mem(r.baseline.peak_memory_gb)}/{mem(r.harts.peak_memory_gb)}"] for r in results]
    print(format_table(["step", "paths", "raw tok", "compress", "mbs base/harts", "calls", "replay",
                        "base s", "harts s", "plan s", "F/B/Grad", "Core", "peak GiB base/harts"], rows))
    if len(results) > 1:
        tb = sum(r.baseline.train_seconds for r in results)
        th = sum(r.harts.train_seconds for r in results)
        tp = sum(r.harts.plan_seconds for r in results)
        print(f"all steps: F/B/Grad {tb / th:.2f}x, Core {tb / (th + tp):.2f}x")
    if args.json_out:
        with open(args.json_out, "w") as fh:
            json.dump({"model": args.model, "device": args.device, "dtype": args.dtype, "capacity": args.capacity,
                       "recompute": args.recompute, "steps": [r.to_dict() for r in results]}, fh, indent=2)
        print(f"wrote {args.json_out}")
    return 0
