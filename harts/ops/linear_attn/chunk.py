"""Chunkwise linear attention (delta rule: KDA / GDN; plain rule: SSD / GLA) over packed varlen
sequences, with boundary-state export.

This is the reference chunk operator of the paper's contract (Eq. 16): packed sequences with
per-sequence initial states, final states, and the states after requested position counts, all
differentiable through plain torch autograd. It follows the chunkwise form of fla's chunk_kda /
chunk_gated_delta_rule (WY/UT representation per chunk, triangular solve, state propagation
across chunks), written for clarity: vectorized over chunks and heads, one Python loop step per
chunk index.

Math for one chunk of length B with start state S0 [K, V] (G = in-chunk cumulative sum of g,
so exp(G_t - G_s) <= 1 for s <= t; a = decayed state before token t's write):
    delta_t = beta_t (v_t - a_t^T k_t)            (the delta-rule write; solving for all t at once:)
    (I + M) delta = diag(beta) (V - (K * e^G) S0),  M_ts = beta_t sum_c k_t[c] k_s[c] e^{G_t[c] - G_s[c]}, s < t
    delta = U - W S0 with W = (I + M)^-1 diag(beta) (K * e^G),  U = (I + M)^-1 diag(beta) V
    O = scale * ((Q * e^G) S0 + A delta),   A_ts = sum_c q_t[c] k_s[c] e^{G_t[c] - G_s[c]}, s <= t
    S_B = e^{G_B} * S0 + (K * e^{G_B - G})^T delta = P S0 + R   (P, R formed for all chunks at once)
The plain rule (no beta) writes k_t v_t^T unchanged: delta = V, W = 0 (no triangular solve), and
the chunk transition is the diagonal S_B = e^{G_B} * S0 + (K * e^{G_B - G})^T V.
The state after r < B tokens of a chunk uses the same formula truncated to its first r tokens;
that is how a non-chunk-aligned request (the no_replay ablation) is exported exactly.

Each sequence's chunk grid starts at its own first row and every chunk only reads its own rows
and its own start state, so a sequence's result never depends on the others packed beside it.
The tail of the last chunk of a sequence is padded with q = k = v = g = beta = 0, which leaves
the state untouched (under either rule).

Shapes: T packed rows, H heads, K key dim, V value dim, N sequences, R requests, B chunk size,
n chunks of all sequences (after padding), a = sequences still running at one chunk index.
"""

from __future__ import annotations

import torch

from harts.ops.linear_attn.utils import LinearAttnSpec, check_linear_attn_inputs

__all__ = ["chunk_linear_attn"]

#: sub-block size of the in-chunk decayed scores (fla's BC); see `_decayed_scores`
SUB_BLOCK = 16


