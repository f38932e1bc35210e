"""The short conv as packed runs with initial states: fla-core's varlen kernel on tree rows.

A run is a maximal block of consecutive physical rows in which every row's parent is the row
before it. Inside a run the conv window is the plain causal one; at a run's first row the W-1
earlier taps are the row's true ancestors (``Layout.ancestors``), which become the run's
*initial state*. So the tree conv of ``tree_causal_conv1d`` equals a varlen conv over the runs
with initial states

    state[r] = [x[anc_{W-1}(s_r)], ..., x[anc_1(s_r)]]     (s_r the run's first row; -1 reads 0)

and a trajectory-wise batch is the special case of one run per trajectory and no state.

On CUDA (``impl="fla"``) only fla-core's kernel *without* states runs, because its variant with
states is slower on every row, not only on the few that read a state (``benchmarks.ops.kernel_sweep``
times both on a ``swe`` microbatch: ``benchmarks/results/ling3-tiny_h200_2026-12-02_conv-no-state.md``).
Instead (``_HeadFixup``):

* forward: the no-state kernel over the runs, then each stated run's first W-1 rows (its
  *head*) recomputed by the same kernel over a *mini-sequence* of the run's ancestors followed by
  its head (a few rows per run), and written over the main output. Per tap the kernel adds the
  same rows in the same order, so every row's output equals its trajectory-wise twin's bit for
  bit when their inputs do;
* backward: the no-state kernel's backward over the runs with the heads' output gradients
  zeroed (in place, restored after), plus the mini-sequences' backward with only the heads'
  gradients, added into dx at the rows they read (a deterministic ``index_put_``: a row read by
  several runs' states, a fork's last W-1 rows, gets each reader's), dw and db.

``impl="reference"`` runs one ``F.conv1d`` per run with its state prepended (any device, float64
tests), and ``_HeadFixup`` runs with a torch no-state conv in the CPU tests as well.

Shapes: P rows, D channels, W kernel width, R runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from harts.ops.fla_index import fla_chunk_indices
from harts.ops.upload import upload

#: rows per chunk of fla-core's causal_conv1d (its Triton path always uses its default, 64)
FLA_CONV_CHUNK = 64

__all__ = [
    "ConvRuns",
    "DeviceRuns",
    "conv_runs_from_ancestors",
    "conv_runs_from_offsets",
    "conv_uses_fla",
    "runs_causal_conv1d",
]


@dataclass(frozen=True)
class ConvRuns:
    """Runs of a layout's physical rows (host arrays; device copies made once per device)."""

    #: int64 [R + 1] run boundaries (0 .. P)
    cu_seqlens: np.ndarray
    #: int64 [R, W-1] physical rows of each run's state, oldest first, -1 reads zero; None: no
    #: run has a state (trajectory-wise rows)
    state_rows: np.ndarray | None
    _device: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_runs(self) -> int:
        return int(self.cu_seqlens.size - 1)

    def on(self, device: torch.device) -> DeviceRuns:
        """The runs' index tensors on ``device`` (made once per device). Every upload is
        non-blocking: a synchronous one would first wait for the device's queue."""
        key = str(device)
        if key not in self._device:
            cu_host = torch.as_tensor(self.cu_seqlens, dtype=torch.int64)
            _, chunks = fla_chunk_indices(np.diff(self.cu_seqlens), FLA_CONV_CHUNK)
            rows = zero = heads = None
            if self.state_rows is not None:
                rows = upload(np.maximum(self.state_rows, 0), device)
                zero = upload((self.state_rows < 0)[..., None], device) if (self.state_rows < 0).any() else None
                head, pos, mini, bounds = head_fixup_rows(self.cu_seqlens, self.state_rows)
                _, mini_chunks = fla_chunk_indices(np.diff(bounds), FLA_CONV_CHUNK)
                heads = HeadFixup(
                    upload(head, device),
                    upload(pos, device),
                    upload(mini, device),
                    upload(bounds, device),
                    torch.as_tensor(bounds),
                    upload(mini_chunks, device),
                )
            self._device[key] = DeviceRuns(
                upload(self.cu_seqlens, device), cu_host, upload(chunks, device), rows, zero, heads
            )
        return self._device[key]  # type: ignore[no-any-return]


