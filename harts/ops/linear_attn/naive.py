"""Token-by-token linear attention: the obviously-correct reference for every linear-attention op.

Per sequence, state S [K, V] starts at its initial state and for each token t (fla semantics):
    S = exp(g_t)[:, None] * S          (GDN, SSD: scalar exp(g_t))
    S = S + beta_t * k_t (v_t - S^T k_t)^T    (rule "delta")
    S = S + k_t v_t^T                          (rule "plain")
    o_t = scale * S^T q_t
Requested states are S after the first `count` tokens of a sequence (count = 0: the initial state).

Shapes: T packed rows, H heads, K key dim, V value dim, N sequences, R state requests.
"""

from __future__ import annotations

import torch

from harts.ops.linear_attn.utils import check_linear_attn_inputs

__all__ = ["naive_recurrent_linear_attn"]


def naive_recurrent_linear_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor | None,
    *,
    cu_seqlens: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = 64,
    state_requests: torch.Tensor | None = None,
    scale: float | None = None,
    rule: str = "delta",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run the recurrence one token at a time (slow; for tests).

    Args:
        q: [T, H, K] queries.
        k: [T, H, K] keys.
        v: [T, H, V] values.
        g: [T, H, K] per-channel (KDA) or [T, H] scalar (GDN, SSD) log-decay, <= 0.
        beta: [T, H] write strengths (rule "delta"); None (rule "plain").
        cu_seqlens: int [N + 1] boundaries of the packed sequences.
        initial_state: [N, H, K, V] per-sequence initial states; None means zeros.
        chunk_size: ignored (the recurrence has no chunks); kept for a signature identical to
            `chunk_linear_attn`.
        state_requests: int [R, 2] rows (sequence, count): return the state after `count` tokens.
        scale: query scale; default K ** -0.5.
        rule: "delta" or "plain" (module docstring).

    Returns:
        o: [T, H, V] outputs (dtype of v), final_state: [N, H, K, V], requested: [R, H, K, V]
        (states in the compute dtype: float32 for half inputs).
    """
    del chunk_size
    spec = check_linear_attn_inputs(q, k, v, g, beta, cu_seqlens, initial_state, state_requests, scale, rule)
    dt = spec.compute_dtype
    q, k, v, g = (x.to(dt) for x in (q, k, v, g))
    wanted: dict[tuple[int, int], torch.Tensor] = {}
    wanted_keys = set(spec.requests)
    outputs: list[torch.Tensor] = []
    finals: list[torch.Tensor] = []
    for i, (start, length) in enumerate(zip(spec.starts, spec.lengths)):
        if initial_state is None:
            S = q.new_zeros(spec.H, spec.K, spec.V)
        else:
            S = initial_state[i].to(dt)
        if (i, 0) in wanted_keys:
            wanted[(i, 0)] = S
        for t in range(start, start + length):
            decay = g[t].exp()[:, None, None] if spec.scalar_decay else g[t].exp()[:, :, None]
            S = decay * S
            k_t, v_t = k[t], v[t]
            if beta is not None:
                predicted = torch.einsum("hkv,hk->hv", S, k_t)
                S = S + torch.einsum("hk,hv->hkv", beta[t].to(dt)[:, None] * k_t, v_t - predicted)
            else:
                S = S + torch.einsum("hk,hv->hkv", k_t, v_t)
            outputs.append(spec.scale * torch.einsum("hkv,hk->hv", S, q[t]))
            if (i, t + 1 - start) in wanted_keys:
                wanted[(i, t + 1 - start)] = S
        finals.append(S)
    o = torch.stack(outputs) if outputs else v.new_zeros(0, spec.H, spec.V)
    requested = [wanted[key] for key in spec.requests]
    empty = q.new_zeros(0, spec.H, spec.K, spec.V)
    return o.to(v.dtype), torch.stack(finals), torch.stack(requested) if requested else empty
