"""Random rollout-shaped trees on physical rows, for the operator tests.

A tree here is a parent array over P physical rows in a shuffled order (so a row's ancestors
are generally not the rows packed before it), plus the views the layout gives the ops:
ancestor matrices, root-to-leaf paths, preorder ranges and ancestor-view branches.
"""

from __future__ import annotations

import torch


def random_forest(num_rows: int, *, num_roots: int = 2, branchy: float = 0.3, seed: int = 0) -> torch.Tensor:
    """int64 [P] parent row of each physical row (-1 for roots); rows are shuffled."""
    gen = torch.Generator().manual_seed(seed)
    parent_logical = torch.full((num_rows,), -1, dtype=torch.int64)
    for i in range(num_roots, num_rows):
        # mostly continue the previous row (long segments), sometimes fork from an earlier one
        if torch.rand(1, generator=gen).item() < branchy:
            parent_logical[i] = int(torch.randint(0, i, (1,), generator=gen))
        else:
            parent_logical[i] = i - 1
    perm = torch.randperm(num_rows, generator=gen)  # logical -> physical
    parent = torch.full((num_rows,), -1, dtype=torch.int64)
    has = parent_logical >= 0
    parent[perm[has]] = perm[parent_logical[has]]
    return parent


def ancestors(parent: torch.Tensor, k: int) -> torch.Tensor:
    """int64 [P, k]: column d-1 = d-th ancestor, -1 if none."""
    out = torch.full((parent.numel(), k), -1, dtype=torch.int64)
    cur = torch.arange(parent.numel())
    for d in range(k):
        cur = torch.where(cur >= 0, parent[cur.clamp(min=0)], -1)
        out[:, d] = cur
    return out


def paths(parent: torch.Tensor) -> list[list[int]]:
    """Root-to-leaf row lists, one per leaf."""
    P = parent.numel()
    is_parent = torch.zeros(P, dtype=torch.bool)
    is_parent[parent[parent >= 0]] = True
    out = []
    for leaf in torch.nonzero(~is_parent).flatten().tolist():
        path, j = [], leaf
        while j >= 0:
            path.append(j)
            j = int(parent[j])
        out.append(path[::-1])
    return out


def preorder(parent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(tree_pre [P], tree_end [P]): preorder index of each row and the end of its subtree."""
    P = parent.numel()
    children: list[list[int]] = [[] for _ in range(P)]
    roots = []
    for i in range(P):
        (children[int(parent[i])] if parent[i] >= 0 else roots).append(i)
    pre = torch.empty(P, dtype=torch.int64)
    end = torch.empty(P, dtype=torch.int64)
    counter = 0
    stack = [(r, False) for r in reversed(roots)]
    while stack:
        node, done = stack.pop()
        if done:
            end[node] = counter
            continue
        pre[node] = counter
        counter += 1
        stack.append((node, True))
        stack.extend((c, False) for c in reversed(children[node]))
    return pre, end


def branches(parent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Ancestor-view attention branches: each branch is a path's rows not covered by earlier paths.

    Returns (q_rows, cu_q, kv_rows, cu_kv): a branch's kv view is its first own row's
    ancestors (root first) followed by its own rows.
    """
    covered: set[int] = set()
    q_rows, kv_rows, cu_q, cu_kv = [], [], [0], [0]
    for path in paths(parent):
        own_from = next(i for i, r in enumerate(path) if r not in covered)
        own = path[own_from:]
        covered.update(own)
        q_rows += own
        kv_rows += path
        cu_q.append(len(q_rows))
        cu_kv.append(len(kv_rows))
    as_t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    return as_t(q_rows), as_t(cu_q), as_t(kv_rows), as_t(cu_kv)
