"""Rollouts from the policy itself: incremental decoding with forked caches, batched sampling,
and rollout trees collected from environments (``harts.envs``)."""
