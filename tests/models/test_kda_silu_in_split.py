"""KDA's short-conv SiLU applied by the q / k / v split (the fast path "silu_in_split", on by
default): the conv without its activation followed by the split's SiLU gives the conv-with-SiLU
model's log-probs and every gradient bit for bit in float64, in both execution modes (the same
operations in the same order); ``HARTS_KDA_SILU_IN_SPLIT`` switches the default."""

from __future__ import annotations

import pytest
import torch

from harts.models.execution.backends import default_fast_paths
from harts.models.execution.config import ExecutionConfig
from harts.models.layers.kda import silu_in_split
from harts.rl.verify import run_step
from tests.models._trees import mixed_batch
from tests.models.test_compact_vs_trajectory import B, make_model
from tests.models.test_kda_stacked_qkv import with_path


@pytest.mark.parametrize("mode", ["trajectory", "compact"])
def test_silu_in_split_equals_silu_in_conv(mode: str) -> None:
    model = make_model("KM", moe=False)
    batch = mixed_batch(B)
    runs = {}
    for in_split in (False, True):
        runs[in_split] = run_step(
            model, batch, mode=mode, kl_coef=0.1, fast_paths=with_path(model, "silu_in_split", in_split)
        )
    a, b = runs[False], runs[True]
    assert torch.equal(b.logprobs.nan_to_num(), a.logprobs.nan_to_num())
    assert set(a.grads) == set(b.grads)
    for name, g in a.grads.items():
        assert torch.equal(b.grads[name], g), name


def test_environment_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    monkeypatch.delenv("HARTS_KDA_SILU_IN_SPLIT", raising=False)
    assert silu_in_split() and "silu_in_split" in default_fast_paths(cpu)
    for off in ("0", "false", " Off "):
        monkeypatch.setenv("HARTS_KDA_SILU_IN_SPLIT", off)
        assert not silu_in_split() and "silu_in_split" not in default_fast_paths(cpu)
        # a model resolved now takes the default the environment sets; fast_paths names it anyway
        model = make_model("K", moe=False)
        assert not model.backends().fast("silu_in_split")
        assert model.backends(ExecutionConfig(fast_paths=("silu_in_split",))).fast("silu_in_split")
    monkeypatch.setenv("HARTS_KDA_SILU_IN_SPLIT", "1")
    assert silu_in_split()
