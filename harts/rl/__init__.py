"""RL objectives on log-probs + RolloutBatch metadata (unaware of prefix sharing), the training
loop (``train.py``) and the verification harness (``verify.py``)."""

from harts.rl.grpo import GRPOOutput, group_advantages, grpo_loss
from harts.rl.ppo import ppo_policy_loss

__all__ = ["GRPOOutput", "group_advantages", "grpo_loss", "ppo_policy_loss"]
