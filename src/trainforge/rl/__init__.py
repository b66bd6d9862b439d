"""Online reinforcement learning (train.objective: grpo): prompts, rollouts, the rewards that score them."""