class DeviceRuns(NamedTuple):
    """``ConvRuns.on``: the runs' index tensors on one device."""

    #: int64 [R + 1] run boundaries on the device, and the same on the host
    cu_seqlens: torch.Tensor
    cu_seqlens_host: torch.Tensor
    #: int64 [NT, 2] fla's chunk index of the runs (chunks of ``FLA_CONV_CHUNK`` rows)
    chunk_indices: torch.Tensor
    #: int64 [R, W-1] rows of each run's state, oldest first (-1 read as row 0), or None
    state_rows: torch.Tensor | None
    #: bool [R, W-1, 1] state entries that read zero (a row before the root), or None if none do
    state_zero: torch.Tensor | None
    #: the stated runs' heads and mini-sequences (``HeadFixup``), or None without states
    heads: HeadFixup | None = None


class HeadFixup(NamedTuple):
    """Each stated run's head (first min(W-1, length) rows) and its mini-sequence: the run's
    ancestors that exist (oldest first) followed by its head. F head rows, M mini rows, S
    mini-sequences (one per run with at least one ancestor)."""

    #: int64 [F] physical rows of the heads (device)
    rows: torch.Tensor
    #: int64 [F] positions of the head rows within the mini rows (device)
    positions: torch.Tensor
    #: int64 [M] physical rows of the mini-sequences, packed (device)
    mini_rows: torch.Tensor
    #: int64 [S + 1] mini-sequence boundaries (device and host) and fla's chunk index (device)
    cu_seqlens: torch.Tensor
    cu_seqlens_host: torch.Tensor
    chunk_indices: torch.Tensor


