"""When a run does not fit even at one row with activation checkpointing: the one change that would.

The candidates, in the order a user loses least by them: a method that stores less of the model
(full -> LoRA -> QLoRA), a low-bit optimizer state (8-bit AdamW, for full fine-tunes, where the state
is large), then (grpo) shorter completions (``rl.max_completion_length`` halved, then quartered: the rollout's KV
cache shrinks with them), then shorter rows (``data.max_length`` halved, then quartered). Each is traced like the
plan itself at one row with checkpointing; the first that fits is the answer.
"""

from __future__ import annotations

from typing import Any

from ..config.run import RunConfig
from ..engine.predict.fit import MemoryPrediction, predict_memory
from ..hardware.device import Precision
from ..hardware.profiles import GIB, HardwareProfile


def candidates(cfg: RunConfig) -> list[tuple[str, Any, RunConfig]]:
    """(key, value, changed config) for each change worth trying on ``cfg``."""
    out = []
    method = cfg.model.method
    if method in ("full", "lora"):
        other = "lora" if method == "full" else "qlora"
        out.append(("model.method", other, cfg.model_copy(update={"model": cfg.model.model_copy(update={"method": other})})))
    if method == "full" and cfg.optim.name == "adamw" and cfg.optim.offload == "none":
        out.append(("optim.name", "adamw_8bit", cfg.model_copy(update={"optim": cfg.optim.model_copy(update={"name": "adamw_8bit"})})))
    for divisor in (2, 4) if cfg.train.objective == "grpo" else ():  # the rollout's KV cache and the learning rows
        n = cfg.rl.max_completion_length // divisor
        if n >= 32:
            out.append(("rl.max_completion_length", n, cfg.model_copy(update={"rl": cfg.rl.model_copy(update={"max_completion_length": n})})))
    for divisor in (2, 4):
        length = cfg.data.max_length // divisor
        if length >= 64:
            out.append(("data.max_length", length, cfg.model_copy(update={"data": cfg.data.model_copy(update={"max_length": length})})))
    return out


def one_change_to_fit(
    cfg: RunConfig, tokenizer, precision: Precision, profile: HardwareProfile, memory: MemoryPrediction,
    accum: int, world_size: int, mode: str,
) -> dict[str, Any] | None:
    """The first single change under which one row with checkpointing fits, with its predicted peak;
    None when the run fits, or when no single change is enough."""
    if memory.fits():
        return None
    for key, value, changed in candidates(cfg):
        try:
            other = predict_memory(changed, tokenizer, precision, profile, 1, True, accum, world_size, mode)
        except Exception:  # noqa: BLE001 - a change this model cannot take (no bitsandbytes, ...) is just not offered
            continue
        if other.fits():
            return {"setting": key, "value": value, "peak_process_bytes": other.process,
                    "text": f"set {key}: {value} (predicted {other.process / GIB:.2f} GiB at 1 row with activation checkpointing)"}
    return None
