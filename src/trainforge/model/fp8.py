"""FP8 matmuls in the linear layers (``train.fp8``), through torchao's float8 training.

Each eligible ``nn.Linear`` becomes torchao's ``Float8Linear``: its three matmuls (output, input
gradient, weight gradient) take FP8 operands, scaled dynamically per tensor (``tensorwise``) or per
row (``rowwise``: closer to bf16, slower). The weights themselves, the optimizer state, norms,
attention and the loss stay as they were: the parameters and their state_dict keys are unchanged, so
checkpoints, resume and ``final/`` are the same files as a bf16 run's.

Not converted: the LM head (trainforge's fused loss reads its weight directly; torchao keeps the last
layer high-precision too), layers whose sides are not multiples of 16 (FP8 tensor cores need them), and
anything that is not exactly ``nn.Linear`` (4-bit bases, adapters). LoRA adapters wrap the converted
base layers: the frozen base runs in FP8, the small adapters in bf16.

FP8 tensor cores exist from compute capability 8.9 (Ada, Hopper, Blackwell). torchao's casts are
separate kernels unless compiled, so the gain needs ``train.compile`` (torchao's own guidance). On a
CPU, torch emulates the FP8 matmuls: slower than bf16, for checking a config and in tests.
"""

from __future__ import annotations

import functools
import importlib.util
import types

import torch

from ..errors import TrainforgeError

RECIPES = ("tensorwise", "rowwise")
MIN_CAPABILITY = {"tensorwise": (8, 9), "rowwise": (9, 0)}  # FP8 tensor cores; row-wise scaled matmul from Hopper


class FP8Unavailable(TrainforgeError, ValueError):
    """``train.fp8`` cannot run here (no torchao, no bf16 compute, no FP8 tensor cores, a 4-bit base)."""


def fp8_recipe(setting: bool | str) -> str | None:
    """The torchao recipe ``train.fp8`` asks for: None (off), ``tensorwise`` (true) or the named one."""
    if setting is False:
        return None
    return "tensorwise" if setting is True else str(setting)


def resolve_fp8(setting: bool | str, device: torch.device, compute_dtype: torch.dtype | None, method: str) -> str | None:
    """The recipe this run takes for ``train.fp8: setting``, or None; refuses, naming the setting,
    what cannot run here."""
    recipe = fp8_recipe(setting)
    if recipe is None:
        return None
    if importlib.util.find_spec("torchao") is None:
        raise FP8Unavailable("train.fp8 needs torchao: pip install 'trainforge[gpu]' (or set train.fp8: false)")
    if compute_dtype is not torch.bfloat16:
        got = "fp32" if compute_dtype is None else str(compute_dtype).removeprefix("torch.")
        raise FP8Unavailable(
            f"train.fp8 computes everything but the linear layers' matmuls in bf16, and this run's precision is {got}: "
            "set train.precision: bf16 (or train.fp8: false)"
        )
    if method == "qlora":
        raise FP8Unavailable("train.fp8 converts bf16 linear layers; a qlora base is 4-bit: use model.method: lora or train.fp8: false")
    if device.type == "cuda":
        have, need = torch.cuda.get_device_capability(device), MIN_CAPABILITY[recipe]
        if have < need:
            raise FP8Unavailable(
                f"train.fp8: {recipe} needs FP8 tensor cores (compute capability {need[0]}.{need[1]}+: "
                f"{'Ada, Hopper' if need < (9, 0) else 'Hopper'} or newer); {torch.cuda.get_device_name(device)} is "
                f"{have[0]}.{have[1]}: set train.fp8: false" + (" or tensorwise" if recipe == "rowwise" and have >= (8, 9) else "")
            )
    elif device.type != "cpu":
        raise FP8Unavailable(f"train.fp8 runs on CUDA GPUs (and emulated on CPUs); this run is on {device.type}: set train.fp8: false")
    elif recipe == "rowwise" and not cpu_takes_rowwise_scales():
        raise FP8Unavailable(
            f"train.fp8: rowwise on a CPU needs torch's CPU scaled matmul to take per-row scales; torch "
            f"{torch.__version__} takes per-tensor scales only there: set train.fp8: tensorwise (or upgrade torch: 2.13 has it)"
        )
    return recipe