def head_fixup_rows(
    cu_seqlens: np.ndarray, state_rows: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Host arrays of ``HeadFixup``: (head rows [F], their positions in the mini rows [F], mini
    rows [M], mini-sequence boundaries [S + 1]) of runs ``cu_seqlens`` [R + 1] with states
    ``state_rows`` [R, W-1] (oldest first, -1: before the root; the ones that exist are the
    newest). A run with no ancestor (a root's) needs no fix-up and has no mini-sequence."""
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    st = np.asarray(state_rows, dtype=np.int64)
    heads, positions, mini, bounds = [], [], [], [0]
    for r in np.flatnonzero((st >= 0).any(1)):
        anc = st[r][st[r] >= 0]
        head = np.arange(cu[r], min(cu[r + 1], cu[r] + st.shape[1]), dtype=np.int64)
        positions.append(bounds[-1] + anc.size + np.arange(head.size, dtype=np.int64))
        heads.append(head)
        mini += [anc, head]
        bounds.append(bounds[-1] + anc.size + head.size)
    cat = lambda xs: np.concatenate(xs) if xs else np.zeros(0, dtype=np.int64)  # noqa: E731
    return cat(heads), cat(positions), cat(mini), np.asarray(bounds, dtype=np.int64)


def conv_runs_from_offsets(offsets: np.ndarray) -> ConvRuns:
    """Trajectory-wise rows: one run per trajectory (``offsets`` int [N + 1]), no states."""
    offsets = np.asarray(offsets, dtype=np.int64)
    lengths = np.diff(offsets)
    if offsets.ndim != 1 or offsets.size < 1 or offsets[0] != 0 or (lengths < 0).any():
        raise ValueError(f"offsets must rise from 0; got {offsets[:8].tolist()}...")
    return ConvRuns(cu_seqlens=offsets[np.r_[True, lengths > 0]], state_rows=None)


def conv_runs_from_ancestors(ancestors_PW1: np.ndarray) -> ConvRuns:
    """Runs and states of rows whose ancestors ``ancestors_PW1`` (int [P, W-1], column d-1 the
    d-th ancestor or -1) follow parent chains, as ``Layout.ancestors`` builds them.

    Raises ValueError naming the first row whose ancestors are not its parent's shifted by one
    (then the rows are not a tree and no run decomposition exists).
    """
    anc = np.asarray(ancestors_PW1, dtype=np.int64)
    if anc.ndim != 2:
        raise ValueError(f"ancestors must be [P, W-1]; got shape {anc.shape}")
    p, k = anc.shape
    if k == 0:
        return ConvRuns(cu_seqlens=np.array([0, p], dtype=np.int64)[: 2 if p else 1], state_rows=None)
    rows = np.arange(p)
    start = anc[:, 0] != rows - 1
    start[:1] = True
    # a chain: the d-th ancestor of row i is the (d-1)-th of its parent (checked where the
    # parent is the previous row, i.e. inside runs; run starts carry their ancestors as state)
    inner = np.flatnonzero(~start)
    if k > 1 and inner.size:
        bad = inner[(anc[inner, 1:] != anc[inner - 1, :-1]).any(1)]
        if bad.size:
            i = int(bad[0])
            raise ValueError(
                f"row {i}'s ancestors {anc[i].tolist()} are not its parent row {i - 1}'s "
                f"{anc[i - 1].tolist()} shifted by one: not parent chains"
            )
    starts = np.flatnonzero(start)
    cu = np.append(starts, p).astype(np.int64)
    return ConvRuns(cu_seqlens=cu, state_rows=np.ascontiguousarray(anc[starts, ::-1]))


def runs_causal_conv1d(
    x_PD: torch.Tensor,
    weight_DW: torch.Tensor,
    runs: ConvRuns,
    bias_D: torch.Tensor | None = None,
    activation: str | None = "silu",
    *,
    impl: str = "fla",
) -> torch.Tensor:
    """The causal depthwise conv over ``runs`` (module docstring): [P, D] -> [P, D].

    Args:
        x_PD: [P, D] rows; weight_DW: [D, W] (column W-1 multiplies the row itself); bias_D: [D].
        runs: from ``conv_runs_from_ancestors`` / ``conv_runs_from_offsets`` over these P rows.
        activation: None, "silu" or "swish".
        impl: "fla" (fla-core's Triton kernel; CUDA) or "reference" (one ``F.conv1d`` per run
            with its state prepended: slow, any device; what the CPU tests compare against).
    """
    P, D = x_PD.shape
    W = weight_DW.shape[-1]
    if int(runs.cu_seqlens[-1]) != P:
        raise ValueError(f"runs cover {int(runs.cu_seqlens[-1])} rows; x has {P}")
    if runs.state_rows is not None and runs.state_rows.shape[1] != W - 1:
        raise ValueError(f"runs carry states of {runs.state_rows.shape[1]} rows; the kernel width {W} needs {W - 1}")
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"activation must be None, 'silu' or 'swish'; got {activation!r}")
    if P == 0:
        return x_PD.new_zeros(0, D)
    if impl not in ("fla", "reference"):
        raise ValueError(f"impl must be 'fla' or 'reference'; got {impl!r}")
    dev = runs.on(x_PD.device)
    if dev.state_rows is not None:
        if impl == "fla":  # the no-state kernel and the heads' mini-sequences (module docstring)
            return _HeadFixup.apply(x_PD, weight_DW, bias_D, dev, activation, _FlaNoState)  # type: ignore[no-any-return]
        # the states are rows of x itself: their gradient goes into the conv's dx in place
        y = _StatesFromX.apply(x_PD, weight_DW, bias_D, dev)
        return y if activation is None else F.silu(y)
    if impl == "reference":
        return _reference(x_PD, weight_DW, dev.cu_seqlens_host.tolist(), None, bias_D, activation)
    from fla.modules.causal_conv1d import causal_conv1d

    y, _ = causal_conv1d(
        x_PD[None],
        weight_DW,
        bias_D,
        activation=activation,
        cu_seqlens=dev.cu_seqlens,
        cu_seqlens_cpu=dev.cu_seqlens_host,
        # built on the host: left to fla, it would be uploaded synchronously (a device sync)
        chunk_indices=dev.chunk_indices,
    )
    # a view whose backward is a view: ``y[0]``'s backward (select) zero-fills a [1, P, D]
    # gradient and copies into it, two full passes over the conv's output gradient
    return y.squeeze(0)


def _gather_states(x_PD: torch.Tensor, dev: DeviceRuns) -> torch.Tensor:
    """[R, W-1, D] states, oldest first, read from x's rows (entries before a root read zero)."""
    assert dev.state_rows is not None
    states = x_PD[dev.state_rows]
    return states.masked_fill(dev.state_zero, 0) if dev.state_zero is not None else states


class _StatesFromX(torch.autograd.Function):
    """The reference conv over runs whose initial states are rows of its own input x.

    Left to autograd, the states' gather ``x[state_rows]`` gets a gradient of its own: a
    zero-filled [P, D] tensor with the states' few rows scattered in, then added to the conv's
    [P, D] gradient of x. Here the backward (the reference recomputed) returns the gradient of x
    and of the states, and the states' rows are added into the first in place (``index_put_``,
    accumulating: deterministic, a row read by several runs' states gets each reader's)."""

    @staticmethod
    def forward(ctx, x_PD, weight_DW, bias_D, dev):  # type: ignore[no-untyped-def, override]
        states = _gather_states(x_PD, dev)
        y = _reference(x_PD, weight_DW, dev.cu_seqlens_host.tolist(), states, bias_D, None)
        ctx.save_for_backward(x_PD, weight_DW, bias_D, states)
        ctx.dev = dev
        return y

    @staticmethod
    def backward(ctx, dy_PD):  # type: ignore[no-untyped-def, override]
        x_PD, weight_DW, bias_D, states = ctx.saved_tensors
        dev = ctx.dev
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(True) for t in (x_PD, weight_DW, states)]
            b = None if bias_D is None else bias_D.detach().requires_grad_(True)
            y = _reference(leaves[0], leaves[1], dev.cu_seqlens_host.tolist(), leaves[2], b, None)
            grads = torch.autograd.grad(y, [*leaves, *([] if b is None else [b])], dy_PD)
        dx, dw, dstates = grads[:3]
        db = grads[3] if b is not None else None
        if dev.state_zero is not None:  # entries before a root read no row
            dstates = dstates.masked_fill(dev.state_zero, 0)
        d = x_PD.shape[1]
        dx.index_put_((dev.state_rows.reshape(-1),), dstates.reshape(-1, d).to(dx.dtype), accumulate=True)
        return dx, dw, db, None


