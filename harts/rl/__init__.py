"""RL objectives on log-probs + RolloutBatch metadata (unaware of prefix sharing): GRPO, PPO,
Tinker's losses, advantages; and the verification harness (``verify.py``). The training step
and loop that run them are ``harts.trainer``."""

from harts.rl.grpo import GRPOOutput, group_advantages, grpo_loss
from harts.rl.ppo import ppo_policy_loss

__all__ = ["GRPOOutput", "group_advantages", "grpo_loss", "ppo_policy_loss"]
