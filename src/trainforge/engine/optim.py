"""The optimizer: AdamW with decay only on matrices, in full precision or with low-bit / paged / offloaded state.

``optim.name`` picks the implementation, all maintained libraries' (see ``OPTIMIZERS``):
- ``adamw``: torch's AdamW, fused where the build has a fused kernel; fp32 state, 8 bytes per
  trainable parameter;
- ``adamw_8bit`` / ``paged_adamw_8bit`` / ``paged_adamw``: bitsandbytes' block-wise 8-bit AdamW
  (~2 bytes per parameter), and its paged variants, whose state lives in CUDA unified memory and
  is paged to the host under memory pressure instead of running out (on a CPU it is plain memory);
- ``adamw_4bit``: torchao's 4-bit AdamW (~1 byte per parameter);
and ``optim.offload: cpu`` keeps AdamW's state and step on the host (torchao's ``CPUOffloadOptimizer``,
one CUDA process): no optimizer state on the GPU, at the price of moving gradients and weights over
PCIe every step. Low-bit states keep tensors under 4,096 values in fp32, as both libraries do.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch

from ..config.run import OptimSettings
from ..errors import TrainforgeError


@dataclass(frozen=True)
class OptimizerKind:
    library: str  # the package that implements it ("torch" needs nothing)
    state_bits: int  # bits per value of each of AdamW's two moments
    block: int  # values sharing one fp32 scale (0: no scales)
    paged: bool = False
    extra: str = ""  # pip extra that installs the library


OPTIMIZERS = {
    "adamw": OptimizerKind("torch", 32, 0),
    "adamw_8bit": OptimizerKind("bitsandbytes", 8, 256, extra="lowmem"),
    "paged_adamw_8bit": OptimizerKind("bitsandbytes", 8, 256, paged=True, extra="lowmem"),
    "paged_adamw": OptimizerKind("bitsandbytes", 32, 0, paged=True, extra="lowmem"),
    "adamw_4bit": OptimizerKind("torchao", 4, 128, extra="lowmem"),
}
MIN_QUANTIZED = 4096  # smaller tensors keep fp32 state (bitsandbytes' min_8bit_size, torchao's threshold)


class OptimizerUnavailable(TrainforgeError, ValueError):
    """The configured optimizer cannot run here: its library is missing, or not on this device or mode."""


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Decay weight matrices and embeddings; never norms and biases (1-D tensors)."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def check_optimizer(cfg: OptimSettings, device_type: str, distributed: str | None) -> None:
    """Refuse, with the setting to change, what cannot run on ``device_type`` under ``distributed``
    (None, ``ddp`` or ``fsdp``): a missing library, offload without a GPU or beside other processes,
    bitsandbytes' optimizers on FSDP2's sharded (DTensor) parameters."""
    kind = OPTIMIZERS[cfg.name]
    if kind.library != "torch" and importlib.util.find_spec(kind.library) is None:
        raise OptimizerUnavailable(f"optim.name: {cfg.name} needs {kind.library}: pip install 'trainforge[{kind.extra}]'")
    if cfg.offload == "cpu":
        if device_type != "cuda":
            raise OptimizerUnavailable(
                f"optim.offload: cpu moves the optimizer state off a GPU; this run is on {device_type}, where it "
                "already lives in host memory: set optim.offload: none"
            )
        if distributed:
            raise OptimizerUnavailable(
                "optim.offload: cpu is for one GPU (torchao's CPUOffloadOptimizer); under torchrun use "
                "train.distributed: fsdp, which shards the state over the processes, and optim.offload: none"
            )
        if importlib.util.find_spec("torchao") is None:
            raise OptimizerUnavailable("optim.offload: cpu needs torchao: pip install 'trainforge[lowmem]'")
    if distributed == "fsdp" and kind.library == "bitsandbytes":
        raise OptimizerUnavailable(
            f"optim.name: {cfg.name} (bitsandbytes) does not take FSDP2's sharded parameters; with "
            "train.distributed: fsdp use adamw (its state is sharded already) or adamw_4bit (torchao), or use ddp"
        )


def build_optimizer(model: torch.nn.Module, cfg: OptimSettings, device: torch.device) -> torch.optim.Optimizer:
    """The optimizer ``cfg`` names over the model's trainable parameters (decay on matrices only)."""
    groups = param_groups(model, cfg.weight_decay)
    kwargs = dict(lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)
    if cfg.offload == "cpu":
        from torchao.optim import CPUOffloadOptimizer

        # state and step on the host (fused CPU AdamW); gradients stay on the GPU for accumulation
        return CPUOffloadOptimizer(groups, torch.optim.AdamW, **kwargs)
    if cfg.name == "adamw":
        if device.type in ("cuda", "cpu"):
            try:  # one fused kernel for all parameters instead of a chain of per-tensor ops
                return torch.optim.AdamW(groups, fused=True, **kwargs)
            except (RuntimeError, TypeError):
                pass
        return torch.optim.AdamW(groups, foreach=True, **kwargs)
    if OPTIMIZERS[cfg.name].library == "bitsandbytes":
        import bitsandbytes as bnb

        cls = {"adamw_8bit": bnb.optim.AdamW8bit, "paged_adamw_8bit": bnb.optim.PagedAdamW8bit, "paged_adamw": bnb.optim.PagedAdamW}
        return cls[cfg.name](groups, min_8bit_size=MIN_QUANTIZED, **kwargs)
    from torchao.optim import AdamW4bit

    return AdamW4bit(groups, **kwargs)


