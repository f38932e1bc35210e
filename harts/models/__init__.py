"""Hybrid-attention models: config, layers, and trajectory-wise / compact execution."""

from harts.models.config import HybridConfig
from harts.models.hybrid_lm import CompactInputs, HybridLM, ModelOutput, TrajectoryInputs

__all__ = ["CompactInputs", "HybridConfig", "HybridLM", "ModelOutput", "TrajectoryInputs"]