def chunk_linear_attn(
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
    """Chunkwise linear attention on packed sequences, exporting requested states.

    Args:
        q: [T, H, K] queries.
        k: [T, H, K] keys (callers normalise them; the op does not).
        v: [T, H, V] values.
        g: [T, H, K] per-channel log-decay (KDA, GLA) or [T, H] scalar log-decay (GDN, SSD), <= 0.
        beta: [T, H] write strengths in (0, 1) (rule "delta"); None (rule "plain").
        cu_seqlens: int [N + 1] boundaries of the packed sequences; each sequence's chunk grid
            starts at its first row.
        initial_state: [N, H, K, V] per-sequence initial states; None means zeros.
        chunk_size: B, the execution chunk length.
        state_requests: int [R, 2] rows (sequence, count): export the state after the first
            `count` positions of that sequence (0 <= count <= its length). count a multiple of B
            is the normal case (a chunk-boundary state); any other count is exact as well.
        scale: query scale; default K ** -0.5.
        rule: "delta" or "plain" (``harts.ops.linear_attn.utils``).

    Returns:
        o: [T, H, V] outputs (dtype of v); final_state: [N, H, K, V]; requested: [R, H, K, V]
        (states in the compute dtype: the input dtype, or float32 for half inputs).
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive; got {chunk_size}")
    spec = check_linear_attn_inputs(q, k, v, g, beta, cu_seqlens, initial_state, state_requests, scale, rule)
    B, N = chunk_size, spec.num_seqs
    dt, dev = spec.compute_dtype, q.device
    plan = _ChunkTable(spec, B, dev)

    # Pad the tail of each sequence's last chunk with zero rows, then lay chunks out as [n, H, B, .].
    def chunked(x: torch.Tensor) -> torch.Tensor:
        x = torch.cat([x.to(dt), x.new_zeros((1, *x.shape[1:]), dtype=dt)])
        return x[plan.src].movedim(2, 1)  # [n, B, H, ...] -> [n, H, B, ...]

    q_c, k_c, v_c, g_c = (chunked(x) for x in (q, k, v, g))
    q_c = q_c * spec.scale
    G = g_c.cumsum(2)
    # Bring a scalar decay to the [.., K] layout of the per-channel one by broadcasting.
    Gk = G[..., None] if spec.scalar_decay else G
    G_end = Gk[:, :, -1:]  # [n, H, 1, K or 1]

    kk, A = _decayed_scores(k_c, q_c, k_c, G)  # [n, H, B, B] each
    Q_g = q_c * Gk.exp()
    K_end_t = (k_c * (G_end - Gk).exp()).transpose(-1, -2)  # [n, H, K, B]
    # Chunk transition S_end = P S0 + R (delta: P = diag(e^{G_B}) - K_end^T W, R = K_end^T U;
    # plain: P = diag(e^{G_B}), applied as a product, R = K_end^T V), formed for all chunks at
    # once so that the sequential loop is one small product per chunk index.
    W: torch.Tensor | None = None
    if beta is None:
        U = v_c
        P = G_end.exp().transpose(-1, -2)  # [n, H, K or 1, 1]
    else:
        b_c = chunked(beta)
        M = b_c[..., None] * kk
        eye = torch.eye(B, dtype=dt, device=dev)
        rhs = b_c[..., None] * torch.cat([k_c * Gk.exp(), v_c], dim=-1)
        WU = torch.linalg.solve_triangular(eye + M, rhs, upper=False, unitriangular=True)
        W, U = WU.split([spec.K, spec.V], dim=-1)
        P = torch.diag_embed(G_end.exp()[:, :, 0].expand(-1, -1, spec.K)) - K_end_t @ W
    R = K_end_t @ U

    if initial_state is None:
        S = q.new_zeros(N, spec.H, spec.K, spec.V, dtype=dt)
    else:
        S = initial_state.to(dt)
    S = S[plan.order.to(dev)]  # sequences by descending chunk count: the running ones are a prefix
    starts: list[torch.Tensor] = []  # starts[j] = start states of chunk j of the running prefix
    finals: list[torch.Tensor] = []  # pieces of the final states, highest rank first
    # One split per tensor (not a slice per step): a split's backward is one concatenation, while
    # every slice's backward would allocate a zero gradient of the full size.
    sizes = [hi - lo for lo, hi in plan.step_slices]
    for P_j, R_j in zip(P.split(sizes), R.split(sizes)):
        a = P_j.shape[0]
        if a < S.shape[0]:
            finals.append(S[a:])
            S = S[:a]
        starts.append(S)
        S = (P_j * S if W is None else P_j @ S) + R_j
    finals.append(S)
    final_sorted = torch.cat(finals[::-1])
    S0 = torch.cat(starts) if starts else S.new_zeros(0, spec.H, spec.K, spec.V)  # [n, H, K, V]

    delta = U if W is None else U - W @ S0
    o_flat = (Q_g @ S0 + A @ delta).movedim(1, 2).reshape(-1, spec.H, spec.V)
    o = o_flat[plan.row_index]

    # Requested states, grouped by how they are read, then put back in request order.
    pieces = [S0[plan.req_start_chunk], final_sorted[plan.req_final_rank]]
    ids, count = plan.req_mid_chunk, plan.req_mid_count
    if len(ids):
        # mid-chunk: the end-of-chunk formula over the chunk's first `count` tokens
        kept = torch.arange(B, device=dev)[None, :] < count[:, None]  # [Rm, B]
        G_r = Gk[ids, :, count - 1]  # [Rm, H, K or 1]
        decay = torch.where(kept[:, None, :, None], G_r[:, :, None, :] - Gk[ids], float("-inf")).exp()
        k_r = (k_c[ids] * decay).transpose(-1, -2)
        pieces.append(G_r.exp()[..., None] * S0[ids] + k_r @ delta[ids])
    requested = torch.cat(pieces)[plan.req_inverse]
    return o.to(v.dtype), final_sorted[plan.rank.to(dev)], requested


class _ChunkTable:
    """Host-side index tables of one call: chunks in time-major order over sorted sequences.

    Sequences are ranked by descending chunk count, so at chunk index j the running sequences
    are ranks [0, a_j) and their chunks are the contiguous slice step_slices[j] of the chunk
    table; state propagation then slices instead of scattering.
        src        int64 [n, B]  packed row of each chunk position, T for padding
        row_index  int64 [T]     flat (chunk * B + offset) slot of each packed row
        order      int64 [N]     sequence at each rank; rank = its inverse
    """

    def __init__(self, spec: LinearAttnSpec, B: int, device: torch.device) -> None:
        lengths = torch.tensor(spec.lengths, dtype=torch.int64)
        starts = torch.tensor(spec.starts, dtype=torch.int64)
        self.num_chunks = (lengths + B - 1) // B
        self.order = torch.sort(-self.num_chunks, stable=True).indices
        self.rank = torch.empty_like(self.order)
        self.rank[self.order] = torch.arange(len(self.order))
        sorted_chunks = self.num_chunks[self.order]
        max_chunks = int(sorted_chunks[0]) if len(sorted_chunks) else 0
        running = [int((sorted_chunks > j).sum()) for j in range(max_chunks)]
        self.step_slices: list[tuple[int, int]] = []
        offset = 0
        for a in running:
            self.step_slices.append((offset, offset + a))
            offset += a
        chunk_seq = torch.cat([self.order[:a] for a in running]) if running else lengths.new_zeros(0)
        chunk_j = torch.cat([torch.full((a,), j) for j, a in enumerate(running)]) if running else lengths.new_zeros(0)
        pos = chunk_j[:, None] * B + torch.arange(B)
        valid = pos < lengths[chunk_seq][:, None]
        src = torch.where(valid, starts[chunk_seq][:, None] + pos, spec.T)
        row_index = torch.empty(spec.T, dtype=torch.int64)
        row_index[src[valid]] = torch.nonzero(valid.flatten()).flatten()
        self.src = src.to(device)
        self.row_index = row_index.to(device)
        # requests: a chunk's start state, a final state, or a mid-chunk state (chunk, count)
        groups: tuple[list[int], list[int], list[int]] = ([], [], [])
        start_chunk, final_rank, mid_chunk, mid_count = [], [], [], []
        for r, (seq, count) in enumerate(spec.requests):
            c, rest = divmod(count, B)
            rank = int(self.rank[seq])
            if rest:
                groups[2].append(r)
                mid_chunk.append(self.step_slices[c][0] + rank)
                mid_count.append(rest)
            elif c < self.num_chunks[seq]:
                groups[0].append(r)
                start_chunk.append(self.step_slices[c][0] + rank)
            else:
                groups[1].append(r)
                final_rank.append(rank)
        as_index = lambda xs: torch.tensor(xs, dtype=torch.int64, device=device)  # noqa: E731
        self.req_start_chunk, self.req_final_rank = as_index(start_chunk), as_index(final_rank)
        self.req_mid_chunk, self.req_mid_count = as_index(mid_chunk), as_index(mid_count)
        self.req_inverse = torch.argsort(as_index(groups[0] + groups[1] + groups[2]))


def _decayed_scores(
    a: torch.Tensor, a2: torch.Tensor, b: torch.Tensor, G: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """In-chunk decayed scores for two query-side tensors sharing one decay computation.

    scores[.., t, s] = sum_c x_t[c] b_s[c] exp(G_t[c] - G_s[c]); returned for x = a masked to
    s < t (strict: the delta-rule system) and for x = a2 masked to s <= t (the output scores).
    a, a2, b: [n, H, B, K]; G: [n, H, B, K] (per channel) or [n, H, B] (scalar); returns two
    [n, H, B, B]. Exponents are clamped at 0 and the invisible pairs masked out of the result,
    so every exp is <= 1 and nothing overflows in float32 (exp(G_t) * exp(-G_s) would).
    Per-channel decay uses fla's sub-block scheme: explicit pairwise decays inside each diagonal
    SUB_BLOCK x SUB_BLOCK block, and for earlier blocks the factorisation through the first row
    r of the query's block, exp(G_t - G_r) * exp(G_r - G_s), both factors <= 1.
    """
    B = a.shape[-2]
    idx = torch.arange(B, device=a.device)
    strict, incl = idx[:, None] > idx[None, :], idx[:, None] >= idx[None, :]
    if G.dim() == a.dim() - 1:
        decay = (G[..., :, None] - G[..., None, :]).clamp(max=0).exp()
        bt = b.transpose(-1, -2)
        return (a @ bt) * decay * strict, (a2 @ bt) * decay * incl

    c = SUB_BLOCK if B % SUB_BLOCK == 0 else B
    nb = B // c
    a_blk, a2_blk, b_blk, G_blk = (x.unflatten(-2, (nb, c)) for x in (a, a2, b, G))  # [n, H, nb, c, K]
    pair = (G_blk[..., :, None, :] - G_blk[..., None, :, :]).clamp(max=0).exp()  # [n, H, nb, c, c, K]
    b_pair = b_blk[..., None, :, :] * pair
    diag = [torch.einsum("...tk,...tsk->...ts", x, b_pair) for x in (a_blk, a2_blk)]  # [n, H, nb, c, c]

    G_ref = G_blk[..., :, :1, :]  # first row of each block: [n, H, nb, 1, K]
    earlier = idx[None, :] < (torch.arange(nb, device=a.device) * c)[:, None]  # [nb, B]
    b_ref = b[..., None, :, :] * (G_ref - G[..., None, :, :]).clamp(max=0).exp()  # [n, H, nb, B, K]
    q_decay = (G_blk - G_ref).exp()  # <= 1: rows at or after their block's first row
    eye = torch.eye(nb, dtype=a.dtype, device=a.device)
    out = []
    for x, d, mask in ((a_blk, diag[0], strict), (a2_blk, diag[1], incl)):
        off = ((x * q_decay) @ b_ref.transpose(-1, -2)) * earlier[:, None, :]  # [n, H, nb, c, B]
        diag_full = torch.einsum("...its,ij->...itjs", d * mask[:c, :c], eye).flatten(-2)
        out.append((off + diag_full).flatten(-3, -2))
    return out[0], out[1]