def state_bytes_per_value(numel: int, name: str) -> float:
    """Optimizer-state bytes per trainable value of a tensor of ``numel`` values: AdamW's two moments
    at the kind's bits, plus an fp32 scale per block; fp32 below ``MIN_QUANTIZED`` values (and, for
    torchao, when the block does not divide the tensor)."""
    kind = OPTIMIZERS[name]
    if kind.state_bits == 32 or numel < MIN_QUANTIZED or (kind.library == "torchao" and numel % kind.block):
        return 8.0
    return 2 * (kind.state_bits / 8 + 4 / kind.block)


def optimizer_state_bytes(params: list[torch.Tensor], cfg: OptimSettings) -> tuple[int, int]:
    """(device bytes, host bytes) of the optimizer state of ``params``: on the host when offloaded."""
    total = int(sum(p.numel() * state_bytes_per_value(p.numel(), cfg.name) for p in params))
    return (0, total) if cfg.offload == "cpu" else (total, 0)


def describe_optimizer(cfg: OptimSettings) -> str:
    """``adamw_8bit (bitsandbytes, 8-bit state)`` and the like, for the console."""
    kind = OPTIMIZERS[cfg.name]
    state = "fp32 state" if kind.state_bits == 32 else f"{kind.state_bits}-bit state"
    parts = [kind.library, state] + (["paged"] if kind.paged else []) + (["offloaded to host"] if cfg.offload == "cpu" else [])
    return f"{cfg.name} ({', '.join(parts)})"


def offloaded(optimizer) -> bool:
    """torchao's ``CPUOffloadOptimizer`` (``optim.offload: cpu``): host optimizers per large tensor, gradients
    copied to the host during backward, no ``state`` or ``defaults`` of its own."""
    return hasattr(optimizer, "optim_dict")


def measured_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes the optimizer's state holds now: through bitsandbytes' nested dicts and torchao's tensor
    subclasses to the tensors they store (step counts and shared quantization tables left out)."""

    def size(value) -> int:
        if isinstance(value, dict):
            return sum(size(v) for k, v in value.items() if not str(k).startswith("qmap"))
        if not torch.is_tensor(value):
            return 0
        if type(value) is not torch.Tensor and hasattr(value, "__tensor_flatten__"):
            names, _ = value.__tensor_flatten__()
            return sum(size(getattr(value, n)) for n in names if n != "qmap")
        return value.numel() * value.element_size()

    optimizers = [optimizer]
    if offloaded(optimizer):  # the state is its host optimizers' (and its device one's, for small tensors;
        # None when every tensor is large enough to offload)
        optimizers = [o for o in (optimizer.d_opt, *optimizer.optim_dict.values()) if o is not None]
    return sum(size(v) for opt in optimizers for s in opt.state.values() for k, v in s.items() if k != "step")


def clip_gradients(params, optimizer: torch.optim.Optimizer, max_norm: float | None) -> torch.Tensor:
    """Clip the global gradient norm to ``max_norm`` (None: only measure it); returns the pre-clip norm.

    torchao's CPUOffloadOptimizer copies each gradient to the host on its own stream during backward (a
    hook), so the clip must neither scale a device gradient a copy still reads nor leave the host copies
    (what its host AdamW steps with) unclipped: the clip waits for the copies, then the host copies
    are scaled by the same coefficient."""
    if offloaded(optimizer):
        getattr(torch, optimizer.device).current_stream().wait_stream(optimizer.stream)
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm else float("inf"))
    if offloaded(optimizer) and max_norm:
        coef = float((max_norm / (grad_norm.float() + 1e-6)).clamp(max=1.0))  # a host sync: the host step waits anyway
        for p, copied in optimizer.queue.items():
            copied.synchronize()
            optimizer.param_d2h_map[p].grad.mul_(coef)
    return grad_norm
