"""Prefix-aware microbatch / DP-replica / slot planner (paper §3.2), one stage per module."""

from harts.plan.step.planner import PlannerParams, StepPlan, plan_step

__all__ = ["PlannerParams", "StepPlan", "plan_step"]
