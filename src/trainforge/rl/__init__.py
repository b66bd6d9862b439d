"""Online reinforcement learning: rollouts, rewards and the GRPO family of losses."""
