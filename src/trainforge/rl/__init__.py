"""Online reinforcement learning: prompts, rollouts and the rewards that score them (train.objective: grpo)."""
