"""The trainer floor: the training step and loop (``step``, ``loop``), the runtime of a training
run with its checkpoints, signals and metrics (``run``, ``checkpoints``, ``signals``), model
building from a ``ModelSpec`` (``build``), the checks before step 0 (``checks``), the online RL
trainer (``online``), the weights on disk (``weights``), and the engine API (forward /
forward_backward / optim_step / save / load / export over flat trajectories, ``engine``) with
LoRA adapters (``lora``) and the engine's state on disk (``state``)."""
