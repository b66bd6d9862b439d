"""What ``trainforge plan`` says about the optimizer: its state on the device and the host, an offload's
per-step transfers, and the memory lever of each other optimizer."""

from __future__ import annotations

from typing import Any

from ..config.run import RunConfig
from ..engine.predict.fit import MemoryPrediction
from ..engine.predict.timing import StepTime
from ..hardware.profiles import HardwareProfile

HOST_LINK_EFFICIENCY = 0.8  # share of the PCIe link's datasheet rate large pinned copies reach
HOST_ADAMW_BYTES_PER_VALUE = 28  # fused CPU AdamW reads and writes weight, grad and two moments (fp32)


def optimizer_facts(cfg: RunConfig, memory: MemoryPrediction, profile: HardwareProfile) -> dict[str, Any]:
    """The optimizer's state on the device and on the host, and per step with ``optim.offload: cpu``: the
    gradients down and the weights back up over PCIe (fp32 each) and the host's AdamW pass."""
    from ..engine.optim import OPTIMIZERS, describe_optimizer, state_bytes_per_value

    o = cfg.optim
    state = memory.parts.get("optimizer", 0)
    out: dict[str, Any] = {"name": o.name, "offload": o.offload, "describe": describe_optimizer(o), "device_bytes": state,
                           "paged": OPTIMIZERS[o.name].paged}
    if o.offload == "cpu":
        values = memory.trace.trainable_grads / 4 if memory.trace else 0  # fp32 gradients: 4 bytes a value
        out["device_bytes"] = 0
        out["host_bytes"] = int(values * state_bytes_per_value(1 << 20, o.name))
        out["pcie_s"] = 2 * 4 * values / (profile.host_link_gbs * 1e9 * HOST_LINK_EFFICIENCY)
        out["host_step_s"] = HOST_ADAMW_BYTES_PER_VALUE * values / (HOST_MEMORY_GBS * 1e9)
    return out


HOST_MEMORY_GBS = 40.0  # a server's host memory bandwidth one fused AdamW pass reaches (assumed)


def with_offload(step: StepTime, optimizer: dict[str, Any]) -> StepTime:
    """An offloaded optimizer's step: its transfers and host pass come after the backward, in series."""
    extra = optimizer.get("pcie_s", 0.0) + optimizer.get("host_step_s", 0.0)
    if not extra:
        return step
    return StepTime(step.seconds + extra, step.compute_s, step.memory_s + extra, step.overhead_s, step.flops, step.tokens)



def optimizer_levers(cfg: RunConfig, memory: MemoryPrediction, profile: HardwareProfile) -> dict[str, int]:
    """Peak tensors with the optimizer state of another ``optim.name``, or offloaded (one GPU, AdamW):
    the state exists the whole step, so the peak moves by the state's difference (large tensors' rate)."""
    from ..engine.optim import state_bytes_per_value

    o, state = cfg.optim, memory.parts.get("optimizer", 0)
    if not state:
        return {}
    values = state / state_bytes_per_value(1 << 20, o.name)
    out = {}
    for name in ("adamw", "adamw_8bit", "adamw_4bit"):
        if name != o.name:
            out[f"with_optim_{name}"] = int(memory.tensors - state + values * state_bytes_per_value(1 << 20, name))
    if profile.kind == "gpu" and o.offload == "none":
        out["with_optim_offload_cpu"] = memory.tensors - state
    return out
