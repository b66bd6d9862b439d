"""The ``rl`` section of a run config: online RL (``train.objective: grpo``): how completions are sampled, which
GRPO variant learns from them, and the rewards that score them (``rl.rewards``: config/rewards.py)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from .base import MAX_TOKENS, Section
from .rewards import RewardSettings

LOSSES = ("grpo", "dr_grpo", "dapo", "gspo")
"""``rl.loss`` values: how the per-token terms are averaged and where the importance ratio lives (engine/grpo.py)."""


class RLSettings(Section):
    num_generations: int = Field(
        8, ge=2, le=4096,
        description="completions sampled per prompt (the group whose rewards are compared); at least 2: one "
        "completion has no group to be better or worse than",
    )
    max_completion_length: int = Field(256, gt=0, le=MAX_TOKENS, description="new tokens a completion may take at most")
    temperature: float = Field(1.0, gt=0, le=100, description="sampling temperature; the policy's log-probabilities are "
                               "taken at the same temperature, so the importance ratios compare like with like")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling: keep the most likely tokens up to this mass")
    top_k: int = Field(0, ge=0, le=MAX_TOKENS, description="keep only the k most likely tokens (0: all)")
    min_p: float = Field(0.0, ge=0, lt=1, description="drop tokens less likely than min_p x the most likely one (0: off)")
    loss: Literal["grpo", "dr_grpo", "dapo", "gspo"] = Field(
        "grpo",
        description="grpo: each completion's token mean, then the mean over completions; dr_grpo: the token sum over a "
        "constant (max_completion_length x completions); dapo: the token mean over the whole step (clip-higher with "
        "epsilon_high); gspo: one importance ratio per completion (the geometric mean of its token ratios)",
    )
    epsilon: float = Field(0.2, gt=0, lt=1, description="the clip range below (and above, unless epsilon_high) ratio 1")
    epsilon_high: float | None = Field(
        None, gt=0, le=10, description="the clip range above ratio 1 (DAPO's clip-higher: 0.28); null: epsilon",
    )
    beta: float = Field(0.0, ge=0, le=1000, description="weight of the k3 KL estimate to the reference (LoRA: the "
                        "adapters off; full fine-tune: a frozen copy of the starting weights); 0: no reference runs")
    num_iterations: int = Field(
        1, ge=1, le=1024,
        description="optimizer steps on each generated batch; above 1 the ratios are taken against the log-probabilities "
        "recorded when the batch was generated, and clipping bites",
    )
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group", description="advantages are reward - group mean, divided by the std of the group, of the whole "
        "generation batch, or not at all (Dr. GRPO)",
    )
    mask_truncated_completions: bool = Field(
        False, description="completions cut at max_completion_length (no end token) add no loss",
    )
    reward_timeout_s: float = Field(60.0, gt=0, le=86400, description="seconds one reward function may take per batch")
    rewards: list[RewardSettings] = Field(
        default_factory=list, description="the reward functions, weighted and summed (each logged on its own)",
    )

    @model_validator(mode="after")
    def _clip_range(self) -> RLSettings:
        if self.epsilon_high is not None and self.epsilon_high < self.epsilon:
            raise ValueError(f"epsilon_high: {self.epsilon_high} is below epsilon ({self.epsilon}); clip-higher widens "
                             "the range above 1: set it to epsilon or more, or leave it null")
        return self

    @property
    def clip_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


def check_rl(cfg: Any) -> None:
    """Raise ValueError naming the key when the ``rl`` section does not fit ``train.objective`` (a RunConfig being
    validated): rl settings away from their defaults without grpo change nothing; grpo needs rewards, a
    decoder-only model and no FSDP."""
    objective = cfg.train.objective
    if objective != "grpo":  # a written config.yaml spells out the defaults: only a changed value is refused
        if cfg.rl != RLSettings():
            raise ValueError(f"rl: the rl section is read by train.objective grpo only (this run trains {objective}); "
                             "remove it or set train.objective: grpo")
        return
    if cfg.model.kind.encoder_decoder:
        raise ValueError("train.objective: grpo is for decoder-only models here; this model is an encoder-decoder")
    if cfg.train.distributed == "fsdp":
        raise ValueError("train.distributed: fsdp shards the weights the rollouts sample with (every token would gather "
                         "them); grpo runs single-process or under ddp here: set train.distributed: ddp")
    if not cfg.rl.rewards:
        raise ValueError("rl.rewards: grpo needs at least one reward, e.g. rl.rewards: [{name: final_number}]")
