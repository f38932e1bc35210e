"""``harts train``: GRPO training on rollout trees, every microbatch executed compactly.

Single process by default; data parallel with ``torchrun --nproc-per-node D $(which harts) train``
(gloo on CPU, NCCL on CUDA). ``--mode trajectory`` runs the baseline on the same plan.
"""

from __future__ import annotations

import argparse

from harts.commands._inputs import add_model_arguments, add_workload_arguments

HELP = "GRPO training on rollout trees (compact execution; --mode trajectory for the baseline)."


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_workload_arguments(p, default="tiny")
    add_model_arguments(p)
    p.add_argument("--mode", default="compact", choices=["compact", "trajectory"])
    p.add_argument("--capacity", type=int, default=65_536, help="microbatch capacity T (compact tokens)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--kl-coef", type=float, default=0.0)
    p.add_argument("--recompute", action="store_true", help="full-layer activation recomputation")
    p.add_argument("--attention", default="auto", choices=["auto", "gather", "mask"],
                   help="full attention: one call per branch (gather), one FlexAttention call over "
                        "the tree mask (mask), or mask on CUDA / gather on CPU (auto, default)")
    p.add_argument("--save", default=None, metavar="DIR",
                   help="save the trained weights (a transformers checkpoint when --model was one, else harts.pt)")
    p.add_argument("--json", dest="json_out", default=None)


def run(args: argparse.Namespace) -> int:
    import json
    import os

    import torch
    import torch.distributed as dist

    from harts.commands._format import format_table
    from harts.commands._inputs import build_model, workload_batches
    from harts.models.loading import is_checkpoint
    from harts.rl.train import TrainConfig, train_step

    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed and not dist.is_initialized():
        backend = "nccl" if args.device.startswith("cuda") else "gloo"
        dist.init_process_group(backend)
        if args.device == "cuda":
            args.device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
    rank = dist.get_rank() if distributed else 0

    batches = workload_batches(args)
    first = next(batches)
    vocab = max(int(first.tokens.max()) + 1, first.vocab_size or 0)
    model = build_model(args, vocab)
    cfg = TrainConfig(capacity=args.capacity, mode=args.mode, recompute=args.recompute,
                      attention=args.attention, lr=args.lr, kl_coef=args.kl_coef,
                      linear_attention_backend=args.la_backend)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    if rank == 0:
        print(f"model {args.model}: {model.config.layer_pattern} x hidden {model.config.hidden_size}, "
              f"{model.num_parameters():,} parameters, {args.dtype} on {args.device}; mode {args.mode}")
    logs = []
    step = 0
    for batch in [first, *batches]:
        log = train_step(model, optimizer, batch, cfg, step=step)
        logs.append(log)
        if rank == 0:
            print(f"step {step}: loss {log.loss:+.5f}  grad-norm {log.grad_norm:.4f}  "
                  f"{log.microbatches} microbatches  {log.train_seconds:.2f} s  "
                  f"{log.tokens_per_second:,.0f} tok/s/rank", flush=True)
        step += 1
    if rank == 0:
        rows = [[l.step, l.paths, l.raw_tokens, l.microbatches, l.rank_rows, l.rank_calls, l.rank_replay_rows,
                 f"{l.loss:+.5f}", f"{l.grad_norm:.4f}", f"{l.plan_seconds:.3f}", f"{l.prepare_seconds:.3f}",
                 f"{l.train_seconds:.3f}"] for l in logs]
        print(format_table(["step", "paths", "raw tok", "mbs", "rows", "calls", "replay", "loss", "|g|",
                            "plan s", "prepare s", "train s"], rows))
        if args.json_out:
            with open(args.json_out, "w") as fh:
                json.dump({"mode": args.mode, "model": args.model, "world_size": dist.get_world_size() if distributed else 1,
                           "steps": [l.to_dict() for l in logs]}, fh, indent=2)
            print(f"wrote {args.json_out}")
        if args.save:
            os.makedirs(args.save, exist_ok=True)
            if is_checkpoint(args.model):
                from harts.integrations.hf import save_hf_checkpoint

                save_hf_checkpoint(model, args.save)
            else:
                torch.save({"config": model.config.__dict__, "state_dict": model.state_dict()},
                           os.path.join(args.save, "harts.pt"))
            print(f"saved to {args.save}")
    if distributed:
        dist.destroy_process_group()
    return 0
