"""Fused Triton kernels from Liger Kernel on CUDA: RMSNorm, RoPE, SwiGLU and the fused linear cross-entropy.

``train.kernels: auto`` takes them on CUDA when liger-kernel is installed (``pip install
'trainforge[gpu]'``); ``torch`` keeps PyTorch's ops everywhere. The model's layers are swapped through
Liger's own per-architecture functions (never its loss or ``forward`` patches: trainforge computes the
loss itself, over target positions only). Liger's RoPE replaces the architecture's module-level
``apply_rotary_pos_emb``, so it holds for every model of that architecture in the process.
The LM head is marked, and ``engine/loss.py`` then computes the loss with Liger's fused linear
cross-entropy instead of trainforge's chunked torch loss, which stays the CPU path.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import sys
from collections.abc import Callable
from typing import Any

import torch

from ..errors import TrainforgeError
from ..hardware.device import fp32_out_addmm_in

LIGER_LOSS = "trainforge_liger_loss"  # attribute set on an LM head whose loss goes through Liger
# every layer kernel a Liger apply function takes: Gemma's MLP is GEGLU, Gemma 3's vision tower has
# LayerNorms, Nemotron-H squares ReLUs; each architecture swaps in those its function defaults on
LAYER_KERNELS = ("rms_norm", "layer_norm", "rope", "swiglu", "geglu", "relu_squared")


class KernelsUnavailable(TrainforgeError, ValueError):
    """``train.kernels: liger`` cannot run here (not installed, or no CUDA)."""


def liger_installed() -> bool:
    return importlib.util.find_spec("liger_kernel") is not None


def triton_interpreted() -> bool:
    """Triton kernels run in its CPU interpreter (``TRITON_INTERPRET=1``): slow, for tests only."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def resolve_kernels(requested: str, device_type: str) -> str:
    """``liger`` or ``torch`` for ``train.kernels: requested`` on a device of ``device_type``."""
    if requested == "torch":
        return "torch"
    if requested == "auto":
        return "liger" if device_type == "cuda" and liger_installed() else "torch"
    if not liger_installed():
        raise KernelsUnavailable("train.kernels: liger needs liger-kernel: pip install 'trainforge[gpu]' (or set train.kernels: auto)")
    if device_type != "cuda" and not triton_interpreted():
        raise KernelsUnavailable(
            f"train.kernels: liger runs Triton kernels on CUDA GPUs; this run is on {device_type}: set train.kernels: auto or torch"
        )
    return "liger"


def liger_apply_function(model_type: str | None) -> tuple[Callable | None, list[str]]:
    """Liger's function that patches an architecture (None where it has none), and which of
    ``LAYER_KERNELS`` it swaps in for that architecture."""
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    apply = MODEL_TYPE_TO_APPLY_LIGER_FN.get(model_type)
    if apply is None:
        return None, []
    params = inspect.signature(apply).parameters
    # Liger's own defaults say which kernels hold for the architecture: it refuses rope=True for GLM-4
    # and Qwen3.5 (NotImplementedError) and defaults it off where its RoPE does not match the model's
    return apply, [k for k in LAYER_KERNELS if k in params and params[k].default is True]


_TORCH_NAMES: dict[str, dict[str, object]] = {}
"""Per transformers modeling module Liger patched in this process: the names it replaced, as they were."""


# config fields by which a causal LM scales lm_head's output before its loss, away from 1 (None: unset)
# (Inkling divides the hidden state by ``logits_mup_width_multiplier``: the same to a linear head)
LOGIT_SCALES = ("logits_scaling", "lm_head_multiplier", "output_multiplier", "logits_mup_width_multiplier")


def transforms_logits(config: Any) -> bool:
    """The model changes ``lm_head``'s output before its loss: Gemma 2's and RecurrentGemma's soft-capping, Cohere's ``logit_scale``,
    Granite's ``logits_scaling`` (HyperCLOVAX multiplies by it), Falcon-H1's ``lm_head_multiplier``, or such a field
    of a multimodal model's ``text_config``. A fused head (trainforge's or Liger's) would compute another loss, so
    such models take their own head (``engine/head_exact.py`` finds the rest on a probe; these fields also tell a plan,
    which cannot probe, and Liger's marking)."""
    for c in (config, getattr(config, "text_config", None)):
        if c is None:
            continue
        if any(getattr(c, name, None) for name in ("final_logit_softcapping", "logits_soft_cap", "logit_scale")):
            return True
        if any(getattr(c, name, None) not in (None, 1) for name in LOGIT_SCALES):
            return True
    return False


