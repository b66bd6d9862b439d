"""What a preference objective adds to a plan's step: the reference's forward (``preference.reference``; a
frozen copy of the starting weights is in the memory prediction itself, ``predict/fit.predict_memory``)."""

from __future__ import annotations

from typing import Any

from ..config.run import RunConfig
from ..config.preference import run_reference
from ..engine.predict.fit import MemoryPrediction
from ..engine.predict.timing import StepTime


def with_reference(cfg: RunConfig, step: StepTime, memory: MemoryPrediction) -> tuple[StepTime, dict[str, Any] | None]:
    """(step, facts) of ``cfg``'s objective. The traced step is the policy's forward and backward on the same
    rows; a reference adds one forward of them without gradients: a third of a full fine-tune's step (the
    backward costs two forwards), half of an adapter step's (the frozen base computes no weight gradients).
    KTO runs the policy once more without gradients first (its reference point over the whole step): twice
    that. None: not a preference run."""
    objective = cfg.train.objective
    if objective == "sft":
        return step, None
    reference = run_reference(cfg)
    facts: dict[str, Any] = {"objective": objective, "reference": reference, "reference_s": 0.0,
                             "reference_bytes": memory.parts.get("reference", 0)}
    if reference in ("none", "precompute"):  # precompute: one forward over the data before the first step
        return step, facts
    share = (1 / 3 if cfg.model.method == "full" else 1 / 2) * (2 if objective == "kto" else 1)
    facts["reference_s"] = extra = (step.seconds - step.overhead_s) * share
    step = StepTime(step.seconds + extra, step.compute_s * (1 + share), step.memory_s * (1 + share), step.overhead_s,
                    step.flops * (1 + share), step.tokens)
    return step, facts


def describe_reference(facts: dict[str, Any]) -> str:
    """The plan's line about a preference run's reference."""
    what = {"adapters": "the model with its adapters off", "model": "a frozen copy of the starting weights",
            "precompute": "precomputed once before the first step (a forward over the data; cached beside the tokens)",
            "none": "none (the objective compares the policy with itself)" if facts["objective"] in ("orpo", "simpo")
            else "none (rl.beta 0: no KL term)" if facts["objective"] == "grpo" else "none (reference-free)"}[facts["reference"]]
    cost = f"; its forward adds {facts['reference_s']:.3f}s per step (included above)" if facts["reference_s"] else ""
    held = f", {facts['reference_bytes'] / 2**30:.3f} GiB held (in the memory above)" if facts["reference_bytes"] else ""
    sampling = "; the rollout's sampling time is not predicted (the speed above is the learning step's)" if facts["objective"] == "grpo" else ""
    return f"objective: {facts['objective']}, reference: {what}{held}{cost}{sampling}"
