"""Incremental decoding of a ``HybridLM``: per-branch caches that forks share, extended in batches.

A ``Branch`` is the decoding state of one live path. Per decoder layer it holds

    linear attention (K, G):  conv_WC   the last W-1 pre-conv inputs of the short conv
                              state_HKV the delta-rule state after every token so far
    full attention (M, A):    k_LGD, v_LGE  keys and values of the L tokens so far

plus ``length`` (tokens consumed, which is the RoPE position of the next one), the next-token
``logits`` and ``pending`` tokens (sampled but not yet run through the model). Cached tensors are
never written in place: an update builds new tensors, so ``fork`` is a shallow copy and the
children share their parent's prefix until each extends it.

``extend`` runs the model's *own* decoder layers (the weights and code of the training forward)
on the new tokens of many branches at once. The layers only see rows and a ``RowContext``; here
that context is ``DecodeContext``, whose three row-coupling operations read and update the
caches instead of looking at a tree:

    short_conv        causal depthwise conv over [cached inputs, new inputs] of the branch
    linear_attention  the gated delta rule (or the plain rule: Mamba-2's SSD) token by token
                      from the cached state (fla semantics, as ``harts.ops.linear_attn.naive``)
    attention         softmax attention of the new queries over [cached, new] keys, causal

A call may give each branch a different number of new tokens (a prompt or an observation is one
chunk; decoding is one token per live branch): rows are padded to ``[B, n_max]`` inside the ops.

Shapes: B branches in a call, n_max their most new tokens, T = sum of new tokens (rows),
C conv channels, W conv width, H heads, K/V/D/E head dims, G kv heads, L cached tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from harts.models.execution.backends import Backends
from harts.models.execution.base import RowContext
from harts.models.hybrid_lm import HybridLM

__all__ = ["Branch", "DecodeContext", "LayerCache", "extend", "extend_hidden", "new_branch"]


@dataclass(frozen=True, slots=True)
class LayerCache:
    """One layer's cache for one branch; unused fields are None (see the module docstring)."""

    conv_WC: torch.Tensor | None = None
    state_HKV: torch.Tensor | None = None
    k_LGD: torch.Tensor | None = None
    v_LGE: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class Branch:
    """Decoding state of one path; immutable, so forks share every cached tensor."""

    layers: tuple[LayerCache, ...]
    #: tokens the model has consumed (the RoPE position of the next one)
    length: int
    #: [V] next-token logits after the consumed tokens (None before the first extend)
    logits: torch.Tensor | None = None
    #: sampled tokens not yet consumed (the next ``extend`` runs them first)
    pending: tuple[int, ...] = ()

    def fork(self, n: int) -> list[Branch]:
        """``n`` children sharing this branch's caches."""
        return [replace(self) for _ in range(n)]


def new_branch(model: HybridLM) -> Branch:
    """An empty branch (no tokens consumed) for ``model``."""
    return Branch(layers=tuple(LayerCache() for _ in model.layers), length=0)


