"""The public API (``harts.__all__``) is what users call; the planner's internals stay importable
from their own modules, not from the top level."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import harts

#: what a user's training script calls
USER_NAMES = (
    "Engine",
    "TrainConfig",
    "train",
    "RunOptions",
    "ParallelConfig",
    "from_pretrained",
    "save_hf_checkpoint",
    "RolloutBatch",
    "RolloutTree",
    "HybridConfig",
    "ExecutionConfig",
    "LoraConfig",
    "UserError",
)

#: the planner's internals and where they live
INTERNALS = {
    "CompactBatch": "harts.tree.compact",
    "compact": "harts.tree.compact",
    "PrefixIndex": "harts.tree.compact",
    "prefix_index": "harts.tree.compact",
    "SegmentForest": "harts.tree.segments",
    "LCPIndex": "harts.tree.lcp",
    "plan_step": "harts.plan.step",
    "StepPlan": "harts.plan.step",
    "plan_calls": "harts.plan.calls",
    "plan_calls_many": "harts.plan.calls",
    "CallPlan": "harts.plan.calls",
    "build_layout": "harts.plan.layout",
    "Layout": "harts.plan.layout",
}


def test_the_public_api_exports_what_users_call() -> None:
    assert set(USER_NAMES) <= set(harts.__all__)
    for name in harts.__all__:
        assert getattr(harts, name) is not None, name
    assert harts.train is importlib.import_module("harts.trainer.loop").train


@pytest.mark.parametrize("name", sorted(INTERNALS))
def test_planner_internals_live_in_their_modules(name: str) -> None:
    assert name not in harts.__all__
    with pytest.raises(AttributeError):
        getattr(harts, name)
    assert getattr(importlib.import_module(INTERNALS[name]), name) is not None


def test_import_harts_and_its_names_stay_light() -> None:
    """``import harts`` and the torch-free names import no torch (``harts --help`` stays instant)."""
    code = "import sys, harts; harts.RolloutBatch; harts.RunOptions; harts.UserError; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
