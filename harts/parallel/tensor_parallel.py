"""Tensor parallelism with sequence parallelism (Megatron-style) over the ``tp`` mesh dimension.

    state = init_parallel(ParallelConfig(tp=2), device, num_experts)
    model = parallelize(model, state)   # apply_row_split, apply_tensor_parallel, EP, FSDP2

Between the blocks every rank of a ``tp`` group holds ``1/tp`` of its rows (sequence
parallelism: embedding, norms, residuals, router and routed experts on those rows; the row
split, the head and the MoE statistics are ``context_parallel.py``'s, whose row group is
``cp x tp``). Around every token mixer, every dense MLP and every MoE's shared experts:

    x  [P_r, D]  --all-gather rows over tp-->  [tp P_r, D]     (backward: reduce-scatter, a sum)
    column-parallel projections: this rank's heads / columns; the block's per-head work on them
    row-parallel output projection: partial sums [tp P_r, D]
         --reduce-scatter rows over tp-->  [P_r, D]             (backward: all-gather)

Column-parallel (``ShardColumns``): the weight's output features split in ``tp`` contiguous
blocks, which are whole heads because every projection here lays its outputs out head by head
(GDN's ``in_proj_qkvz`` / ``in_proj_ba`` key-head group by group). Row-parallel
(``ShardRows``): the input features split likewise. The shards are DTensors on
``ParallelState.tp_mesh`` ([world / tp, tp], placements ``[Replicate(), Shard(d)]``), so state
dicts and DCP checkpoints keep the one-process names and shapes. The per-head vectors of KDA
and GDN (``A_log``, ``dt_bias``) are split the same way (``ShardHeadVectors``). The mixers' head
counts are set to this rank's (``num_heads`` ...), so their reshapes see local heads.

The projections compute on the local shard (``weight.to_local()``), not in DTensor's
semantics. torch's ``ColwiseParallel`` all-reduces the gradient of each projection's input
over the group; that gradient is then complete on every rank. Inside a mixer, replicated
parameters sit upstream of sharded projections (MLA's ``q_a_proj`` and latent norms, KDA's
low-rank gate input) as well as beside them (per-head norms, the conv). With torch's styles,
the gradients of the first kind would be complete and those of the second kind partial, and
no one reduction is right for both. Here every gradient inside a block is this rank's heads'
share. The one sum is the reduce-scatter of the input gather's backward, and the replicated
parameters' shares are summed by FSDP2 over all ranks like every other partial gradient. The
sharded parameters' gradients are complete per shard and are summed over the ranks holding
that shard (``finish_gradients``). So every parameter gets exactly its one-process gradient.

The short conv's weight stays whole (replicated). Its channels are (q, k, v) blocks, each
split over tp, so a rank's channels are not one contiguous block. The row context picks this
rank's rows of the weight (``UlyssesContext.conv_blocks``, set by a hook before each mixer).
The fast paths that concatenate whole weights (``stacked_qkv``, ``stacked_gates``) are off under
tensor parallelism; the separate projections compute the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

# the autograd forms exist since torch 2.4 (the *_single ones are newer than the GPU image's 2.11)
from torch.distributed._functional_collectives import all_gather_tensor_autograd, reduce_scatter_tensor_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from harts.errors import UserError
from harts.models.config import HybridConfig
from harts.models.hybrid_lm import DecoderLayer, HybridLM
from harts.models.layers import MLP, MoE
from harts.models.layers.registry import mixer_specs
from harts.models.layers.spec import MixerSpec
from harts.parallel.mesh import ParallelState

__all__ = [
    "ShardColumns",
    "ShardHeadVectors",
    "ShardRows",
    "apply_tensor_parallel",
    "check_tensor_parallel",
    "tensor_parallel_parameters",
]


def _shard(t: torch.Tensor, mesh: DeviceMesh, dim: int) -> nn.Parameter:
    """This rank's ``dim``-block of ``t`` as a DTensor parameter ``[Replicate(), Shard(dim)]``."""
    tp, rank = mesh.size(1), mesh.get_local_rank(1)
    n = t.shape[dim] // tp
    local = t.detach().narrow(dim, rank * n, n).clone()
    return nn.Parameter(DTensor.from_local(local, mesh, [Replicate(), Shard(dim)], run_check=False))


