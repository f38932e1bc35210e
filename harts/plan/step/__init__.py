"""Prefix-aware microbatch / DP-replica / slot planner (paper §3.2), one stage per module.

``planner.py`` runs the search (``plan_step``); ``step_plan.py`` holds what it hands out
(``StepPlan``: microbatches, replicas, slots, and the step's compaction, sliced per microbatch);
``workers.py`` holds ``PlannerWorkers``, the processes that build candidates in parallel.
"""

from harts.plan.step.planner import PlannerParams, StepPlan, plan_step
from harts.plan.step.workers import PlannerWorkers

__all__ = ["PlannerParams", "PlannerWorkers", "StepPlan", "plan_step"]
