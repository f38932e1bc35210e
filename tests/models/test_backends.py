"""The kernel record (``harts.models.execution.backends``): one resolution of every kernel choice
per (model, device), from ``ExecutionConfig``; what the row contexts and layers run.

CUDA is stood in for by its device type (``torch.device("cuda")`` needs no GPU) and fla-core by
``fla_available``: the choice logic is host code."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from harts.models import HybridConfig, HybridLM
from harts.models.execution.backends import Backends, FlexChoice, default_fast_paths, resolve_backends
from harts.models.execution.config import ExecutionConfig
from harts.ops.registry import FAST_PATHS, LINEAR_ATTN_BACKENDS, canonical_linear_attn, linear_attn_choices
from harts.rl.verify import run_step
from tests.models._trees import mixed_batch
from tests.models.test_compact_vs_trajectory import B, make_model

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.fixture
def with_fla(monkeypatch: pytest.MonkeyPatch) -> None:
    """fla-core "installed": every module that asks sees it."""
    import harts.ops.linear_attn.dispatch as dispatch
    import harts.ops.linear_attn.fla as fla_mod

    monkeypatch.setattr(dispatch, "fla_available", lambda: True)
    monkeypatch.setattr(fla_mod, "fla_available", lambda: True)
    for name in ("HARTS_KDA_SILU_IN_SPLIT", "HARTS_KDA_FLA_GATE", "HARTS_FLEX_BACKEND"):
        monkeypatch.delenv(name, raising=False)


def test_the_cpu_default_is_the_bare_record(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HARTS_KDA_SILU_IN_SPLIT", "HARTS_KDA_FLA_GATE"):
        monkeypatch.delenv(name, raising=False)
    cfg = HybridConfig.tiny(layer_pattern="KGMA", num_experts=4)
    got = resolve_backends(ExecutionConfig(), cfg, CPU, torch.float64)
    assert got == Backends()
    assert got.linear_attention == got.conv == "reference" and got.attention == "gather" and not got.link_rounds
    assert got.fast_paths == frozenset(FAST_PATHS) - {"stacked_qkv", "stacked_gates", "fla_gate"}
    # "auto" on the CPU resolves to the same record
    assert resolve_backends(ExecutionConfig(linear_attention_backend="auto"), cfg, CPU, torch.float64) == got


def test_the_conv_follows_the_resolved_linear_attention(with_fla: None) -> None:
    """ "auto" on CUDA with fla-core at a chunk size fla-core does not run (the tiny preset's 8)
    is the reference linear attention, and then the reference conv too, in both modes: the
    trajectory-wise executor had handed the unresolved "auto" to ``conv_uses_fla`` and so ran
    fla-core's conv beside the reference core, unlike the compact one."""
    from harts.models.execution.trajectory import TrajectoryContext
    from harts.ops.conv import conv_uses_fla
    from harts.tree.workloads import generate

    auto = ExecutionConfig(linear_attention_backend="auto")
    at8 = resolve_backends(auto, HybridConfig.tiny(layer_pattern="KG", chunk_size=8), CUDA, torch.bfloat16)
    assert (at8.linear_attention, at8.conv, at8.link_rounds) == ("reference", "reference", False)
    at64 = resolve_backends(auto, HybridConfig.tiny(layer_pattern="KG", chunk_size=64), CUDA, torch.bfloat16)
    assert (at64.linear_attention, at64.conv, at64.link_rounds) == ("tree", "fla", True)
    with pytest.raises(ValueError, match="resolved linear-attention operator"):
        conv_uses_fla("auto", CUDA)
    assert not conv_uses_fla("reference", CUDA) and conv_uses_fla("tree", CUDA) and conv_uses_fla("fla", CUDA)
    # the trajectory-wise context takes its conv from the record, whatever the device
    batch = generate("tiny", step=0)
    assert TrajectoryContext(batch, 8, CPU, at8).conv_runs is None
    assert TrajectoryContext(batch, 8, CPU, dataclasses.replace(at8, conv="fla")).conv_runs is not None


def test_tree_linked_is_the_tree_kernel_with_linked_rounds(with_fla: None) -> None:
    assert canonical_linear_attn("tree_linked") == ("tree", True)
    assert canonical_linear_attn("auto") == ("auto", None)
    assert linear_attn_choices() == (*LINEAR_ATTN_BACKENDS, "tree_linked")
    old = ExecutionConfig(linear_attention_backend="tree_linked")
    assert (old.linear_attention_backend, old.link_rounds) == ("tree", True)
    assert old == ExecutionConfig(linear_attention_backend="tree", link_rounds=True)
    assert ExecutionConfig.of(old, mode="trajectory").link_rounds  # a replaced copy keeps it
    with pytest.raises(ValueError, match="link_rounds=True, but link_rounds=False was given"):
        ExecutionConfig(linear_attention_backend="tree_linked", link_rounds=False)
    with pytest.raises(ValueError, match="must be one of"):
        ExecutionConfig(linear_attention_backend="linked")
    cfg = HybridConfig.tiny(layer_pattern="KG", chunk_size=64)

    def linked(**fields: object) -> bool:
        return resolve_backends(ExecutionConfig(**fields), cfg, CUDA, torch.bfloat16).link_rounds  # type: ignore[arg-type]

    # None: linked under "auto", one call per round under an explicit "tree" (the A/B)
    assert linked(linear_attention_backend="auto") and not linked(linear_attention_backend="tree")
    assert linked(linear_attention_backend="tree", link_rounds=True)
    assert not linked(linear_attention_backend="auto", link_rounds=False)
    # nothing to link beside another operator
    assert not linked(linear_attention_backend="fla", link_rounds=True)
    assert not resolve_backends(ExecutionConfig(linear_attention_backend="auto"), cfg, CPU, torch.float32).link_rounds


def test_fast_paths_are_checked_and_named_paths_run_where_they_can(with_fla: None) -> None:
    with pytest.raises(ValueError, match="unknown name 'stacked'"):
        ExecutionConfig(fast_paths=("stacked",))
    with pytest.raises(ValueError, match="a tuple of names or None"):
        ExecutionConfig(fast_paths="stacked_qkv")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="twice"):
        ExecutionConfig(fast_paths=("fla_gate", "fla_gate"))
    assert default_fast_paths(CUDA) == frozenset(FAST_PATHS)
    cfg = HybridConfig.tiny(layer_pattern="K")
    named = ExecutionConfig(fast_paths=("stacked_qkv", "fla_gate"))
    assert resolve_backends(named, cfg, CUDA, torch.bfloat16).fast_paths == {"stacked_qkv", "fla_gate"}
    # the stacked GEMM runs anywhere; fla-core's gate does not run on the CPU
    assert resolve_backends(named, cfg, CPU, torch.float32).fast_paths == {"stacked_qkv"}
    assert resolve_backends(ExecutionConfig(fast_paths=()), cfg, CUDA, torch.bfloat16).fast_paths == frozenset()


