"""The trainer floor: the engine API (forward / forward_backward / optim_step / save / load /
export over flat trajectories), LoRA adapters, and the trainer's state on disk."""
