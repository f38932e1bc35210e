"""Planning without torch: step planner (microbatches x DP replicas x slots) and call planner."""
