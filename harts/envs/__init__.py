"""Environments for online RL: a small interface (``Environment``) and built-in tasks."""

from harts.envs.base import Environment, StepResult, TurnLimits
from harts.envs.lookup import ToolLookup

__all__ = ["Environment", "StepResult", "ToolLookup", "TurnLimits"]