class _FlaNoState:
    """fla-core's conv kernel without states over packed runs (CUDA): forward and backward
    (``causal_conv1d_fwd`` / ``_bwd``, what its autograd function calls). [P, D] rows."""

    @staticmethod
    def fwd(x_PD, weight_DW, bias_D, cu, cu_host, chunks, activation) -> torch.Tensor:  # noqa: ANN001
        from fla.modules.causal_conv1d.ops import causal_conv1d_fwd

        y, _ = causal_conv1d_fwd(
            x=x_PD[None],
            weight=weight_DW,
            bias=bias_D,
            residual=None,
            initial_state=None,
            output_final_state=False,
            activation=activation,
            cu_seqlens=cu,
            cu_seqlens_cpu=cu_host,
            chunk_indices=chunks,
            chunk_size=FLA_CONV_CHUNK,
        )
        return y[0]  # type: ignore[no-any-return]

    @staticmethod
    def bwd(x_PD, dy_PD, weight_DW, bias_D, cu, cu_host, chunks, activation):  # noqa: ANN001, ANN205
        from fla.modules.causal_conv1d.ops import causal_conv1d_bwd

        dx, dw, db, _, _ = causal_conv1d_bwd(
            x=x_PD[None],
            dy=dy_PD[None],
            dht=None,
            weight=weight_DW,
            bias=bias_D,
            residual=None,
            initial_state=None,
            activation=activation,
            cu_seqlens=cu,
            cu_seqlens_cpu=cu_host,
            chunk_indices=chunks,
            chunk_size=FLA_CONV_CHUNK,
        )
        return dx.reshape(x_PD.shape), dw, db


class _TorchNoState:
    """``_FlaNoState``'s contract in torch (one ``F.conv1d`` per run, autograd for the backward):
    what the CPU tests run ``_HeadFixup`` with."""

    @staticmethod
    def fwd(x_PD, weight_DW, bias_D, cu, cu_host, chunks, activation) -> torch.Tensor:  # noqa: ANN001, ARG004
        return _reference(x_PD, weight_DW, cu_host.tolist(), None, bias_D, activation)

    @staticmethod
    def bwd(x_PD, dy_PD, weight_DW, bias_D, cu, cu_host, chunks, activation):  # noqa: ANN001, ANN205, ARG004
        with torch.enable_grad():
            x, w = (t.detach().requires_grad_(True) for t in (x_PD, weight_DW))
            b = None if bias_D is None else bias_D.detach().requires_grad_(True)
            y = _reference(x, w, cu_host.tolist(), None, b, activation)
            grads = torch.autograd.grad(y, [x, w, *([] if b is None else [b])], dy_PD)
        return grads[0], grads[1], grads[2] if b is not None else None