def apply_liger(model: torch.nn.Module, warn: Callable[[str], None] = lambda _: None) -> list[str]:
    """Swap this model's RMSNorm, RoPE and SwiGLU for Liger's (architectures Liger knows), and mark a
    plain linear LM head for Liger's fused linear cross-entropy. Returns the kernels now in use."""
    model_type = getattr(model.config, "model_type", None)
    apply, used = liger_apply_function(model_type)
    if apply is None:
        warn(f"kernels: Liger has no layer kernels for {model_type!r}; its layers stay PyTorch's")
    else:
        params = inspect.signature(apply).parameters
        wanted = {k: k in used for k in LAYER_KERNELS} | {"cross_entropy": False, "fused_linear_cross_entropy": False}
        module = sys.modules[type(model).__module__]
        before = dict(vars(module))
        apply(model=model, **{k: v for k, v in wanted.items() if k in params})
        replaced = {k: v for k, v in before.items() if vars(module).get(k) is not v}
        saved = _TORCH_NAMES.setdefault(module.__name__, {})
        for name, original in replaced.items():
            saved.setdefault(name, original)  # the first originals win: a later apply's "before" is Liger's
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if type(head) is torch.nn.Linear and not transforms_logits(model.config):  # else the model's own head takes the loss
        setattr(head, LIGER_LOSS, True)
        used.append("fused_linear_cross_entropy")
        keep_liger_off_fp32_out_addmm()
    return used


def restore_torch_layers() -> None:
    """Put back the transformers names Liger replaced at module level in this process (its RoPE function,
    norm and MLP classes), so a model built with ``train.kernels: torch`` after a Liger one is PyTorch's
    throughout (a second run in one process, selftest's comparison). A Liger model still alive keeps its
    swapped modules but computes RoPE with PyTorch's function again: the same numbers."""
    for name, originals in _TORCH_NAMES.items():
        module = sys.modules.get(name)
        for attr, value in originals.items() if module is not None else ():
            setattr(module, attr, value)


def keep_liger_off_fp32_out_addmm() -> bool:
    """Liger's fused loss accumulates the head's weight gradient with ``addmm(..., out_dtype=fp32)`` into an
    fp32 buffer on every torch from 2.8, but torch's CUDA kernel refuses an fp32 accumulator beside bf16
    operands until 2.10 (``hardware.fp32_out_addmm_in``): there Liger is sent down its own general path
    (its module flag, where this Liger has it). Returns whether the flag was turned off."""
    from liger_kernel.ops import fused_linear_cross_entropy as flce

    if fp32_out_addmm_in() or not getattr(flce, "_ADDMM_SUPPORTS_OUT_DTYPE", False):
        return False
    flce._ADDMM_SUPPORTS_OUT_DTYPE = False
    return True


def uses_liger_loss(head: torch.nn.Module, hidden: torch.Tensor) -> bool:
    """The loss of ``head`` goes through Liger: the head was marked and the kernel can run on ``hidden``."""
    return getattr(head, LIGER_LOSS, False) and (hidden.is_cuda or triton_interpreted())


def liger_linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor, compute_dtype: torch.dtype,
    ignore_index: int,
) -> torch.Tensor:
    """Sum of cross-entropy over ``labels != ignore_index`` through Liger's fused linear cross-entropy,
    as an fp32 scalar: matmuls in ``compute_dtype``, gradient accumulators in fp32. The head's weight
    gradient, accumulated in fp32 inside Liger, reaches the fp32 master weight through the cast below:
    rounded once to ``compute_dtype`` (trainforge's chunked path keeps it fp32 throughout). Only the
    target positions are handed over, so prompt and padding positions never get logits."""
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    keep = (labels != ignore_index).nonzero().flatten()
    if len(keep) == 0:  # no target in this micro-batch: a zero that still carries a gradient path
        return (hidden.sum() * 0.0).float()
    h, y = hidden.index_select(0, keep).to(compute_dtype), labels.index_select(0, keep)
    w = weight.to(compute_dtype)  # cast once per call; the gradient flows back to the fp32 master weight
    b = bias.to(compute_dtype) if bias is not None else None
    with torch.autocast(hidden.device.type, enabled=False):  # dtypes are explicit here
        loss = liger_fused_linear_cross_entropy(h, w, y, b, reduction="sum", accum_dtype=torch.float32)
    return loss.float()