def test_flex_backends_are_recorded_per_head_shape(with_fla: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CUDA mask path the record names FlexAttention's backend of every full-attention
    kind (``flex_backend``'s choice); the contexts hand it to ``tree_mask_attention`` for heads of
    that shape and dtype, and leave other heads to its own choice."""
    import harts.ops.attention as attention_ops
    import harts.ops.attention.tree_mask as tm
    from harts.models.execution.trajectory import TrajectoryContext
    from harts.tree.workloads import generate

    asked = []
    monkeypatch.setattr(tm, "flex_backend", lambda device, dtype, qk, v, gqa=False: asked.append((qk, v)) or "flash")
    cfg = HybridConfig.ling3_tiny(layer_pattern="KM")
    got = resolve_backends(ExecutionConfig(attention="mask"), cfg, CUDA, torch.bfloat16)
    qk, v, _ = cfg.attention_head_dims["M"]
    assert got.attention == "mask" and asked == [(qk, v)]
    assert got.flex == (FlexChoice(kind="M", qk_dim=qk, v_dim=v, gqa=False, dtype=torch.bfloat16, backend="flash"),)
    assert "attention mask (FlexAttention M flash)" in got.describe()
    assert got.to_dict()["flex"] == {"M": "flash"}
    assert resolve_backends(ExecutionConfig(attention="mask"), cfg, CPU, torch.bfloat16).flex == ()
    assert resolve_backends(ExecutionConfig(attention="gather"), cfg, CUDA, torch.bfloat16).flex == ()

    seen = []
    monkeypatch.setattr(attention_ops, "tree_mask_attention", lambda *a, **kw: seen.append(kw["backend"]) or a[0])
    batch = generate("tiny", step=0)
    ctx = TrajectoryContext(batch, 8, CPU, got)
    P = ctx.num_rows
    for dtype, d in ((torch.bfloat16, qk), (torch.float32, qk), (torch.bfloat16, 64)):
        q = torch.zeros(P, 2, d, dtype=dtype)
        ctx.attention(q, q, torch.zeros(P, 2, v, dtype=dtype), scale=1.0)
    assert seen == ["flash", None, None]


def test_describe_names_every_choice_on_one_line() -> None:
    line = Backends().describe()
    assert "\n" not in line
    assert line == (
        "linear attention reference; conv reference; attention gather; "
        "fast paths: all but stacked_qkv, stacked_gates, fla_gate; torch.compile glue: off"
    )
    linked = Backends(linear_attention="tree", link_rounds=True, conv="fla", fast_paths=frozenset(FAST_PATHS))
    assert linked.describe().startswith("linear attention tree (rounds linked); conv fla;")
    assert linked.describe().endswith("fast paths: all; torch.compile glue: off")
    assert Backends(fast_paths=frozenset()).describe().endswith("fast paths: none; torch.compile glue: off")
    assert Backends().to_dict() == {
        "linear_attention": "reference",
        "link_rounds": False,
        "conv": "reference",
        "attention": "gather",
        "flash_views": False,
        "flex": {},
        "fast_paths": ["fused_qkv_norm", "silu_in_split", *FAST_PATHS[5:]],
        "gdn": None,
        "compile": False,
    }
    views = Backends(attention="gather", flash_views=True)
    assert "attention gather (FlashAttention-2 varlen views);" in views.describe()
    assert views.to_dict()["flash_views"] is True


def test_auto_attention_gathers_where_flash_varlen_runs_every_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    """ "auto" on CUDA takes the gather path (FlashAttention-2 varlen over ancestor views) when
    that kernel runs every attention kind of the model, and FlexAttention's tree mask otherwise
    (MLA's unequal q/v head dims, float32); the CPU keeps its own rule; an explicit choice stays."""
    from harts.models.execution import config as cfg
    from harts.ops.attention import flash_varlen

    monkeypatch.setattr(flash_varlen.torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    cuda = torch.device("cuda")
    gqa256 = {"A": (256, 256, True)}
    mla = {"M": (192, 128, False)}
    assert cfg.flash_views_run(gqa256, cuda, torch.bfloat16)
    assert not cfg.flash_views_run({**gqa256, **mla}, cuda, torch.bfloat16)
    assert not cfg.flash_views_run(gqa256, cuda, torch.float32)
    assert not cfg.flash_views_run(gqa256, torch.device("cpu"), torch.bfloat16)
    assert not cfg.flash_views_run({}, cuda, torch.bfloat16)
    auto, mask = ExecutionConfig(attention="auto"), ExecutionConfig(attention="mask")
    assert auto.resolved_attention("cuda", 256, 256, flash_views=True) == "gather"
    assert auto.resolved_attention("cuda", 128, 192, flash_views=False) == "mask"
    assert mask.resolved_attention("cuda", 256, 256, flash_views=True) == "mask"
    assert auto.resolved_attention("cpu", 256, 256, flash_views=True) == "gather"
    torch.use_deterministic_algorithms(True)
    try:  # FlexAttention's Triton kernel is the reproducible path then
        assert "deterministic" in flash_varlen.flash_varlen_refusal(cuda, torch.bfloat16, 256, 256)
        assert not cfg.flash_views_run(gqa256, cuda, torch.bfloat16)
    finally:
        torch.use_deterministic_algorithms(False)


def test_the_model_resolves_once_and_its_contexts_and_layers_run_the_record(monkeypatch: pytest.MonkeyPatch) -> None:
    from harts.models.execution.compact import CompactContext
    from harts.models.execution.trajectory import TrajectoryContext
    from harts.models.layers.moe import MoE

    model = make_model("KM", moe=True)
    calls = []
    real = resolve_backends

    def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr("harts.models.hybrid_lm.resolve_backends", counted)
    reference = ExecutionConfig(fast_paths=())
    assert model.backends(reference) is model.backends(ExecutionConfig.of(reference, mode="trajectory"))
    assert model.backends() is not model.backends(reference) and len(calls) == 2

    carried, fast = [], []
    for cls in (TrajectoryContext, CompactContext):
        original = cls.linear_attention

        def spy(self, *args, _original=original, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            carried.append(self.backends)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(cls, "linear_attention", spy)
    moe_forward = MoE.forward

    def moe_spy(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        fast.append(kwargs["fast"])
        return moe_forward(self, *args, **kwargs)

    monkeypatch.setattr(MoE, "forward", moe_spy)
    batch = mixed_batch(B)
    runs = {mode: run_step(model, batch, reference, mode=mode, kl_coef=0.1) for mode in ("trajectory", "compact")}
    assert carried and all(b is model.backends(reference) for b in carried)
    assert fast and all(f == frozenset() for f in fast)
    assert len(calls) == 2  # both modes ran the one record resolved above
    # every fast path off is the reference code: the same results as the defaults, float64
    default = run_step(model, batch, mode="compact", kl_coef=0.1)
    torch.testing.assert_close(runs["compact"].logprobs, default.logprobs, rtol=1e-12, atol=1e-12)


def test_the_decoder_context_carries_the_model_record() -> None:
    from harts.rollout.decode import extend, new_branch

    torch.manual_seed(0)
    model = HybridLM(HybridConfig.tiny(layer_pattern="KA", num_experts=0))
    seen = []
    layer = model.layers[0].linear_attn
    original = type(layer).forward

    def spy(x, ctx):  # noqa: ANN001, ANN202
        seen.append(ctx.backends)
        return original(layer, x, ctx)

    layer.forward = spy  # type: ignore[method-assign]
    extend(model, [new_branch(model)], [[1, 2, 3]])
    assert seen == [model.backends()]
