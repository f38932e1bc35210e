"""Planning without torch: step planner (``step/``: microbatches x DP replicas x slots), call
planner (``calls.py``: Algorithm 1), physical layout (``layout.py``), baselines (``baselines/``)."""
