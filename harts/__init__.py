"""harts: train hybrid-attention LMs on agentic RL rollout trees with prefix sharing.

The public API is re-exported here. Names are resolved lazily so that ``import harts``
(and ``harts --help``) stay instant; torch is imported only by the model-side names.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

#: names that are modules themselves
_MODULES = {"workloads": "harts.tree.workloads"}

_EXPORTS = {
    "RolloutBatch": "harts.tree.batch",
    "BatchValidationError": "harts.errors",
    "HartsError": "harts.errors",
    "UserError": "harts.errors",
    "TreeFileError": "harts.errors",
    "CapacityError": "harts.errors",
    "OutputPathError": "harts.errors",
    "DivergenceError": "harts.errors",
    "RolloutTree": "harts.tree.rollout_tree",
    "CompactBatch": "harts.tree.compact",
    "compact": "harts.tree.compact",
    "PrefixIndex": "harts.tree.compact",
    "prefix_index": "harts.tree.compact",
    "SegmentForest": "harts.tree.segments",
    "LCPIndex": "harts.tree.lcp",
    "plan_step": "harts.plan.step.planner",
    "StepPlan": "harts.plan.step.planner",
    "plan_calls": "harts.plan.calls",
    "plan_calls_many": "harts.plan.calls",
    "CallPlan": "harts.plan.calls",
    "build_layout": "harts.plan.layout",
    "Layout": "harts.plan.layout",
    "HybridConfig": "harts.models.config",
    "HybridLM": "harts.models.hybrid_lm",
    "ExecutionConfig": "harts.models.execution.config",
    "ModelOutput": "harts.models.hybrid_lm",
    "Engine": "harts.trainer.engine",
    "LoraConfig": "harts.trainer.lora",
}

__all__ = sorted([*_EXPORTS, *_MODULES])


def __getattr__(name: str) -> Any:
    if name in _MODULES:
        value = importlib.import_module(_MODULES[name])
        globals()[name] = value
        return value
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'harts' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
