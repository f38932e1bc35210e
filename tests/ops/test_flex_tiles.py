"""The FlexAttention tile rule (``harts.ops.attention.flex_tiles``) on CPU: every tile it gives
fits shared memory by its estimate, divides the BlockMask's blocks and keeps the kernels'
asserts; head dims the mask path cannot run are refused before any work, naming the head dim."""

from __future__ import annotations

import pytest
import torch

from harts.errors import UserError
from harts.ops.attention.flex_tiles import (
    FLEX_MAX_HEAD_DIM,
    HOPPER_SHARED_MEMORY,
    BwdTile,
    FwdTile,
    bwd_shared_bytes,
    flex_tiles,
    fwd_shared_bytes,
    rounded_head_dim,
)

HOPPER = (9, 0)
HEAD_DIMS = [
    pytest.param(64, 64, id="D64"),
    pytest.param(128, 128, id="D128"),
    pytest.param(192, 192, id="D192"),
    pytest.param(256, 256, id="D256"),
    pytest.param(192, 128, id="mla-D192-E128"),
    pytest.param(128, 256, id="D128-E256"),
]


def _fwd(opts: dict) -> FwdTile:
    keys = ("BLOCK_M", "BLOCK_N", "num_stages", "num_warps")
    return FwdTile(*(opts[f"fwd_{k}"] for k in keys), tma=opts.get("fwd_USE_TMA", False))


def _bwd(opts: dict) -> BwdTile:
    keys = ("BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2", "num_stages", "num_warps")
    return BwdTile(*(opts[f"bwd_{k}"] for k in keys))


@pytest.mark.parametrize("itemsize", [2, 4], ids=["half", "f32"])
@pytest.mark.parametrize("D,E", HEAD_DIMS)
def test_tiles_fit_shared_memory_and_divide_the_block_mask(D: int, E: int, itemsize: int) -> None:
    opts = flex_tiles(D, E, itemsize, HOPPER, HOPPER_SHARED_MEMORY)
    if max(D, E) <= 128:
        assert opts is None  # torch's own Hopper tiles
        return
    assert opts is not None
    f = _fwd(opts)
    assert fwd_shared_bytes(f, D, E, itemsize) <= HOPPER_SHARED_MEMORY
    assert 128 % f.block_m == 0 and 128 % f.block_n == 0
    if itemsize == 4:
        # torch's float32 backward tile (16 rows everywhere, one stage) is kept, and fits
        assert not any(k.startswith("bwd_") for k in opts)
        assert bwd_shared_bytes(BwdTile(16, 16, 16, 16, 1, 4), D, E, 4) <= HOPPER_SHARED_MEMORY
        return
    b = _bwd(opts)
    assert bwd_shared_bytes(b, D, E, itemsize) <= HOPPER_SHARED_MEMORY
    assert all(128 % n == 0 for n in (b.block_m1, b.block_n1, b.block_m2, b.block_n2))
    assert b.block_n1 % b.block_m1 == 0 and b.block_m2 % b.block_n2 == 0  # the backward kernel's asserts


def test_the_estimate_refuses_the_tile_that_did_not_compile_and_keeps_the_measured_mla_tiles() -> None:
    """harts' MLA forward tile (128 x 64, 3 stages) needed 270,336 bytes at head dim 256 on an
    H200 (Triton's refusal); the estimate is at least that, so head dim 256 gets another tile,
    while MLA's 192 / 128 keeps the measured tiles."""
    mla_fwd = FwdTile(128, 64, 3, 8, tma=True)
    mla_bwd = BwdTile(32, 128, 128, 32, 3, 8)
    assert fwd_shared_bytes(mla_fwd, 256, 256, 2) >= 270_336 > HOPPER_SHARED_MEMORY
    assert bwd_shared_bytes(mla_bwd, 256, 256, 2) > HOPPER_SHARED_MEMORY
    mla = flex_tiles(192, 128, 2, HOPPER, HOPPER_SHARED_MEMORY)
    assert mla is not None and _fwd(mla) == mla_fwd and _bwd(mla) == mla_bwd
    assert [k for k in mla if "USE_TMA" in k] == ["fwd_USE_TMA"]  # bulk copies in the forward only
    wide = flex_tiles(256, 256, 2, HOPPER, HOPPER_SHARED_MEMORY)
    assert wide is not None and _fwd(wide) != mla_fwd and _bwd(wide) != mla_bwd
    # 192 is laid out as 256: the same tiles
    assert flex_tiles(192, 192, 2, HOPPER, HOPPER_SHARED_MEMORY) == wide
    assert [rounded_head_dim(d) for d in (16, 64, 65, 128, 129, 192, 256)] == [16, 64, 128, 128, 256, 256, 256]


