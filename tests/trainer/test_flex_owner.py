"""FlexAttention's backend is chosen in one place, the kernel record
(``harts.models.execution.backends.resolve_backends``): the choice ``harts bench`` / ``harts
train`` make before the first step (``harts.trainer.build.flex_backends``) is the record's.
CUDA is stood in for by its device type (the choice is host code)."""

from __future__ import annotations

import pytest
import torch

import harts.models.execution.backends as backends
from harts.errors import UserError
from harts.models.config import HybridConfig
from harts.models.execution.backends import FlexChoice, resolve_backends
from harts.models.execution.config import ExecutionConfig
from harts.trainer.build import flex_backends

CUDA = torch.device("cuda")


def test_the_build_reads_the_kernel_record(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HARTS_FLEX_BACKEND", raising=False)
    chosen: list[str] = []

    def choices(dims, device, dtype):  # the record's choice, counted
        chosen.extend(dims)
        return tuple(
            FlexChoice(kind=k, qk_dim=qk, v_dim=v, gqa=g, dtype=dtype, backend="triton")
            for k, (qk, v, g) in dims.items()
        )

    monkeypatch.setattr(backends, "_flex_choices", choices)
    cfg = HybridConfig.ling3_tiny(layer_pattern="KM")
    mask = ExecutionConfig(attention="mask")
    assert (
        flex_backends(cfg, mask, CUDA)
        == {"M": "triton"}
        == resolve_backends(mask, cfg, CUDA, cfg.torch_dtype()).to_dict()["flex"]
    )
    assert chosen == ["M", "M"]
    assert flex_backends(cfg, ExecutionConfig(attention="gather"), CUDA) == {}
    assert flex_backends(cfg, mask, torch.device("cpu")) == {}
    wide = HybridConfig.tiny(layer_pattern="KA", head_dim=512)
    with pytest.raises(UserError, match="largest is 512"):
        flex_backends(wide, mask, CUDA)
