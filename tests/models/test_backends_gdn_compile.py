"""The kernel record names GDN's kernels on the one-pass tree operator and whether the layer glue
is compiled, so ``Backends.describe()`` (``harts bench``'s header) names everything that runs.

CUDA is stood in for by its device type and fla-core by ``fla_available``, as in
``tests/models/test_backends.py``: the choice is host code."""

from __future__ import annotations

import pytest
import torch

from harts.models import HybridConfig
from harts.models.execution.backends import GDN_LETTER, resolve_backends
from harts.models.execution.config import ExecutionConfig

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
GATHER = ExecutionConfig(linear_attention_backend="tree", attention="gather")


@pytest.fixture
def on_cuda(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    import harts.ops.linear_attn.dispatch as dispatch
    import harts.ops.linear_attn.fla as fla_mod

    monkeypatch.setattr(dispatch, "fla_available", lambda: True)
    monkeypatch.setattr(fla_mod, "fla_available", lambda: True)
    for name in ("HARTS_GDN_NATIVE", "HARTS_COMPILE", "HARTS_KDA_SILU_IN_SPLIT", "HARTS_KDA_FLA_GATE"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def resolve(pattern: str, execution: ExecutionConfig = GATHER, device: torch.device = CUDA):
    cfg = HybridConfig.tiny(layer_pattern=pattern, chunk_size=64)
    return resolve_backends(execution, cfg, device, torch.bfloat16)


def test_gdn_on_the_tree_operator_is_recorded_and_described(on_cuda: pytest.MonkeyPatch) -> None:
    from harts.models.layers.gdn import SPEC

    assert GDN_LETTER == SPEC.letter
    kda = resolve("KG")
    assert kda.gdn == "kda" and kda.to_dict()["gdn"] == "kda"
    assert kda.describe().startswith("linear attention tree (GDN on the KDA kernels); ")
    on_cuda.setenv("HARTS_GDN_NATIVE", "1")
    native = resolve("KG")
    assert native.gdn == "gdn"
    assert "linear attention tree (GDN on fla-core's GDN kernels, checked per head shape); " in native.describe()
    # no GDN layer, or GDN on another operator: nothing to record
    assert resolve("KM").gdn == ""
    assert resolve("KG", ExecutionConfig(linear_attention_backend="reference", attention="gather")).gdn == ""


def test_compiled_glue_is_recorded_and_described(on_cuda: pytest.MonkeyPatch) -> None:
    compiled = resolve("KG")
    assert compiled.compile and compiled.describe().endswith("; torch.compile glue: on")
    on_cuda.setenv("HARTS_COMPILE", "0")
    assert not resolve("KG").compile
    cpu = resolve("KG", ExecutionConfig(attention="gather"), CPU)
    assert not cpu.compile and cpu.to_dict()["compile"] is False
    assert cpu.describe().endswith("; torch.compile glue: off")
