"""The short conv as packed runs with initial states: fla-core's varlen kernel on tree rows.

A run is a maximal block of consecutive physical rows in which every row's parent is the row
before it. Inside a run the conv window is the plain causal one; at a run's first row the W-1
earlier taps are the row's true ancestors (``Layout.ancestors``), which become the run's
*initial state*. So the tree conv of ``tree_causal_conv1d`` equals a varlen conv over the runs
with initial states

    state[r] = [x[anc_{W-1}(s_r)], ..., x[anc_1(s_r)]]     (s_r the run's first row; -1 reads 0)

and a trajectory-wise batch is the special case of one run per trajectory and no state. The
states' gradient is added into the conv's gradient of x in place (a deterministic ``index_put_``:
a row read by several runs' states, a fork's last W-1 rows, gets each reader's), not through a
zero-filled [P, D] gradient of the gather and a second [P, D] sum (``_StatesFromX``); everything
else is fla-core's ``causal_conv1d`` (Triton; float32 accumulation, rounded once, the activation
fused) forward and backward: its public function without states, its forward and backward
functions (``causal_conv1d_fwd`` / ``_bwd``, what its autograd function calls) with them.

Both sides of a benchmark run this one kernel: trajectory-wise (runs = trajectories, no state)
and compact (runs of the layout, states from ancestors). Per tap the kernel adds ``x`` or the
state's entry in the same order, so a compact row's output equals its trajectory-wise twin's
bit for bit when their inputs do.

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
            rows = zero = None
            if self.state_rows is not None:
                rows = upload(np.maximum(self.state_rows, 0), device)
                zero = upload((self.state_rows < 0)[..., None], device) if (self.state_rows < 0).any() else None
            self._device[key] = DeviceRuns(upload(self.cu_seqlens, device), cu_host, upload(chunks, device), rows, zero)
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
        # the states are rows of x itself: their gradient goes into the conv's dx in place
        return _StatesFromX.apply(x_PD, weight_DW, bias_D, dev, activation, impl)  # type: ignore[no-any-return]
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
    return y[0]


def _gather_states(x_PD: torch.Tensor, dev: DeviceRuns) -> torch.Tensor:
    """[R, W-1, D] states, oldest first, read from x's rows (entries before a root read zero)."""
    assert dev.state_rows is not None
    states = x_PD[dev.state_rows]
    return states.masked_fill(dev.state_zero, 0) if dev.state_zero is not None else states


def _fla_state(states_RWD: torch.Tensor) -> torch.Tensor:
    """fla's initial state [R, D, W]: entry W-1 is the row just before the run; entry 0 is never read."""
    return F.pad(states_RWD.transpose(1, 2), (1, 0)).contiguous()


class _StatesFromX(torch.autograd.Function):
    """The conv over runs whose initial states are rows of its own input x.

    Left to autograd, the states' gather ``x[state_rows]`` gets a gradient of its own: a
    zero-filled [P, D] tensor with the states' few rows scattered in, then added to the conv's
    [P, D] gradient of x (two full passes over [P, D] per layer, for a few dozen rows). Here the
    conv's backward (fla-core's, or the reference recomputed) returns the gradient of x and of the
    states, and the states' rows are added into the first in place (``index_put_``, accumulating:
    deterministic, a row read by several runs' states gets each reader's gradient)."""

    @staticmethod
    def forward(ctx, x_PD, weight_DW, bias_D, dev, activation, impl):  # type: ignore[no-untyped-def, override]
        states = _gather_states(x_PD, dev)
        if impl == "reference":
            y = _reference(x_PD, weight_DW, dev.cu_seqlens_host.tolist(), states, bias_D, activation)
            saved = states
        else:
            from fla.modules.causal_conv1d.ops import causal_conv1d_fwd

            x_PD = x_PD.contiguous()
            saved = _fla_state(states)
            y, _ = causal_conv1d_fwd(
                x=x_PD[None],
                weight=weight_DW.contiguous(),
                bias=bias_D,
                residual=None,
                initial_state=saved,
                output_final_state=False,
                activation=activation,
                cu_seqlens=dev.cu_seqlens,
                cu_seqlens_cpu=dev.cu_seqlens_host,
                chunk_indices=dev.chunk_indices,
                chunk_size=FLA_CONV_CHUNK,
            )
            y = y[0]
        ctx.save_for_backward(x_PD, weight_DW, bias_D, saved)
        ctx.dev, ctx.activation, ctx.impl = dev, activation, impl
        return y

    @staticmethod
    def backward(ctx, dy_PD):  # type: ignore[no-untyped-def, override]
        x_PD, weight_DW, bias_D, saved = ctx.saved_tensors
        dev = ctx.dev
        if ctx.impl == "reference":
            with torch.enable_grad():
                leaves = [t.detach().requires_grad_(True) for t in (x_PD, weight_DW, saved)]
                b = None if bias_D is None else bias_D.detach().requires_grad_(True)
                y = _reference(leaves[0], leaves[1], dev.cu_seqlens_host.tolist(), leaves[2], b, ctx.activation)
                grads = torch.autograd.grad(y, [*leaves, *([] if b is None else [b])], dy_PD)
            dx, dw, dstates = grads[:3]
            db = grads[3] if b is not None else None
        else:
            from fla.modules.causal_conv1d.ops import causal_conv1d_bwd

            dx, dw, db, _, dh0 = causal_conv1d_bwd(
                x=x_PD[None],
                dy=dy_PD.contiguous()[None],
                dht=None,
                weight=weight_DW.contiguous(),
                bias=bias_D,
                residual=None,
                initial_state=saved,
                activation=ctx.activation,
                cu_seqlens=dev.cu_seqlens,
                cu_seqlens_cpu=dev.cu_seqlens_host,
                chunk_indices=dev.chunk_indices,
                chunk_size=FLA_CONV_CHUNK,
            )
            dx = dx.reshape(x_PD.shape)
            dstates = dh0[:, :, 1:].transpose(1, 2)  # [R, W-1, D], oldest first
        if dev.state_zero is not None:  # entries before a root read no row
            dstates = dstates.masked_fill(dev.state_zero, 0)
        d = x_PD.shape[1]
        dx.index_put_((dev.state_rows.reshape(-1),), dstates.reshape(-1, d).to(dx.dtype), accumulate=True)
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


def conv_uses_fla(la_backend: str, device: torch.device) -> bool:
    """Whether executors run the short conv through fla-core (``runs_causal_conv1d``): with any
    linear-attention backend but "reference" (which keeps every op the torch reference), on CUDA
    with fla-core installed."""
    if la_backend == "reference" or device.type != "cuda":
        return False
    from harts.ops.linear_attn.fla import fla_available

    return fla_available()
