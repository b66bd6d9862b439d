"""A rough memory model of a run: weights, gradients, AdamW state, activations; warn before it fails."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...hardware.device import Precision

GIB = 1024**3
REFUSE_FACTOR = 2.0
"""``train`` refuses, before loading the model, a run whose rough estimate exceeds the device's memory this many
times over (between 1x and this, it warns): the estimate is rough, never this far off."""
FUSED_LOSS_ROWS = 4096  # the fused loss's largest chunk of target positions (loss.CHUNK): its logits are all it holds


def mlp_width(config, hidden: int) -> int:
    """The widest MLP intermediate of a config: ``intermediate_size`` is one width, or one per layer (Gemma 3n's
    checkpoints list one for every layer); 4 x hidden where the config has none."""
    inter = getattr(config, "intermediate_size", None)
    if isinstance(inter, (list, tuple)):
        inter = max(inter, default=None)
    return int(inter or 4 * hidden)


@dataclass(frozen=True)
class MemoryEstimate:
    weights: int
    grads: int
    optimizer: int
    activations: int

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer + self.activations

    def describe(self) -> str:
        parts = ("weights", "grads", "optimizer", "activations")
        return f"{self.total / GIB:,.2f} GiB (" + ", ".join(f"{p} {getattr(self, p) / GIB:,.2f}" for p in parts) + ")"


def estimate_memory(
    model: torch.nn.Module, micro_batch_size: int, seq_len: int, precision: Precision,
    activation_checkpointing: bool = False, fused_loss: bool = False,
) -> MemoryEstimate:
    """Bytes a training step needs at its peak, roughly (no fragmentation, no framework overhead).

    Activations kept for backward per token and layer: about 9 hidden-size vectors (norms,
    q/k/v, attention output, residuals) and 4 intermediate-size ones (gate, up, activation,
    product), in the compute dtype; plus fp32 logits and their gradient over the vocabulary.
    ``activation_checkpointing``: each layer keeps only its input, and one layer at a time
    recomputes the rest; ``fused_loss``: logits exist for one chunk of positions at a time.
    """
    c = getattr(model, "config", None)
    hidden = getattr(c, "hidden_size", 0)
    inter = mlp_width(c, hidden)
    layers = getattr(c, "num_hidden_layers", 0)
    vocab = getattr(c, "vocab_size", 0)
    trainable = [p for p in model.parameters() if p.requires_grad]
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    grads = sum(p.numel() * p.element_size() for p in trainable)
    optimizer = 2 * sum(p.numel() * 4 for p in trainable)  # AdamW: exp_avg and exp_avg_sq in fp32
    act_bytes = 4 if precision.autocast_dtype is None else 2
    tokens = micro_batch_size * seq_len
    layer = act_bytes * (9 * hidden + 4 * inter)
    kept = layers * act_bytes * hidden + layer if activation_checkpointing else layers * layer
    logits = vocab * 8 * (min(tokens, FUSED_LOSS_ROWS) if fused_loss else tokens)
    activations = tokens * kept + logits
    return MemoryEstimate(weights, grads, optimizer, activations)


def memory_warning(estimate: MemoryEstimate, available: int | None, device: torch.device) -> str | None:
    """A warning when what the run still has to allocate exceeds what ``device`` has free, else None.

    Called once the model is loaded: its weights already sit in memory, so only the rest
    has to fit into ``available``.
    """
    if available is None or estimate.total - estimate.weights <= available:
        return None
    where = "free on the GPU" if device.type == "cuda" else "available in system memory"
    return (
        f"this run may not fit: estimated memory {estimate.describe()} exceeds the {available / GIB:.2f} GiB {where}; "
        "lower train.micro_batch_size (raise train.grad_accum to keep the global batch) or data.max_length, "
        "or use model.method: lora"
    )


def memory_refusal(estimate: MemoryEstimate, capacity: int | None, where: str, at: str, fixes: list[str]) -> str | None:
    """Why a run whose rough ``estimate`` (``at``: the settings it assumes) exceeds ``capacity`` (the device's
    memory, ``where``) more than ``REFUSE_FACTOR`` times over cannot run, and ``fixes``; None when it may start
    (``memory_warning`` covers 1x-2x)."""
    if not capacity or estimate.total <= REFUSE_FACTOR * capacity:
        return None
    return (
        f"this run cannot fit: estimated memory {estimate.describe()} {at} is {estimate.total / capacity:,.1f}x the "
        f"{capacity / GIB:.1f} GiB of {where}; refused before loading the model (above {REFUSE_FACTOR:g}x; between "
        f"1x and {REFUSE_FACTOR:g}x a run starts with a warning). To fit: " + "; ".join(fixes)
        + ". `trainforge plan CONFIG` shows the prediction part by part"
    )
