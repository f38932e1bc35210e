"""An RL loop on harts' engine API, in process: sample with harts' sampler, train with importance sampling.

    python examples/engine_loop.py                       # the tiny preset on the CPU, a minute or two
    python examples/engine_loop.py --steps 50 --out ckpt

The task is tiny on purpose (the ``tiny`` preset has a 64-token vocabulary and no tokenizer): after
a prompt token the model should answer with tokens from the lower half of the vocabulary (ids
0-31); a sample's reward is the fraction of its tokens that are, so the random initial policy
scores about 0.5, and the reward approaches 1 within the default 15 steps. Each step:

1. the current weights sample ``--group-size`` completions of every prompt with harts' sampler
   (``harts.rollout.decode`` / ``harts.rollout.sampler``: the prompt is run once and its state
   forked, so a group shares its prompt's cache), keeping the sampler's log-probs;
2. group-relative advantages (GRPO's, ``harts.rl.grpo.group_advantages``) on the sampled tokens;
3. ``engine.forward_backward(trajectories, "importance_sampling")`` over flat trajectories
   (the engine finds the prompt every group shares and computes it once), then
   ``engine.optim_step(lr=...)``.

At the end ``engine.save_state`` writes weights, optimizer and RNG (``engine.load_state`` resumes
from it) and ``engine.save_weights_for_sampler`` the weights alone, which ``--model DIR`` and
``Engine.from_spec(DIR)`` load; the example reloads them to show it.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import numpy as np
import torch

from harts.rl.grpo import group_advantages
from harts.rollout.decode import extend, new_branch
from harts.rollout.sampler import SamplingConfig, generate
from harts.trainer.engine import Engine

VOCAB = 64


def reward(prompt: int, completion: list[int]) -> float:
    """The fraction of ``completion``'s tokens in the lower half of the vocabulary (``prompt`` is
    there for tasks that depend on it)."""
    return float(np.mean([t < VOCAB // 2 for t in completion]))


def sample_group(
    engine: Engine, prompts: list[int], group_size: int, max_tokens: int, generator: torch.Generator
) -> tuple[list[dict], np.ndarray]:
    """``group_size`` samples of every prompt as engine trajectories, and their rewards [P * G].

    A trajectory is ``tokens`` = prompt + completion with per-target ``logprobs`` (the sampler's)
    and ``advantages``; the prompt's own targets (none here: the prompt is one token) would get 0.
    """
    model = engine.model
    roots = extend(model, [new_branch(model)] * len(prompts), [[p] for p in prompts])
    branches = [b for root in roots for b in root.fork(group_size)]
    _, turns = generate(model, branches, SamplingConfig(temperature=1.0, max_tokens=max_tokens), generator)
    starts = [p for p in prompts for _ in range(group_size)]
    rewards = np.array([reward(p, t.tokens) for p, t in zip(starts, turns)])
    groups = np.repeat(np.arange(len(prompts)), group_size)
    advantages = group_advantages(rewards, groups)
    trajectories = [
        {"tokens": [p, *t.tokens], "logprobs": t.logprobs, "advantages": [float(a)] * len(t.tokens)}
        for p, t, a in zip(starts, turns, advantages)
    ]
    return trajectories, rewards


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny", help="a preset or a weights directory (its vocabulary must be 64)")
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--prompts", type=int, default=8, help="prompts per step")
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="where the state and the sampler weights go (default: a temp dir)")
    args = p.parse_args(argv)

    torch.manual_seed(args.seed)
    engine = Engine.from_spec(args.model, seed=args.seed, lr=args.lr, grad_clip=1.0)
    if engine.model.config.vocab_size != VOCAB:
        raise SystemExit(f"--model {args.model}: the task needs a vocabulary of {VOCAB}")
    rng = np.random.default_rng(args.seed)
    generator = torch.Generator().manual_seed(args.seed)
    for step in range(args.steps):
        prompts = rng.integers(0, VOCAB, size=args.prompts).tolist()
        trajectories, rewards = sample_group(engine, prompts, args.group_size, args.max_tokens, generator)
        out = engine.forward_backward(trajectories, "importance_sampling")
        update = engine.optim_step(lr=args.lr)
        print(
            f"step {step:3d}  reward {rewards.mean():.3f}  loss {out.loss:+.4f}  grad-norm {update.grad_norm:.3f}",
            flush=True,
        )

    out_dir = args.out or tempfile.mkdtemp(prefix="harts-engine-loop-")
    state, sampler = os.path.join(out_dir, "state"), os.path.join(out_dir, "sampler")
    engine.save_state(state)
    engine.save_weights_for_sampler(sampler)
    reloaded = Engine.from_spec(sampler)
    same = all(
        torch.equal(a, b) for a, b in zip(reloaded.model.state_dict().values(), engine.model.state_dict().values())
    )
    print(f"state {state}\nsampler weights {sampler} (reloaded: {'the same weights' if same else 'DIFFERENT'})")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
