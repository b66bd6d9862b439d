"""The ``optim`` section of a run config: which optimizer, its hyperparameters and where its state lives."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from .base import MAX_STEPS, Section


class OptimSettings(Section):
    name: Literal["adamw", "adamw_8bit", "paged_adamw_8bit", "paged_adamw", "adamw_4bit"] = Field(
        "adamw",
        description="adamw: torch's (fused) AdamW, fp32 state, 8 bytes per trainable parameter; adamw_8bit: "
        "bitsandbytes' 8-bit AdamW (~2 bytes); paged_adamw_8bit / paged_adamw: the same 8-bit or fp32 state in "
        "CUDA unified memory, paged to the host instead of running out; adamw_4bit: torchao's 4-bit AdamW "
        "(~1 byte). Low-bit and paged ones: pip install 'trainforge[lowmem]'",
    )
    offload: Literal["none", "cpu"] = Field(
        "none",
        description="cpu: AdamW's state and step in host memory (torchao's CPUOffloadOptimizer; one GPU, "
        "optim.name adamw): no optimizer state on the GPU, gradients and weights cross PCIe every step",
    )
    lr: float = Field(3.0e-4, gt=0, description="peak learning rate")
    weight_decay: float = Field(0.1, ge=0, description="AdamW decay, not applied to norms and biases")
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW moment decay rates")
    eps: float = Field(1e-8, gt=0, description="AdamW denominator epsilon")
    schedule: Literal["constant", "linear", "cosine"] = Field("cosine", description="decay after warmup")
    warmup_steps: int = Field(0, ge=0, le=MAX_STEPS, description="linear warmup from lr/warmup_steps to lr (train and plan warn where it is longer than the run: lr is never reached)")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="final lr / peak lr for linear and cosine")
    max_grad_norm: float | None = Field(1.0, gt=0, description="clip the global grad norm; null: no clipping")

    @field_validator("betas")
    @classmethod
    def _betas_range(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in v):
            raise ValueError("each beta must be in [0, 1)")
        return v

    @model_validator(mode="after")
    def _offload_takes_adamw(self) -> "OptimSettings":
        if self.offload == "cpu" and self.name != "adamw":
            raise ValueError(
                f"optim.offload: cpu runs torch's AdamW on the host; optim.name is {self.name}: set optim.name: "
                "adamw, or keep the low-bit state on the GPU with optim.offload: none"
            )
        return self

    def warmup_problem(self, max_steps: int | None) -> tuple[str, str] | None:
        """(message, fix) where ``warmup_steps`` is longer than the run's ``max_steps``: the learning rate never
        reaches ``lr`` (and no decay runs). ``train`` warns with it and ``plan`` lists it; None where the warmup ends
        within the run."""
        if not max_steps or self.warmup_steps <= max_steps:
            return None
        return (f"optim.warmup_steps {self.warmup_steps} is longer than the run's {max_steps} steps: the learning rate "
                f"never reaches optim.lr {self.lr:g} (its last step trains at {self.lr * max_steps / self.warmup_steps:.3g})",
                f"set optim.warmup_steps to {max_steps} or fewer (a few percent of the run is usual), or raise train.max_steps")