class _HeadFixup(torch.autograd.Function):
    """The conv over runs with states as the no-state kernel plus the heads' mini-sequences
    (module docstring). ``kernels``: ``_FlaNoState`` (CUDA) or ``_TorchNoState``."""

    @staticmethod
    def forward(ctx, x_PD, weight_DW, bias_D, dev, activation, kernels):  # type: ignore[no-untyped-def, override]
        hf = dev.heads
        x_PD, weight_DW = x_PD.contiguous(), weight_DW.contiguous()
        y = kernels.fwd(x_PD, weight_DW, bias_D, dev.cu_seqlens, dev.cu_seqlens_host, dev.chunk_indices, activation)
        x_mini = x_PD.index_select(0, hf.mini_rows)
        if hf.rows.numel():
            y_mini = kernels.fwd(
                x_mini, weight_DW, bias_D, hf.cu_seqlens, hf.cu_seqlens_host, hf.chunk_indices, activation
            )
            y.index_copy_(0, hf.rows, y_mini.index_select(0, hf.positions))
        ctx.save_for_backward(x_PD, weight_DW, bias_D, x_mini)
        ctx.dev, ctx.activation, ctx.kernels = dev, activation, kernels
        return y

    @staticmethod
    def backward(ctx, dy_PD):  # type: ignore[no-untyped-def, override]
        x_PD, weight_DW, bias_D, x_mini = ctx.saved_tensors
        dev, act, kernels = ctx.dev, ctx.activation, ctx.kernels
        hf = dev.heads
        dy = dy_PD.contiguous()
        # the heads' outputs came from the mini-sequences: their gradients leave the main
        # backward (zeroed in place, restored below: no [P, D] copy of dy) for the mini one
        dy_heads = dy.index_select(0, hf.rows)
        dy.index_fill_(0, hf.rows, 0)
        dx, dw, db = kernels.bwd(
            x_PD, dy, weight_DW, bias_D, dev.cu_seqlens, dev.cu_seqlens_host, dev.chunk_indices, act
        )
        dy.index_copy_(0, hf.rows, dy_heads)
        if hf.rows.numel():
            dy_mini = dy_heads.new_zeros(x_mini.shape).index_copy_(0, hf.positions, dy_heads)
            dxm, dwm, dbm = kernels.bwd(
                x_mini, dy_mini, weight_DW, bias_D, hf.cu_seqlens, hf.cu_seqlens_host, hf.chunk_indices, act
            )
            dx.index_put_((hf.mini_rows,), dxm.to(dx.dtype), accumulate=True)
            dw = dw + dwm
            db = None if db is None else db + dbm
        return dx, dw, db, None, None, None


def _reference(x_PD, weight_DW, bounds: list[int], states, bias_D, activation) -> torch.Tensor:  # noqa: ANN001
    D, W = weight_DW.shape
    outs = []
    for r, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        before = states[r] if states is not None else x_PD.new_zeros(W - 1, D)
        seq = torch.cat([before, x_PD[a:b]]).T[None]  # [1, D, W-1 + L]
        outs.append(F.conv1d(seq, weight_DW[:, None, :], bias_D, groups=D)[0].T)
    y = torch.cat(outs) if outs else x_PD.new_zeros(0, D)
    return y if activation is None else F.silu(y)


def conv_uses_fla(linear_attn: str, device: torch.device) -> bool:
    """Whether executors run the short conv through fla-core (``runs_causal_conv1d``): beside a
    resolved linear-attention operator other than "reference" (which keeps every op the torch
    reference), on CUDA with fla-core installed.

    ``linear_attn`` is ``resolve_linear_attn_backend``'s answer ("reference", "fla" or "tree"):
    "auto" names no operator until the chunk size is known (on CUDA at chunk size 8 it runs the
    reference), so it is a ValueError here, as any other name is."""
    if linear_attn not in ("reference", "fla", "tree"):
        raise ValueError(
            f"conv_uses_fla takes a resolved linear-attention operator (reference, fla, tree); got {linear_attn!r}"
        )
    if linear_attn == "reference" or device.type != "cuda":
        return False
    from harts.ops.linear_attn.fla import fla_available

    return fla_available()