@functools.cache
def cpu_takes_rowwise_scales() -> bool:
    """Whether this torch's CPU ``_scaled_mm`` (what emulates FP8 there) takes per-row scales: torch 2.13's
    does, 2.11's asserts per-tensor. Asked of the op itself, with one 16 x 16 product."""
    fp8 = torch.float8_e4m3fn
    a, b = torch.ones(16, 16).to(fp8), torch.ones(16, 16).to(fp8).t()  # the second operand column-major, as cuBLAS wants
    try:
        torch._scaled_mm(a, b, scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16)
    except Exception:  # noqa: BLE001 - a probe: however this torch refuses the scales (2.11 asserts; others raise ValueError)
        return False
    return True


def apply_fp8(model: torch.nn.Module, recipe: str) -> int:
    """Convert ``model``'s eligible linear layers (see the module's docstring) to torchao's FP8 training
    layers with ``recipe``; returns how many were converted."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None

    def eligible(module: torch.nn.Module, name: str) -> bool:
        return (
            type(module) is torch.nn.Linear  # exactly: not a 4-bit or adapter subclass
            and module is not head
            and module.in_features % 16 == 0
            and module.out_features % 16 == 0
        )

    before = sum(1 for m in model.modules() if type(m) is torch.nn.Linear)
    convert_to_float8_training(model, module_filter_fn=eligible, config=Float8LinearConfig.from_recipe_name(recipe))
    for module in model.modules():
        if type(module).__name__ == "Float8Linear":
            module.register_forward_pre_hook(_autocast_input)
            module.forward = types.MethodType(_token_aligned_forward, module)
    return before - sum(1 for m in model.modules() if type(m) is torch.nn.Linear)


TOKEN_ALIGN = 16
"""The weight gradient's FP8 matmul contracts over the batch's tokens, and CUDA's ``_scaled_mm`` needs
inner dimensions in multiples of 16 (torchao pads only with ``pad_inner_dim``, which copies every
operand even when aligned)."""


def pads_tokens(x: torch.Tensor) -> bool:
    """Whether ``x``'s token count must be a multiple of ``TOKEN_ALIGN``: on CUDA; the CPU emulation takes any."""
    return x.is_cuda


def _token_aligned_forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """An FP8 layer's ``forward``, with the tokens of an input whose count is not a multiple of
    ``TOKEN_ALIGN`` (an odd micro-batch of rows padded to 8, a max_length of 8 x odd, an OOM back-off to
    one row) padded by zero rows, cut off the output again: zero rows add nothing to the weight gradient.
    Bound to the layer as a method, so a deep copy (a preference run's frozen reference) binds to the copy."""
    forward = type(self).forward
    tokens = x.numel() // x.shape[-1]
    if tokens % TOKEN_ALIGN == 0 or not pads_tokens(x):
        return forward(self, x)
    flat = torch.nn.functional.pad(x.reshape(tokens, x.shape[-1]), (0, 0, 0, -tokens % TOKEN_ALIGN))
    return forward(self, flat)[:tokens].reshape(*x.shape[:-1], -1)


def _autocast_input(module: torch.nn.Module, args: tuple) -> tuple | None:
    """Cast a layer's input to the autocast dtype of its own device. torchao's layer does this for CUDA's
    autocast only; without it a CPU run (and a plan's trace, on fake CPU tensors) would feed and keep
    fp32 activations where a GPU run keeps bf16 ones."""
    x = args[0]
    device = x.device.type
    if device != "cuda" and torch.is_autocast_enabled(device):
        return (x.to(torch.get_autocast_dtype(device)), *args[1:])
    return None
