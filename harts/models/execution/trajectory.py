"""Trajectory-wise execution (the baseline and oracle): every trajectory is its own sequence.

Rows are the S semantic positions in original batch order; trajectory j owns rows
``[offsets[j], offsets[j+1])``. Linear attention runs one packed call with cu_seqlens over
trajectories and zero initial states; the short conv is a plain causal per-sequence op.
Attention is causal within each trajectory: one call per trajectory (``attention="gather"``),
or one call over all S rows under the document-causal mask (``"mask"``): the tree mask of a
forest of chains, with preorder = row index and each row's subtree ending at its
trajectory's end (FlexAttention on CUDA). Nothing here uses compaction, a call plan or a Layout.

Shapes: cu_seqlens int64 [N + 1]; position int64 [S]; row_weight [S] (all ones);
chain_end int64 [S] (end row of each row's trajectory).
"""

from __future__ import annotations

import numpy as np
import torch

from harts.models.execution.backends import Backends
from harts.models.execution.base import RowContext
from harts.ops.conv import conv_runs_from_offsets
from harts.ops.upload import upload
from harts.tree.batch import RolloutBatch

__all__ = ["TrajectoryContext"]


class TrajectoryContext(RowContext):
    def __init__(
        self,
        batch: RolloutBatch,
        chunk_size: int,
        device: torch.device,
        backends: Backends = Backends(),  # noqa: B008 - frozen
    ) -> None:
        from harts.ops.linear_attn import linear_attn_op

        self.backends = backends
        attention = backends.attention
        # linking rounds is the compact executor's part: trajectory-wise every tree op is per call
        self.la_op = linear_attn_op(backends.linear_attention, device, chunk_size)
        offsets = batch.offsets
        self.num_rows = batch.num_tokens
        self.chunk_size = chunk_size
        self.cu_seqlens = upload(offsets, device, torch.int64)
        self.cu_seqlens_host = torch.as_tensor(offsets, dtype=torch.int64)  # for the LA op: no device sync
        pos = np.arange(batch.num_tokens) - np.repeat(offsets[:-1], batch.lengths)
        self.position = upload(pos, device, torch.int64)
        self.row_weight = torch.ones(batch.num_tokens, dtype=torch.float64, device=device)
        # the record's conv, which follows the resolved linear-attention operator
        self.conv_fla = backends.conv == "fla"
        self.conv_runs = conv_runs_from_offsets(offsets) if self.conv_fla else None
        if attention not in ("gather", "mask"):
            raise ValueError(f"attention must be 'gather' or 'mask', got {attention!r}")
        self.attention_impl = attention
        self._mask_cache: dict = {}  # one FlexAttention BlockMask for every layer of this batch
        if attention == "mask":
            # host copies too: the FlexAttention BlockMask is built from them on the host
            self.chain_pre_host = np.arange(batch.num_tokens, dtype=np.int64)
            self.chain_end_host = np.repeat(offsets[1:], batch.lengths).astype(np.int64)
            self.chain_pre = torch.arange(batch.num_tokens, dtype=torch.int64, device=device)
            self.chain_end = upload(self.chain_end_host, device)

    def short_conv(self, x_TD, weight_DW, bias_D, activation):  # type: ignore[override]
        from harts.ops.conv import causal_conv1d_varlen, runs_causal_conv1d

        if self.conv_runs is not None:  # fla-core's kernel, one run per trajectory
            return runs_causal_conv1d(x_TD, weight_DW, self.conv_runs, bias_D, activation)
        # host boundaries: checking them costs the device no synchronization
        return causal_conv1d_varlen(x_TD, weight_DW, self.cu_seqlens_host, bias=bias_D, activation=activation)

    def linear_attention(self, q_THK, k_THK, v_THV, g, beta_TH, *, rule="delta", scale=None, qkv_gathered=False):  # type: ignore[override]
        # la_input_rows is None here: q / k / v are never handed over gathered
        o, _, _ = self.la_op(
            q_THK,
            k_THK,
            v_THV,
            g,
            beta_TH,
            cu_seqlens=self.cu_seqlens_host,
            chunk_size=self.chunk_size,
            scale=scale,
            rule=rule,
        )
        return o

    def attention(self, q_THD, k_TGD, v_TGE, *, scale):  # type: ignore[override]
        from harts.ops.attention import tree_mask_attention, varlen_causal_attention

        if self.attention_impl == "mask":
            return tree_mask_attention(
                q_THD,
                k_TGD,
                v_TGE,
                tree_pre=self.chain_pre,
                tree_end=self.chain_end,
                scale=scale,
                mask_cache=self._mask_cache,
                tree_pre_host=self.chain_pre_host,
                tree_end_host=self.chain_end_host,
                backend=self.backends.flex_backend(q_THD, k_TGD, v_TGE),
            )
        return varlen_causal_attention(
            q_THD, k_TGD, v_TGE, cu_seqlens=self.cu_seqlens, scale=scale, cu_seqlens_host=self.cu_seqlens_host
        )
