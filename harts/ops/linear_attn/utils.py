"""Input checks shared by every linear-attention implementation (naive, chunk, fla, tree).

Two update rules share one contract (``RULES``), per sequence and head, state S [K, V]:
    "delta"  S = exp(g_t) S;  S = S + beta_t k_t (v_t - S^T k_t)^T    (KDA, GDN)
    "plain"  S = exp(g_t) S;  S = S + k_t v_t^T                      (Mamba-2's SSD, GLA)
and o_t = scale * S^T q_t for both. "plain" takes no beta (None).

Shapes: T packed rows, H heads, K key dim, V value dim, N sequences, R state requests.
    q_THK, k_THK   query / key
    v_THV          value
    g              [T, H, K] per-channel log-decay (KDA, GLA) or [T, H] scalar log-decay (GDN, SSD)
    beta_TH        delta-rule write strength in (0, 1); None for the plain rule
    cu_seqlens     int64 [N + 1] packed sequence boundaries
    initial_state  [N, H, K, V] or None (zeros)
    state_requests int64 [R, 2]: (sequence index, position count within that sequence)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["RULES", "LinearAttnSpec", "check_linear_attn_inputs", "check_rule"]

#: the linear-attention update rules (module docstring)
RULES = ("delta", "plain")


# ``cu_seqlens`` and ``state_requests`` are read on the host (``tolist``): pass them as CPU tensors
# (the execution contexts do) and no call waits for the device; device tensors work but sync.


@dataclass(frozen=True, slots=True)
class LinearAttnSpec:
    """Sizes and host-side copies of the index inputs of one linear-attention call."""

    T: int
    H: int
    K: int
    V: int
    scalar_decay: bool
    rule: str
    starts: list[int]
    lengths: list[int]
    requests: list[tuple[int, int]]
    scale: float
    compute_dtype: torch.dtype

    @property
    def num_seqs(self) -> int:
        return len(self.lengths)


def check_linear_attn_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    initial_state: torch.Tensor | None,
    state_requests: torch.Tensor | None,
    scale: float | None,
    rule: str = "delta",
) -> LinearAttnSpec:
    """Validate shapes and indices; raise ValueError naming the offending argument.

    ``beta`` is [T, H] for ``rule="delta"`` and None for ``rule="plain"`` (``check_rule``)."""
    check_rule(rule, beta)
    if q.dim() != 3 or k.shape != q.shape:
        raise ValueError(f"q and k must both be [T, H, K]; got q {tuple(q.shape)}, k {tuple(k.shape)}")
    T, H, K = q.shape
    if v.dim() != 3 or v.shape[:2] != (T, H):
        raise ValueError(f"v must be [T={T}, H={H}, V]; got {tuple(v.shape)}")
    V = v.shape[2]
    if g.shape == (T, H, K):
        scalar_decay = False
    elif g.shape == (T, H):
        scalar_decay = True
    else:
        raise ValueError(f"g must be [T, H, K]=({T}, {H}, {K}) (KDA) or [T, H]=({T}, {H}) (GDN); got {tuple(g.shape)}")
    if beta is not None and beta.shape != (T, H):
        raise ValueError(f"beta must be [T, H]=({T}, {H}); got {tuple(beta.shape)}")
    for name, x in (("k", k), ("v", v), ("g", g), ("beta", beta)):
        if x is not None and x.device != q.device:
            raise ValueError(f"{name} is on {x.device} but q is on {q.device}")
    if not q.is_floating_point():
        raise ValueError(f"q must be a floating tensor; got {q.dtype}")

    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"cu_seqlens must be an int tensor [N + 1] with N >= 1; got {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}"
        )
    cu = [int(x) for x in cu_seqlens.tolist()]
    if cu[0] != 0 or cu[-1] != T:
        raise ValueError(f"cu_seqlens must start at 0 and end at T={T}; got {cu[0]} .. {cu[-1]}")
    lengths = [b - a for a, b in zip(cu[:-1], cu[1:])]
    bad = [i for i, n in enumerate(lengths) if n < 0]
    if bad:
        raise ValueError(f"cu_seqlens must be non-decreasing; sequence {bad[0]} has negative length")
    N = len(lengths)

    if initial_state is not None and initial_state.shape != (N, H, K, V):
        raise ValueError(f"initial_state must be [N, H, K, V]=({N}, {H}, {K}, {V}); got {tuple(initial_state.shape)}")

    requests: list[tuple[int, int]] = []
    if state_requests is not None:
        if state_requests.dim() != 2 or state_requests.shape[1] != 2:
            raise ValueError(
                f"state_requests must be [R, 2] (sequence, position count); got {tuple(state_requests.shape)}"
            )
        for r, (seq, count) in enumerate(state_requests.tolist()):
            if not 0 <= seq < N:
                raise ValueError(f"state_requests[{r}] names sequence {seq}, but there are {N} sequences")
            if not 0 <= count <= lengths[seq]:
                raise ValueError(
                    f"state_requests[{r}] asks for the state after {count} positions of sequence {seq}, "
                    f"which has {lengths[seq]} positions"
                )
            requests.append((int(seq), int(count)))

    # Half-precision inputs run the recurrence in float32, as fla does.
    compute_dtype = q.dtype if q.dtype in (torch.float32, torch.float64) else torch.float32
    return LinearAttnSpec(
        T=T,
        H=H,
        K=K,
        V=V,
        scalar_decay=scalar_decay,
        rule=rule,
        starts=cu[:-1],
        lengths=lengths,
        requests=requests,
        scale=K**-0.5 if scale is None else float(scale),
        compute_dtype=compute_dtype,
    )


def check_rule(rule: str, beta: torch.Tensor | None) -> None:
    """ValueError unless ``rule`` is one of ``RULES`` and ``beta`` fits it (a tensor for
    "delta", None for "plain": the plain rule has no write strength)."""
    if rule not in RULES:
        raise ValueError(f"linear-attention rule must be one of {', '.join(map(repr, RULES))}; got {rule!r}")
    if rule == "delta" and beta is None:
        raise ValueError("the delta rule needs beta [T, H]; pass rule='plain' for the recurrence without it")
    if rule == "plain" and beta is not None:
        raise ValueError("the plain rule takes no beta (pass None); beta is the delta rule's write strength")