def test_less_shared_memory_gives_smaller_tiles_and_none_fitting_names_the_bytes() -> None:
    ampere = 166_912  # an A100 block's 163 KiB
    f32 = flex_tiles(256, 256, 4, (8, 0), ampere)
    assert f32 is not None and fwd_shared_bytes(_fwd(f32), 256, 256, 4) <= ampere
    assert _fwd(f32) != _fwd(flex_tiles(256, 256, 4, HOPPER, HOPPER_SHARED_MEMORY) or {})
    assert flex_tiles(256, 256, 2, (8, 0), ampere) is None  # half precision off Hopper: torch's tiles
    with pytest.raises(ValueError, match="192 / 192 .* 20000 bytes"):
        flex_tiles(192, 192, 2, HOPPER, 20_000)


def test_head_dims_above_the_largest_are_refused() -> None:
    assert FLEX_MAX_HEAD_DIM == 256
    with pytest.raises(ValueError, match="query/key 288, value 288"):
        flex_tiles(288, 288, 2, HOPPER, HOPPER_SHARED_MEMORY)


def test_flex_kernel_options_on_hopper_picks_tiles_for_head_dim_256(monkeypatch: pytest.MonkeyPatch) -> None:
    from harts.ops.attention.tree_mask import flex_kernel_options

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: HOPPER)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # Hopper's shared memory
    cuda = torch.device("cuda")
    assert flex_kernel_options(cuda, torch.bfloat16, 256, 256) == flex_tiles(256, 256, 2, HOPPER, HOPPER_SHARED_MEMORY)
    assert flex_kernel_options(cuda, torch.bfloat16, 128, 128) is None
    assert flex_kernel_options(torch.device("cpu"), torch.bfloat16, 256, 256) is None


def test_resolved_attention_keeps_the_mask_path_to_head_dims_it_runs() -> None:
    """Above 256 "auto" gathers on CUDA and an explicit "mask" is a UserError naming the head dim
    and what was tried; the CPU's dense tree mask takes any head dim."""
    from harts.models.execution.config import ExecutionConfig, attention_head_dim_range

    auto, mask = ExecutionConfig(attention="auto"), ExecutionConfig(attention="mask")
    assert attention_head_dim_range({"M": (192, 128, False), "A": (256, 256, True)}) == (128, 256)
    assert attention_head_dim_range({}) == (None, None)
    assert auto.resolved_attention("cuda", 128, 256) == "mask"
    assert mask.resolved_attention("cuda", 64, 256) == "mask"
    assert auto.resolved_attention("cuda", 512, 512) == "gather"
    assert mask.resolved_attention("cpu", 512, 512) == "mask"
    with pytest.raises(UserError, match=r"head dims up to 256; this model's largest is 512 \(tried: the Triton"):
        mask.resolved_attention("cuda", 512, 512)
    with pytest.raises(UserError, match="head dims >= 16; this model's smallest is 8"):
        mask.resolved_attention("cuda", 8, 8)


def test_flex_backends_refuses_an_unsupported_head_dim_before_any_work() -> None:
    """What ``harts bench`` / ``harts train`` call before the model's first step: a GQA layer of
    head dim 512 with --attention mask on CUDA is a UserError (no kernel compiled, no device
    touched); with auto the model gathers."""
    from harts.commands._inputs import flex_backends
    from harts.models.config import HybridConfig
    from harts.models.execution.config import ExecutionConfig

    config = HybridConfig.tiny(layer_pattern="KA", head_dim=512)
    cuda = torch.device("cuda")
    with pytest.raises(UserError, match="largest is 512"):
        flex_backends(config, ExecutionConfig(attention="mask"), cuda)
    assert flex_backends(config, ExecutionConfig(attention="auto"), cuda) == {}
