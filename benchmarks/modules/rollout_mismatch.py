"""Train/inference mismatch: the sampler's log-probs against the training forward's, same weights.

    python -m benchmarks.modules.rollout_mismatch --device cuda --dtype bfloat16 [--json out.json]

For two model sizes (the tiny preset, and a "small" hybrid of hidden 512, 8 layers, 16 experts)
the sampler grows a tree: a 99-token prompt forked into 8 turns of up to 60 tokens, an
observation each, then 2 more turns per branch (16 trajectories). The training forward then
scores the same tokens in compact and trajectory-wise mode. Printed per size and mode: action
tokens, max and mean |train - sampler| log-prob, and mean |1 - ratio| (the PPO ratio of an
on-policy step, which should be 1). In float64 the gap is rounding (1e-14); in bfloat16 it is
the precision's own.
"""

from __future__ import annotations

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
    write_json,
)
from harts.models.config import HybridConfig
from harts.models.hybrid_lm import HybridLM
from harts.rl.grpo import per_logprob
from harts.rollout.decode import extend, new_branch
from harts.rollout.sampler import SamplingConfig, generate
from harts.tree.batch import RolloutBatch

SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(vocab_size=64),
    "small": dict(
        vocab_size=2048,
        hidden_size=512,
        chunk_size=64,
        layer_pattern="KGKMKGKA",
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        num_attention_heads=8,
        head_dim=64,
        kv_lora_rank=128,
        q_lora_rank=256,
        qk_nope_head_dim=64,
        qk_rope_head_dim=32,
        v_head_dim=64,
        intermediate_size=1024,
        num_experts=16,
        num_experts_per_tok=4,
        moe_intermediate_size=256,
        initializer_range=0.02,
    ),
}


def sampled_tree(model: HybridLM, seed: int) -> RolloutBatch:
    """The tree of the module docstring, with the sampler's log-probs as ``old_logprobs``."""
    gen = torch.Generator().manual_seed(seed)
    prompt = [1 + i % 60 for i in range(99)]
    (root,) = extend(model, [new_branch(model)], [prompt])
    kids, first = generate(model, root.fork(8), SamplingConfig(max_tokens=60), gen)
    obs = [[7] * (5 + 3 * i) for i in range(8)]
    kids = extend(model, kids, obs)
    _, second = generate(model, [c for k in kids for c in k.fork(2)], SamplingConfig(max_tokens=60), gen)

    def node(nid: str, parent: str | None, tokens: list[int], logprobs: list[float] | None) -> dict:
        action = logprobs is not None
        lp = logprobs if logprobs is not None else [0.0] * len(tokens)
        return {
            "id": nid,
            "parent": parent,
            "tokens": tokens,
            "action_mask": [action] * len(tokens),
            "old_logprobs": lp,
        }

    nodes = [node("p", None, prompt, None)]
    for i in range(8):
        nodes += [node(f"a{i}", "p", first[i].tokens, first[i].logprobs), node(f"o{i}", f"a{i}", obs[i], None)]
        nodes += [node(f"b{i}{j}", f"o{i}", second[2 * i + j].tokens, second[2 * i + j].logprobs) for j in range(2)]
    return RolloutBatch.from_tree(nodes)


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__, __file__)
    add_device_argument(p, "cpu")
    add_dtype_argument(p, ["float32", "float64", "bfloat16"], "bfloat16")
    p.add_argument("--seed", type=int, default=0)
    add_json_argument(p)
    args = parse(p, argv)
    device_of(args.device)
    rows = []
    for name, overrides in SIZES.items():
        torch.manual_seed(args.seed)
        model = HybridLM(HybridConfig.tiny(**overrides, dtype=args.dtype)).to(args.device)
        batch = sampled_tree(model, args.seed)
        assert batch.old_logprobs is not None
        act = per_logprob(batch, batch.action_mask)
        sampled = per_logprob(batch, batch.old_logprobs)[act]
        for mode in ("compact", "trajectory"):
            with torch.no_grad():
                # one attention call per branch: the tiny model's head dims are below FlexAttention's minimum
                lp = model(batch, mode=mode, attention="gather").logprobs.double().cpu().numpy()[act]
            gap = np.abs(lp - sampled)
            row = {
                "model": name,
                "mode": mode,
                "dtype": args.dtype,
                "device": args.device,
                "action_tokens": int(act.sum()),
                "max_abs_logprob_gap": float(gap.max()),
                "mean_abs_logprob_gap": float(gap.mean()),
                "mean_abs_1_minus_ratio": float(np.abs(1 - np.exp(lp - sampled)).mean()),
            }
            rows.append(row)
            print(
                f"{name:>5} {mode:>10} {args.dtype} {args.device}: {row['action_tokens']} action tokens, "
                f"|train - sampler| log-prob max {row['max_abs_logprob_gap']:.3e} mean "
                f"{row['mean_abs_logprob_gap']:.3e}, mean |1 - ratio| {row['mean_abs_1_minus_ratio']:.3e}",
                flush=True,
            )
    write_json(args, {"results": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(run(main))