class DecodeContext(RowContext):
    """The ``RowContext`` of one ``extend`` call (module docstring).

    Rows are the new tokens of each branch, branch after branch; ``layer`` is set by the caller
    before each decoder layer runs, and ``caches[b][layer]`` collects the updated caches.
    """

    def __init__(
        self,
        branches: Sequence[Branch],
        counts: Sequence[int],
        device: torch.device,
        backends: Backends = Backends(),  # noqa: B008
    ) -> None:
        #: the model's kernel record (``HybridLM.backends``): its layers' fast paths
        self.backends = backends
        self.branches = list(branches)
        self.counts = torch.as_tensor(list(counts), dtype=torch.int64)
        self.lengths = torch.as_tensor([b.length for b in branches], dtype=torch.int64)
        self.num_rows = int(self.counts.sum())
        self.n_max = int(self.counts.max())
        self.device = device
        # valid_BN[b, t]: branch b has a t-th new token; rows are valid_BN's True entries, row-major
        self.valid_BN = (torch.arange(self.n_max)[None, :] < self.counts[:, None]).to(device)
        pos_BN = self.lengths[:, None] + torch.arange(self.n_max)[None, :]
        self.position = pos_BN.to(device)[self.valid_BN]
        self.row_weight = torch.ones(self.num_rows, dtype=torch.float64, device=device)
        # part of the RowContext interface; the recurrence here runs token by token, unchunked
        self.chunk_size = 64
        #: the decoder layer running now (``extend`` sets it): which cache the ops read and write
        self.layer = -1
        self.caches: list[list[LayerCache]] = [list(b.layers) for b in branches]

    # ------------------------------------------------------------------ helpers
    def _pad(self, x_T: torch.Tensor) -> torch.Tensor:
        """[T, ...] rows -> [B, n_max, ...] with zeros where a branch has fewer new tokens."""
        out = x_T.new_zeros(len(self.branches), self.n_max, *x_T.shape[1:])
        out[self.valid_BN] = x_T
        return out

    def _cache(self, b: int) -> LayerCache:
        return self.caches[b][self.layer]

    def _set(self, b: int, **fields: torch.Tensor) -> None:
        self.caches[b][self.layer] = replace(self.caches[b][self.layer], **fields)

    # ------------------------------------------------------------------ ops
    def short_conv(self, x_TD, weight_DW, bias_D, activation):  # type: ignore[override]
        c, w = weight_DW.shape
        zero = x_TD.new_zeros(w - 1, c)
        convs = [self._cache(b).conv_WC for b in range(len(self.branches))]
        conv_BWC = torch.stack([zero if c is None else c for c in convs])
        full = torch.cat([conv_BWC, self._pad(x_TD)], dim=1)  # [B, W-1+n_max, C]
        y = (full.unfold(1, w, 1) * weight_DW).sum(-1)  # [B, n_max, C]
        if bias_D is not None:
            y = y + bias_D
        for b, n in enumerate(self.counts.tolist()):
            self._set(b, conv_WC=full[b, n : n + w - 1])
        y = y[self.valid_BN]
        return y if activation is None else F.silu(y)

    def linear_attention(self, q_THK, k_THK, v_THV, g, beta_TH, *, rule="delta", scale=None):  # type: ignore[override]
        h, kd, vd = q_THK.shape[1], q_THK.shape[2], v_THV.shape[2]
        scale = kd**-0.5 if scale is None else scale
        dt = torch.promote_types(q_THK.dtype, torch.float32)
        q, k, v, gg = (self._pad(x.to(dt)) for x in (q_THK, k_THK, v_THV, g))
        # the plain rule (beta None) writes k v^T with no delta correction
        beta = None if rule == "plain" else self._pad(beta_TH.to(dt))
        zero = q_THK.new_zeros(h, kd, vd, dtype=dt)
        states = [self._cache(b).state_HKV for b in range(len(self.branches))]
        S = torch.stack([zero if s is None else s for s in states])
        outs = []
        for t in range(self.n_max):
            decay = gg[:, t].exp()[..., None, None] if gg.dim() == 3 else gg[:, t].exp()[..., None]
            S_new = decay * S
            if beta is None:
                S_new = S_new + torch.einsum("bhk,bhv->bhkv", k[:, t], v[:, t])
            else:
                predicted = torch.einsum("bhkv,bhk->bhv", S_new, k[:, t])
                S_new = S_new + torch.einsum("bhk,bhv->bhkv", beta[:, t][..., None] * k[:, t], v[:, t] - predicted)
            outs.append(scale * torch.einsum("bhkv,bhk->bhv", S_new, q[:, t]))
            S = torch.where(self.valid_BN[:, t, None, None, None], S_new, S)
        for b in range(len(self.branches)):
            self._set(b, state_HKV=S[b])
        return torch.stack(outs, dim=1)[self.valid_BN].to(v_THV.dtype)

    def attention(self, q_THD, k_TGD, v_TGE, *, scale):  # type: ignore[override]
        nb, counts = len(self.branches), self.counts.tolist()
        k_new, v_new = k_TGD.split(counts), v_TGE.split(counts)
        keys, values = [], []
        for b in range(nb):
            c = self._cache(b)
            kb = k_new[b] if c.k_LGD is None else torch.cat([c.k_LGD, k_new[b]])
            vb = v_new[b] if c.v_LGE is None else torch.cat([c.v_LGE, v_new[b]])
            self._set(b, k_LGD=kb, v_LGE=vb)
            keys.append(kb)
            values.append(vb)
        m = max(x.shape[0] for x in keys)
        k_BMGD = torch.stack([F.pad(x, (0, 0, 0, 0, 0, m - x.shape[0])) for x in keys])
        v_BMGE = torch.stack([F.pad(x, (0, 0, 0, 0, 0, m - x.shape[0])) for x in values])
        q_BNHD = self._pad(q_THD)
        # query t of branch b sits at position lengths[b] + t and sees keys 0..lengths[b] + t
        limit_BN = (self.lengths[:, None] + torch.arange(self.n_max)[None, :]).to(q_THD.device)
        mask_BNM = torch.arange(m, device=q_THD.device)[None, None, :] <= limit_BN[..., None]
        o = F.scaled_dot_product_attention(
            q_BNHD.transpose(1, 2),
            k_BMGD.transpose(1, 2),
            v_BMGE.transpose(1, 2),
            attn_mask=mask_BNM[:, None],
            scale=scale,
            enable_gqa=k_TGD.shape[1] != q_THD.shape[1],
        )
        return o.transpose(1, 2)[self.valid_BN]


