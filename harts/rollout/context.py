"""The decode ``RowContext``: the three row-coupling operations of the model's layers over a
``SlotCache`` (``harts.rollout.fast``'s module docstring says what each does at prefill and at
a step), and the one-token linear-attention recurrence the step runs off CUDA.

Shapes: B sequences in a call, n_max their most new tokens, T = sum of new tokens (rows),
C conv channels, W conv width, H heads, K/V/D/E head dims, G kv heads, M keys per row.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from harts.models.execution.backends import Backends
from harts.models.execution.base import RowContext
from harts.rollout.cache import SlotCache

__all__ = ["FastContext", "recurrent_step"]


def recurrent_step(
    q_BHK: torch.Tensor,
    k_BHK: torch.Tensor,
    v_BHV: torch.Tensor,
    g: torch.Tensor,
    beta_BH: torch.Tensor | None,
    state_BHKV: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the linear-attention recurrence for B sequences (``harts.ops.linear_attn``'s
    rules: delta with ``beta_BH``, plain without); g [B, H, K] per-channel or [B, H] scalar
    log-decay. Returns (o [B, H, V], the new state [B, H, K, V]), in the state's dtype."""
    dt = state_BHKV.dtype
    q, k, v = q_BHK.to(dt), k_BHK.to(dt), v_BHV.to(dt)
    decay = g.to(dt).exp()
    S = state_BHKV * (decay[..., None, None] if decay.dim() == 2 else decay[..., None])
    if beta_BH is None:
        S = S + k[..., None] * v[..., None, :]
    else:
        predicted = torch.einsum("bhkv,bhk->bhv", S, k)
        S = S + (beta_BH.to(dt)[..., None] * k)[..., None] * (v - predicted)[..., None, :]
    return scale * torch.einsum("bhkv,bhk->bhv", S, q), S


def _fla_step(q, k, v, g, beta, state, scale):  # type: ignore[no-untyped-def]
    """``recurrent_step`` by fla-core's fused recurrent kernels (CUDA): KDA's per-channel decay
    or GDN's scalar one, every sequence a batch row of one token."""
    if g.dim() == 3:
        from fla.ops.kda import fused_recurrent_kda as kernel

        o, S = kernel(q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None], scale=scale,
                      initial_state=state, output_final_state=True)  # fmt: skip
    else:
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as kernel

        o, S = kernel(q[:, None], k[:, None], v[:, None], g=g[:, None], beta=beta[:, None], scale=scale,
                      initial_state=state, output_final_state=True)  # fmt: skip
    return o[:, 0], S


