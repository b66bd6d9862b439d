"""What plan says about the kernels a run would use on the planned hardware: attention,
``train.kernels`` (Liger's Triton kernels) and ``train.fp8`` (torchao's FP8 linear layers)."""

from __future__ import annotations

from typing import Any

import torch

from ..config.run import RunConfig
from ..engine.predict.timing import document_attention_share
from ..hardware.device import Precision
from ..model.fp8 import fp8_recipe
from ..hardware.profiles import FP8_TENSOR_CORES, HardwareProfile

# packed rows: attention within each document only (packed_sdpa: documents batched by length, on a CPU)
DOCUMENT_KERNELS = ("varlen", "flex", "flash_attention_2", "packed_sdpa")


def kernels_choice(cfg: RunConfig, device: torch.device | None, profile: HardwareProfile | None) -> str:
    """What ``train.kernels`` resolves to on the planned hardware (a GPU profile: as it would on that GPU)."""
    from ..model.kernels import liger_installed

    requested = cfg.train.kernels
    if device is not None or profile is None or profile.kind != "gpu":
        return requested if requested != "auto" else "torch"
    if requested != "auto":
        return requested
    here = "installed here" if liger_installed() else "not installed here"
    return f"liger where liger-kernel is installed ({here}; pip install 'trainforge[gpu]'), else torch"


def fp8_decision(cfg: RunConfig) -> dict[str, str] | None:
    """The plan's ``fp8`` row when ``train.fp8`` is on."""
    if not cfg.train.fp8:
        return None
    return {"setting": "fp8", "choice": str(fp8_recipe(cfg.train.fp8)), "why": "train.fp8: the linear layers' matmuls in FP8 "
            "(torchao), traced as they run eagerly: matmuls at the FP8 rate, each scale and cast a kernel of its own "
            "(train.compile fuses them; the plan does not model that)"}


def fp8_uncompiled(cfg: RunConfig) -> tuple[str, str] | None:
    """(message, fix) when ``train.fp8`` runs eagerly: torchao's scales and casts are kernels of their own."""
    if not cfg.train.fp8 or cfg.train.compile is not False:
        return None
    return ("train.fp8 with train.compile: false: torchao's scales and casts run as separate kernels, which can cost "
            "more than the FP8 matmuls save (this plan prices them so)", "set train.compile: true (or auto)")


def fp8_problem(cfg: RunConfig, precision_name: str, profile: HardwareProfile) -> tuple[str, str] | None:
    """(message, fix) when ``train.fp8`` cannot run as planned: no bf16 compute, or a GPU without FP8 tensor cores."""
    if not cfg.train.fp8:
        return None
    if precision_name != "bf16":
        return (f"train.fp8 runs around bf16 compute, and this plan's precision is {precision_name}",
                "set train.precision: bf16 (on hardware with bf16), or train.fp8: false")
    if profile.kind == "gpu" and profile.name not in FP8_TENSOR_CORES:
        return (f"train.fp8: {profile.title} has no FP8 tensor cores (compute capability 8.9+: Ada, Hopper, Blackwell)",
                "set train.fp8: false")
    return None


def planned_attention(cfg: RunConfig, precision: Precision, device: torch.device | None, profile: HardwareProfile | None) -> str:
    """The attention implementation the run would take here, as the config spells it."""
    from ..model import doc_attention
    from ..model.load import attention_implementation

    encoder_decoder, half = cfg.model.kind.encoder_decoder, precision.autocast_dtype is not None
    if device is not None or encoder_decoder:
        attn = attention_implementation(cfg.model.attention, device or torch.device("cpu"), half, encoder_decoder,
                                        cfg.model.kind.model_type)
    elif profile is not None and profile.kind == "gpu":  # a GPU profile: bf16 support marks sm80+ (Ampere and newer)
        attn = doc_attention.choose(cfg.model.attention, "cuda", (8, 0) if profile.bf16 else (7, 0), half, True)
    else:
        attn = cfg.model.attention
    return attn.removeprefix("trainforge_")  # trainforge_packed_sdpa -> packed_sdpa, as the config spells it


def attention_share(cfg: RunConfig, precision: Precision, device: torch.device | None, profile: HardwareProfile, data: dict[str, Any]) -> float:
    """The part of the traced whole-row attention the run computes: a document-masked kernel on packed
    rows attends within each document (the prepared data's token-weighted mean length); every other kernel, all of it."""
    if cfg.data.packing is not True or not data.get("prepared") or not data.get("train_sequences"):
        return 1.0  # unpacked rows, or concat blocks (one stream, no document boundaries: whole-row attention)
    if planned_attention(cfg, precision, device, profile) not in DOCUMENT_KERNELS:
        return 1.0
    if data.get("train_token_squares") and data.get("train_tokens"):
        document_tokens = data["train_token_squares"] / data["train_tokens"]  # token-weighted: long documents cost more
    else:  # a token cache written before the squares were counted: the plain mean
        document_tokens = data["train_tokens"] / data["train_sequences"]
    return document_attention_share(document_tokens, cfg.data.max_length)