class _LocalLinear(nn.Linear):
    """A bias-free linear whose weight is a tensor-parallel shard: it computes on the local block."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.to_local())  # type: ignore[attr-defined]


class _ShardLinear(ParallelStyle):
    """A bias-free ``nn.Linear`` whose weight is split in tp blocks along ``weight_dim``, local compute."""

    weight_dim = 0

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        assert type(module) is nn.Linear and module.bias is None, module
        module.weight = _shard(module.weight, device_mesh, self.weight_dim)
        module.__class__ = _LocalLinear
        return module


class ShardColumns(_ShardLinear):
    """Column-parallel ``nn.Linear``: output features split in tp blocks, local compute."""

    weight_dim = 0


class ShardRows(_ShardLinear):
    """Row-parallel ``nn.Linear``: input features split in tp blocks; outputs are partial sums."""

    weight_dim = 1


def _local_view(name: str) -> property:
    def get(self: nn.Module) -> torch.Tensor:
        return self._parameters[name].to_local()  # type: ignore[union-attr]

    return property(get)


class ShardHeadVectors(ParallelStyle):
    """A mixer's per-head parameter vectors (``names``) split in tp blocks along dim 0; the
    module reads them through properties that return the local block (the parameters keep
    their names: ``named_parameters`` and state dicts are unchanged)."""

    def __init__(self, names: Sequence[str]) -> None:
        self.names = tuple(names)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name in self.names:
            module._parameters[name] = _shard(module._parameters[name], device_mesh, 0)  # type: ignore[arg-type]
        cls = type(module)
        module.__class__ = type(f"TensorParallel{cls.__name__}", (cls,), {n: _local_view(n) for n in self.names})
        module._tp_sharded = self.names  # type: ignore[assignment]
        return module


# ---------------------------------------------------------------------------------- row gathers
def _gather_rows(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    out = all_gather_tensor_autograd(x.contiguous(), 0, group)
    return out.wait() if hasattr(out, "wait") else out


def _scatter_rows(y: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    out = reduce_scatter_tensor_autograd(y.contiguous(), "sum", 0, group)
    return out.wait() if hasattr(out, "wait") else out


def _hook_rows(module: nn.Module, group: dist.ProcessGroup, conv_blocks: tuple[int, ...] | None = None) -> None:
    """Gather ``module``'s first input's rows over tp before it runs (and set its conv channel
    blocks on the row context, its second input), reduce-scatter its output's rows after."""

    def before(m: nn.Module, args: tuple) -> tuple:
        if conv_blocks is not None:
            args[1].conv_blocks = conv_blocks
        return (_gather_rows(args[0], group), *args[1:])

    def after(m: nn.Module, args: tuple, out: Any) -> torch.Tensor:  # noqa: ANN401
        return _scatter_rows(out, group)

    module.register_forward_pre_hook(before)
    module.register_forward_hook(after)


# ---------------------------------------------------------------------------------- the plan
def _mixer_plan(mixer: nn.Module, spec: MixerSpec, tp: int) -> tuple[dict[str, ParallelStyle], tuple[int, ...] | None]:
    """The styles of one token mixer's submodules (relative names; "" is the mixer itself) and
    its conv channel blocks, from its spec's declared plan (``MixerSpec.tp_plan``, which sets
    the mixer's head counts to one rank's)."""
    assert spec.tp_plan is not None  # check_tensor_parallel refused the others
    declared, blocks = spec.tp_plan(mixer, tp)
    styles: dict[str, ParallelStyle] = {}
    for name, style in declared.items():
        if style == "columns":
            styles[name] = ShardColumns()
        elif style == "rows":
            styles[name] = ShardRows()
        else:
            assert isinstance(style, tuple) and style[0] == "heads", style
            names = style[1]
            styles[name] = ShardHeadVectors(names)
    return styles, blocks


_MLP_PLAN: dict[str, ParallelStyle] = {"gate_proj": ShardColumns(), "up_proj": ShardColumns(), "down_proj": ShardRows()}


def apply_tensor_parallel(model: HybridLM, state: ParallelState) -> None:
    """Shard ``model``'s projections over ``tp`` (module docstring), in place; call after
    ``apply_row_split`` (which splits the rows and owns the head) and before FSDP2."""
    check_tensor_parallel(model.config, state.tp)
    mesh, group = state.tp_mesh, state.group("tp")
    assert mesh is not None
    for i, layer in enumerate(model.layers):
        assert isinstance(layer, DecoderLayer)
        mixer, spec = layer.mixer, layer.spec
        if mixer is not None and spec is not None:
            plan, blocks = _mixer_plan(mixer, spec, state.tp)
            name = spec.attribute
            parallelize_module(model, mesh, {f"layers.{i}.{name}{'.' + k if k else ''}": s for k, s in plan.items()})
            _hook_rows(mixer, group, blocks)
        mlp = layer.mlp.shared_experts if isinstance(layer.mlp, MoE) else layer.mlp
        if isinstance(mlp, MLP):  # a relu2 MLP has no gate projection
            parallelize_module(mlp, mesh, {n: style for n, style in _MLP_PLAN.items() if hasattr(mlp, n)})
            _hook_rows(mlp, group)


def tensor_parallel_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The tensor-parallel shards (DTensors on the tp mesh), in module order."""
    out: list[nn.Parameter] = []
    for m in model.modules():
        if isinstance(m, _LocalLinear):
            out.append(m.weight)  # type: ignore[arg-type]
        for name in getattr(m, "_tp_sharded", ()):
            out.append(m._parameters[name])  # type: ignore[arg-type]
    return out


def check_tensor_parallel(config: HybridConfig, tp: int) -> None:
    """UserError naming both numbers when ``tp`` does not divide the heads or columns it splits."""
    if tp == 1:
        return
    need: list[tuple[str, int]] = []
    for spec in mixer_specs(config.layer_pattern):
        if spec.tp_plan is None:
            raise UserError(
                f"--tp {tp}: tensor parallelism does not split {spec.description} layers ({spec.letter}), which "
                "this model has; use --tp 1"
            )
        need += [n for n in spec.tp_divisors(config) if n not in need]
    need.append(("MLP columns (intermediate_size)", config.intermediate_size))
    if config.num_experts and config.num_shared_experts:
        per = config.shared_expert_intermediate_size or config.moe_intermediate_size
        need.append(("shared-expert columns", per * config.num_shared_experts))
    for what, n in need:
        if n % tp:
            raise UserError(f"--tp {tp} does not divide the model's {n} {what}")
