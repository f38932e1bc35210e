"""CUDA fast path of `chunk_linear_attn` over fla-core's Triton kernels (imported lazily).

Same contract as `harts.ops.linear_attn.chunk.chunk_linear_attn`. The kernels per rule and decay:
delta rule `chunk_kda` (per-channel) / `chunk_gated_delta_rule` (scalar); plain rule
`chunk_gla` (per-channel) / `chunk_simple_gla` (scalar: Mamba-2's SSD). fla's chunk ops return
outputs and final states only: the chunk-boundary states they
compute inside a call can be neither returned with a gradient nor receive one (their backward
takes a gradient for the final state only, see design/GPU.md). Boundary states are therefore
exported by **splitting at chunk boundaries**:

1. Each sequence is cut at every requested chunk-aligned count c*B and at the anchor a(p) =
   floor(p/B)*B of every non-aligned count p. Piece r of every sequence runs in packed call r,
   started from the final state of its piece r-1 (`output_final_state=True`). A cut on the
   sequence's own chunk grid does not change which rows share a chunk, and fla carries the
   state between chunks in float32 both inside a call and through `final_state`, so the pieces
   reproduce the uncut call; the exported state is a real autograd node, so gradients from
   its consumers flow back through fla's `dht`/`dh0` support.
2. A non-aligned count p (the no_replay ablation) is read by one extra packed call of probe
   sequences [a(p), p), each shorter than one chunk, started from the state at a(p).

Calls per invocation: 1 + (most cuts in one sequence) + (1 if any non-aligned request).

Guards: tensors must be on CUDA; chunk_size must be one fla supports (KDA: 32 or 64; GDN and
the plain rule: 64). The scalar-decay backwards (GDN's and simple_gla's, both through fla's
gated chunk_bwd_dqkwg) in fla-core 0.6.0 refuse to run on Hopper with Triton in [3.4, 3.7.1)
(fla-org/flash-linear-attention#640); when such a call needs gradients on such a setup this path
falls back to the reference operator (with a one-time warning) instead of failing in backward.

Shapes: T packed rows, H heads, K key dim, V value dim, N sequences, R requests, B chunk size.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from harts.ops.linear_attn.chunk import chunk_linear_attn
from harts.ops.linear_attn.utils import LinearAttnSpec, check_linear_attn_inputs
from harts.ops.upload import upload

__all__ = ["fla_chunk_linear_attn", "fla_available"]

_warned_scalar_fallback = False


def fla_available() -> bool:
    """True when fla-core imports and a CUDA device is present."""
    if not torch.cuda.is_available():
        return False
    try:
        _import_fla()
    except ImportError:
        return False
    return True


def _import_fla() -> None:
    """Import fla-core's KDA and GDN ops, pinning their Triton configs first (``fla_configs``)."""
    from harts.ops.linear_attn.fla_configs import configure_fla_cache

    if "fla" not in __import__("sys").modules:
        configure_fla_cache()
    import fla.ops.gated_delta_rule  # noqa: F401
    import fla.ops.gla  # noqa: F401
    import fla.ops.kda  # noqa: F401
    import fla.ops.simple_gla  # noqa: F401


def fla_chunk_linear_attn(
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
    """fla-core backed linear attention with boundary-state export (see the module docstring).

    Args:
        q: [T, H, K] queries (CUDA; bf16, fp16 or fp32).
        k: [T, H, K] keys.
        v: [T, H, V] values.
        g: [T, H, K] per-channel log-decay (KDA `chunk_kda`, GLA `chunk_gla`) or [T, H] scalar
            (GDN `chunk_gated_delta_rule`, SSD `chunk_simple_gla`).
        beta: [T, H] write strengths in (0, 1) (rule "delta"); None (rule "plain").
        cu_seqlens: int [N + 1] packed sequence boundaries.
        initial_state: [N, H, K, V] per-sequence initial states; None means zeros.
        chunk_size: B; KDA accepts 32 or 64, GDN and the plain rule 64.
        state_requests: int [R, 2] rows (sequence, position count) to export.
        scale: query scale; default K ** -0.5.
        rule: "delta" or "plain" (``harts.ops.linear_attn.utils``).

    Returns:
        o: [T, H, V] (dtype of v); final_state: [N, H, K, V] float32; requested: [R, H, K, V] float32.
    """
    spec = check_linear_attn_inputs(q, k, v, g, beta, cu_seqlens, initial_state, state_requests, scale, rule)
    if not q.is_cuda:
        raise ValueError("fla_chunk_linear_attn needs CUDA tensors; use chunk_linear_attn on CPU")
    allowed = (32, 64) if rule == "delta" and not spec.scalar_decay else (64,)
    if chunk_size not in allowed:
        raise ValueError(f"fla supports chunk_size in {allowed} for {_kernel_name(spec)}; got {chunk_size}")
    needs_grad = torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in (q, k, v, g, beta, initial_state)
    )
    if spec.scalar_decay and needs_grad and _gdn_backward_broken():
        global _warned_scalar_fallback
        if not _warned_scalar_fallback:
            warnings.warn(
                "fla-core's scalar-decay backward (GDN, simple_gla) is disabled on Hopper with this Triton "
                "(fla #640); falling back to the reference chunk_linear_attn for such calls that need gradients",
                stacklevel=2,
            )
            _warned_scalar_fallback = True
        return chunk_linear_attn(
            q,
            k,
            v,
            g,
            beta,
            cu_seqlens=cu_seqlens,
            initial_state=initial_state,
            chunk_size=chunk_size,
            state_requests=state_requests,
            scale=scale,
            rule=rule,
        )
    return fla_split_linear_attn(q, k, v, g, beta, spec, initial_state, chunk_size)


