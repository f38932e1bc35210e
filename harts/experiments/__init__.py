"""Measurement: the benches that time the step ``harts train`` ships (``step_bench``: one device,
harts against the trajectory-wise baseline; ``mesh_bench``: the same on a (dp, ep, cp, tp)
mesh), with what they report (``bench_result``), count (``counts``) and read around the step
(``probes``).

This room sits above the trainer and below the commands: it times
``harts.trainer.step.accumulate_step_gradients`` and ``train_step`` from outside, and nothing in
the runtime (tree, plan, ops, models, rl, rollout, parallel, integrations, trainer, serve)
imports it.
"""
