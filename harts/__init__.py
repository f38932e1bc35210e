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

#: what users call: the batch types, the model and its configs, training (the ``Engine`` and the
#: loop), Hugging Face checkpoints in and out, the errors. The planner's internals (compaction,
#: step and call plans, layouts) stay importable from their modules, ``harts.tree.compact``,
#: ``harts.plan.step``, ``harts.plan.calls`` and ``harts.plan.layout``.
_EXPORTS = {
    "RolloutBatch": "harts.tree.batch",
    "RolloutTree": "harts.tree.rollout_tree",
    "BatchValidationError": "harts.errors",
    "HartsError": "harts.errors",
    "UserError": "harts.errors",
    "TreeFileError": "harts.errors",
    "CapacityError": "harts.errors",
    "OutputPathError": "harts.errors",
    "DivergenceError": "harts.errors",
    "HybridConfig": "harts.models.config",
    "HybridLM": "harts.models.hybrid_lm",
    "ExecutionConfig": "harts.models.execution.config",
    "ModelOutput": "harts.models.hybrid_lm",
    "Engine": "harts.trainer.engine",
    "LoraConfig": "harts.trainer.lora",
    "TrainConfig": "harts.trainer.step",
    "train": "harts.trainer.loop",
    "RunOptions": "harts.trainer.options",
    "ParallelConfig": "harts.parallel.mesh",
    "from_pretrained": "harts.integrations",
    "save_hf_checkpoint": "harts.integrations",
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