def fla_split_linear_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor | None,
    spec: LinearAttnSpec,
    initial_state: torch.Tensor | None,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``fla_chunk_linear_attn`` after its checks (``spec``: the checked inputs): the sequences
    split at requested states, one fla call per piece index (the module docstring). Needs no
    CUDA of its own: Triton's interpreter runs it on CPU tensors (the tests)."""
    B, N, dev = chunk_size, spec.num_seqs, q.device
    h0 = (
        initial_state.float()
        if initial_state is not None
        else q.new_zeros(N, spec.H, spec.K, spec.V, dtype=torch.float32)
    )
    # cuts[i]: sorted positions where sequence i is split (chunk-aligned, strictly inside it)
    cuts: list[list[int]] = [[] for _ in range(N)]
    for seq, count in spec.requests:
        anchor = count // B * B
        if 0 < anchor < spec.lengths[seq]:
            cuts[seq].append(anchor)
    cuts = [sorted(set(c)) for c in cuts]
    bounds = [[0, *c, n] for c, n in zip(cuts, spec.lengths)]

    # state_at[(i, pos)] for pos in bounds[i]: pos 0 is the initial state, the last the final one
    state_at: dict[tuple[int, int], torch.Tensor] = {(i, 0): h0[i] for i in range(N)}
    out_pieces: list[torch.Tensor] = []
    out_rows: list[np.ndarray] = []
    for r in range(max(len(b) - 1 for b in bounds)):
        seqs = [i for i in range(N) if len(bounds[i]) - 1 > r and bounds[i][r + 1] > bounds[i][r]]
        if not seqs:
            continue
        spans = [(spec.starts[i] + bounds[i][r], spec.starts[i] + bounds[i][r + 1]) for i in seqs]
        o, ht = _fla_call(q, k, v, g, beta, spans, torch.stack([state_at[(i, bounds[i][r])] for i in seqs]), spec, B)
        out_pieces.append(o)
        out_rows.append(np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in spans]))
        for j, i in enumerate(seqs):
            state_at[(i, bounds[i][r + 1])] = ht[j]
    for i in range(N):  # empty sequences keep their initial state
        state_at.setdefault((i, spec.lengths[i]), h0[i])

    probes = sorted({(seq, count) for seq, count in spec.requests if count % B})
    if probes:
        spans = [(spec.starts[i] + count // B * B, spec.starts[i] + count) for i, count in probes]
        h_probe = torch.stack([state_at[(i, count // B * B)] for i, count in probes])
        _, ht = _fla_call(q, k, v, g, beta, spans, h_probe, spec, B)
        for j, key in enumerate(probes):
            state_at[key] = ht[j]

    if out_pieces:
        # every row is in exactly one piece: sorting the pieces' rows restores packed order
        order = upload(np.argsort(np.concatenate(out_rows), kind="stable"), dev)
        o = torch.cat(out_pieces)[order]
    else:
        o = v.new_zeros(0, spec.H, spec.V)
    final = torch.stack([state_at[(i, spec.lengths[i])] for i in range(N)])
    requested = [state_at[key] for key in spec.requests]
    req = torch.stack(requested) if requested else h0.new_zeros(0, spec.H, spec.K, spec.V)
    return o.to(v.dtype), final, req


def _kernel_name(spec: LinearAttnSpec) -> str:
    """The fla op a call of ``spec`` runs (for messages)."""
    if spec.rule == "plain":
        return "the plain rule (simple_gla)" if spec.scalar_decay else "the plain rule (GLA)"
    return "GDN" if spec.scalar_decay else "KDA"


def _fla_call(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor | None,
    spans: list[tuple[int, int]],
    h0: torch.Tensor,
    spec: LinearAttnSpec,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One packed fla call over the row spans [(start, end)]; returns (o [sum len, H, V], ht [n, H, K, V])."""
    _import_fla()
    dev = q.device
    # index arrays built on the host and uploaded once, without waiting for the device
    rows_np = np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in spans])
    cu_np = np.concatenate([[0], np.cumsum([b - a for a, b in spans])]).astype(np.int64)
    rows, cu = upload(rows_np, dev), upload(cu_np, dev)
    args = [x[rows].unsqueeze(0).contiguous() for x in (q, k, v, g, *(() if beta is None else (beta,)))]
    kw = dict(scale=spec.scale, initial_state=h0.contiguous(), output_final_state=True, cu_seqlens=cu)
    if spec.rule == "plain" and spec.scalar_decay:
        from fla.ops.simple_gla import chunk_simple_gla

        o, ht = chunk_simple_gla(*args, **kw, cu_seqlens_cpu=torch.as_tensor(cu_np), chunk_size=chunk_size)
    elif spec.rule == "plain":
        from fla.ops.gla import chunk_gla

        o, ht = chunk_gla(*args, **kw, cu_seqlens_cpu=torch.as_tensor(cu_np))
    elif spec.scalar_decay:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        o, ht = chunk_gated_delta_rule(
            *args, scale=spec.scale, initial_state=h0.contiguous(), output_final_state=True, cu_seqlens=cu
        )
    else:
        from fla.ops.kda import chunk_kda

        o, ht = chunk_kda(
            *args,
            scale=spec.scale,
            initial_state=h0.contiguous(),
            output_final_state=True,
            cu_seqlens=cu,
            chunk_size=chunk_size,
        )
    return o[0], ht


def _gdn_backward_broken() -> bool:
    """fla-core 0.6.0 refuses GDN's gated chunk_bwd_dqkwg on Hopper with Triton in [3.4, 3.7.1)."""
    import triton
    from packaging.version import Version

    major, _ = torch.cuda.get_device_capability()
    return major == 9 and Version("3.4.0") <= Version(triton.__version__.split("+")[0]) < Version("3.7.1")
