"""One long trajectory and one long rollout tree as batch files, for ``harts bench --workload FILE``.

    python -m benchmarks.step.long_batches --out /tmp/harts_batches [--tokens 131072]

No workload preset reaches long context (their paths stop at ``WorkloadSpec.max_path_tokens``,
65,000 tokens), so the long-context rows of ``benchmarks.step.gpu_runs`` bench on two files
this writes into ``--out`` (L = ``--tokens``, a multiple of 1,024):

* ``trajectory_L.jsonl``: one trajectory of L tokens, a prompt of L/2 and its completion. Nothing
  is shared, so harts' step does the baseline's work: what remains is harts' own overhead.
* ``tree_L.jsonl``: one rollout tree, a prompt of L/2 tokens with five completions: one of L/2
  (the longest path, L tokens) and four of L/8 - 256. At ``--capacity L`` harts runs two
  microbatches, the longest path alone and the prompt again with the four short completions
  (1,024 rows to spare), where the trajectory-wise baseline runs each of the five trajectories in
  its own microbatch (no two of them fit L together): 1.75x at L = 131,072.

Token ids are seeded random ids below 150,000, so a published preset keeps its own vocabulary;
completions start with distinct ids, so the token trie is the tree. Each completion is an
action sequence with advantage +1 or -1; the prompt is not.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import numpy as np

from benchmarks._runner import parse, parser, run

if TYPE_CHECKING:
    from harts.tree.batch import RolloutBatch

#: token ids are drawn below this (every published preset's vocabulary is larger)
TOKEN_IDS = 150_000


def trajectory_batch(tokens: int, rng: np.random.Generator) -> RolloutBatch:
    """One trajectory: a prompt of ``tokens // 2`` and its completion."""
    from harts.tree.batch import RolloutBatch

    mask = np.arange(tokens) >= tokens // 2
    return RolloutBatch.from_trajectories([rng.integers(1, TOKEN_IDS, size=tokens)], action_mask=[mask], advantages=[1])


def tree_batch(tokens: int, rng: np.random.Generator) -> RolloutBatch:
    """One rollout tree: a shared prompt of ``tokens // 2``, one completion that makes the longest
    path ``tokens`` long and four of ``tokens // 8 - 256`` (module docstring)."""
    from harts.tree.batch import RolloutBatch

    prompt = rng.integers(1, TOKEN_IDS, size=tokens // 2)
    trajectories, masks = [], []
    for i, n in enumerate([tokens - prompt.size] + [tokens // 8 - 256] * 4):
        completion = rng.integers(1, TOKEN_IDS, size=n)
        completion[0] = i + 1  # distinct first ids: the branches fork right after the prompt
        trajectories.append(np.concatenate([prompt, completion]))
        masks.append(np.arange(prompt.size + n) >= prompt.size)
    advantages = [1.0, -1.0, 1.0, -1.0, 1.0]
    return RolloutBatch.from_trajectories(trajectories, action_mask=masks, advantages=advantages, tree_ids=[0] * 5)


def write_batches(out: str, tokens: int, seed: int = 0) -> list[str]:
    """Write both batch files into ``out``; returns their paths."""
    if tokens % 1024 or tokens < 4096:
        raise ValueError(f"--tokens must be a multiple of 1,024 and at least 4,096; got {tokens:,}")
    os.makedirs(out, exist_ok=True)
    rng = np.random.default_rng(seed)
    paths = [os.path.join(out, f"{kind}_{tokens}.jsonl") for kind in ("trajectory", "tree")]
    for path, batch in zip(paths, (trajectory_batch(tokens, rng), tree_batch(tokens, rng))):
        batch.save(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__, __file__)
    p.add_argument("--out", required=True, help="directory the two batch files are written into")
    p.add_argument("--tokens", type=int, default=131_072, help="the longest path's tokens (default 131,072)")
    p.add_argument("--seed", type=int, default=0)
    args = parse(p, argv)
    try:
        paths = write_batches(args.out, args.tokens, args.seed)
    except ValueError as err:
        p.error(str(err))
    for path in paths:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(run(main))