class FastContext(RowContext):
    """The ``RowContext`` of one ``FastDecoder`` call (module docstring): rows are the new tokens
    of sequences ``ids``, sequence after sequence; ``layer`` is set before each decoder layer."""

    def __init__(
        self, cache: SlotCache, ids: Sequence[int], counts: Sequence[int], backends: Backends, chunk_size: int
    ) -> None:
        self.cache, self.backends, self.chunk_size = cache, backends, chunk_size
        device = cache.device
        self.ids_B = torch.as_tensor(list(ids), dtype=torch.int64, device=device)
        self.lengths = cache.lengths[list(ids)].copy()
        self.counts = np.asarray(counts, dtype=np.int64)
        self.num_rows = int(self.counts.sum())
        self.n_max = int(self.counts.max())
        #: one token per sequence: the decode step's specialised paths
        self.is_step = self.n_max == 1
        self.fresh = not self.lengths.any()
        self.slots_T = cache.append(ids, counts)
        pos = np.concatenate([self.lengths[b] + np.arange(c) for b, c in enumerate(self.counts)])
        self.position = torch.as_tensor(pos).to(device)
        self.row_weight = torch.ones(self.num_rows, dtype=torch.float64, device=device)
        self.cu_host = torch.as_tensor(np.concatenate([[0], np.cumsum(self.counts)]), dtype=torch.int64)
        valid = np.arange(self.n_max)[None, :] < self.counts[:, None]
        self.valid_BN = torch.as_tensor(valid).to(device)
        #: keys the attention reads per sequence, and the last one query t of sequence b sees
        #: (it sits at position lengths[b] + t): a mask over valid slots
        self.key_len = int((self.lengths + self.counts).max())
        limit = self.lengths[:, None] + np.arange(self.n_max)[None, :]
        self.limit_BN = torch.as_tensor(limit).to(device)
        self.layer = -1

    def _pad(self, x_T: torch.Tensor) -> torch.Tensor:
        """[T, ...] rows -> [B, n_max, ...], zeros where a sequence has fewer new tokens."""
        if self.is_step:
            return x_T[:, None]
        out = x_T.new_zeros(len(self.counts), self.n_max, *x_T.shape[1:])
        out[self.valid_BN] = x_T
        return out

    def short_conv(
        self, x_TD: torch.Tensor, weight_DW: torch.Tensor, bias_D: torch.Tensor | None, activation: str | None
    ) -> torch.Tensor:
        """[T, C] conv outputs of the new rows, each sequence's conv state [W - 1, C] read from its
        slot and replaced by its last W - 1 inputs, so the next call continues where this one ended."""
        c, w = weight_DW.shape
        conv = self.cache.tensor(self.layer, "conv", (w - 1, c), x_TD.dtype)
        if not self.is_step:
            return self._prefill_conv(conv, x_TD, weight_DW, bias_D, activation)
        full = torch.cat([conv[self.ids_B], x_TD[:, None]], dim=1)  # [B, W, C]
        conv[self.ids_B] = full[:, 1:]
        y = (full * weight_DW.T).sum(1)
        if bias_D is not None:
            y = y + bias_D
        return y if activation is None else F.silu(y)

    def _prefill_conv(self, conv_NWC, x_TD, weight_DW, bias_D, activation):  # type: ignore[no-untyped-def]
        """The conv of many new rows per sequence: each sequence's W-1 cached inputs packed in
        front of its new rows, so a plain varlen conv over the packed rows (fla-core's kernel
        where the model's record runs it) is the conv from the cached state; the last W-1 packed
        rows of each sequence are its new state."""
        from harts.ops.conv import causal_conv1d_varlen, conv_runs_from_offsets, runs_causal_conv1d

        c, w = weight_DW.shape
        b = len(self.counts)
        cu = np.concatenate([[0], np.cumsum(self.counts + w - 1)])
        state_rows = cu[:-1, None] + np.arange(w - 1)  # [B, W-1]
        new_rows = np.concatenate([cu[i] + w - 1 + np.arange(n) for i, n in enumerate(self.counts)])
        index = torch.as_tensor(
            np.concatenate([state_rows.ravel(), new_rows, (cu[1:, None] - w + 1 + np.arange(w - 1)).ravel()])
        )
        index = index.to(x_TD.device)
        state_idx, new_idx, tail_idx = index.split([b * (w - 1), self.num_rows, b * (w - 1)])
        packed = x_TD.new_empty(int(cu[-1]), c)
        packed[state_idx] = conv_NWC[self.ids_B].reshape(-1, c)
        packed[new_idx] = x_TD
        conv_NWC[self.ids_B] = packed[tail_idx].reshape(b, w - 1, c)
        if self.backends.conv == "fla":
            y = runs_causal_conv1d(packed, weight_DW, conv_runs_from_offsets(cu), bias_D, activation)
        else:
            cu_host = torch.as_tensor(cu)
            y = causal_conv1d_varlen(packed, weight_DW, cu_host, bias=bias_D, activation=activation)
        return y[new_idx]

    def linear_attention(
        self,
        q_THK: torch.Tensor,
        k_THK: torch.Tensor,
        v_THV: torch.Tensor,
        g: torch.Tensor,
        beta_TH: torch.Tensor | None,
        *,
        rule: str = "delta",
        scale: float | None = None,
        qkv_gathered: bool = False,
    ) -> torch.Tensor:
        """[T, H, V] outputs of the new rows, each sequence starting from its slot's state
        [H, K, V] and leaving its last state there (``RowContext.linear_attention`` gives the
        inputs' shapes): one recurrent step per sequence at a decoding step, the chunked operator
        over the packed rows at prefill."""
        h, kd, vd = q_THK.shape[1], q_THK.shape[2], v_THV.shape[2]
        scale = kd**-0.5 if scale is None else scale
        state = self.cache.tensor(self.layer, "state", (h, kd, vd), torch.promote_types(q_THK.dtype, torch.float32))
        S0 = state[self.ids_B]
        if self.is_step and q_THK.is_cuda and beta_TH is not None:
            o, S = _fla_step(q_THK, k_THK, v_THV, g, beta_TH, S0, scale)
        elif self.is_step:
            o, S = recurrent_step(q_THK, k_THK, v_THV, g, beta_TH, S0, scale)
        else:
            from harts.ops.linear_attn import linear_attn_op

            op = linear_attn_op(self.backends.linear_attention, q_THK.device, self.chunk_size)
            o, S, _ = op(q_THK, k_THK, v_THV, g, beta_TH, cu_seqlens=self.cu_host, initial_state=S0,
                         chunk_size=self.chunk_size, scale=scale, rule=rule)  # fmt: skip
        state[self.ids_B] = S.to(state.dtype)
        return o.to(v_THV.dtype)

    def attention(self, q_THD: torch.Tensor, k_TGD: torch.Tensor, v_TGE: torch.Tensor, *, scale: float) -> torch.Tensor:
        """[T, H, E] outputs of the new rows: their keys / values [T, G, D / E] written to their KV
        slots, each query reading its sequence's cached keys up to its own position (fresh
        prompts: causal among their own rows, nothing cached)."""
        k_cache = self.cache.tensor(self.layer, "k", k_TGD.shape[1:], k_TGD.dtype)
        v_cache = self.cache.tensor(self.layer, "v", v_TGE.shape[1:], v_TGE.dtype)
        k_cache[self.slots_T] = k_TGD
        v_cache[self.slots_T] = v_TGE
        if self.fresh:  # new prompts: causal among their own rows, nothing cached to read
            from harts.ops.attention import varlen_causal_attention

            cu = self.cu_host.to(q_THD.device)
            return varlen_causal_attention(
                q_THD, k_TGD, v_TGE, cu_seqlens=cu, scale=scale, cu_seqlens_host=self.cu_host.numpy()
            )
        table_BM = self.cache.table_NL[self.ids_B, : self.key_len]
        mask_BNM = torch.arange(self.key_len, device=q_THD.device)[None, None, :] <= self.limit_BN[..., None]
        k_BGMD = k_cache[table_BM].transpose(1, 2)
        v_BGME = v_cache[table_BM].transpose(1, 2)
        h, g = q_THD.shape[1], k_TGD.shape[1]
        if self.is_step:
            # one query per sequence: the r = H/G heads of a kv group stand as r queries of that
            # group (head h reads group h // r), so no kernel expands the keys to H heads
            q_BGrD = q_THD.reshape(-1, g, h // g, q_THD.shape[-1])
            o = F.scaled_dot_product_attention(q_BGrD, k_BGMD, v_BGME, attn_mask=mask_BNM[:, None], scale=scale)
            return o.reshape(-1, h, o.shape[-1])
        o = F.scaled_dot_product_attention(
            self._pad(q_THD).transpose(1, 2),
            k_BGMD,
            v_BGME,
            attn_mask=mask_BNM[:, None],
            scale=scale,
            enable_gqa=g != h,
        )
        return o.transpose(1, 2)[self.valid_BN]