@torch.no_grad()
def extend(model: HybridLM, branches: Sequence[Branch], tokens: Sequence[Sequence[int]]) -> list[Branch]:
    """Feed each branch its ``pending`` tokens and then ``tokens[b]``; one batched forward.

    Every branch must get at least one token. Returns new branches with updated caches,
    ``length`` and ``logits`` [V] (after its last token, in the model's compute dtype).
    """
    return extend_hidden(model, branches, tokens)[0]


@torch.no_grad()
def extend_hidden(
    model: HybridLM, branches: Sequence[Branch], tokens: Sequence[Sequence[int]]
) -> tuple[list[Branch], list[torch.Tensor]]:
    """``extend``, and each branch's final hidden states (after the last norm, divided by the
    model's ``logits_scaling``) at every token it was fed, ``[n_b, D]``: ``F.linear(h,
    model.lm_head_weight)`` of row t is the next-token logits after its t-th fed token, for
    callers that need more than the last row's (the top-k log-probs of a prompt) and compute
    them a few rows at a time."""
    if len(branches) != len(tokens):
        raise ValueError(f"{len(branches)} branches but {len(tokens)} token lists")
    feeds = [list(b.pending) + [int(t) for t in toks] for b, toks in zip(branches, tokens)]
    empty = [i for i, f in enumerate(feeds) if not f]
    if empty:
        raise ValueError(f"branch {empty[0]} has no token to extend with")
    device = model.embed_tokens.weight.device
    ctx = DecodeContext(branches, [len(f) for f in feeds], device, model.backends())
    flat = torch.as_tensor([t for f in feeds for t in f], dtype=torch.int64, device=device)
    h = model.embed_tokens(flat)
    if model.config.embedding_multiplier != 1.0:  # Granite's scalings, as HybridLM.forward
        h = h * model.config.embedding_multiplier
    for i, layer in enumerate(model.layers):
        ctx.layer = i
        h = layer(h, ctx)[0]
    h_TD = model.norm(h)
    if model.config.logits_scaling != 1.0:  # logits / s, as (h / s) W^T: the head is linear
        h_TD = h_TD / model.config.logits_scaling
    last = torch.cumsum(ctx.counts, 0) - 1
    logits = F.linear(h_TD[last.to(device)], model.lm_head_weight)
    out = [
        Branch(layers=tuple(ctx.caches[b]), length=br.length + len(feeds[b]), logits=logits[b])
        for b, br in enumerate(branches)
    ]
    return out, list(h_TD.split(ctx.counts.tolist()))
