"""How far each precision may depart from fp32 (measured, and why), and the relative gap they bound."""

from __future__ import annotations

# Largest gaps measured over the whole matrix (8 steps, hidden 32, AdamW at lr 3e-3 full / 5e-3
# LoRA; AMD EPYC CPU with AVX512-BF16, fp16 emulated; torch 2.13), relative to the fp32 run:
#                     loss (every step)   pre-clip grad norm (every step)
#   bf16              1.9e-3              1.1e-2
#   fp16              9e-5                1.2e-3
# bf16 keeps 8 significant bits (unit roundoff 2^-8 = 3.9e-3), fp16 11 (4.9e-4). Under autocast
# only the matmuls round; the loss, softmax statistics, norms and the AdamW update stay fp32, so
# step 1's loss differs by ~1e-4 and the gap grows only as rounding differences move the weights
# apart over the steps (AdamW normalizes each update, so a tiny gradient difference can flip the
# sign of a near-zero coordinate's update: the grad norm diverges faster than the loss).
# The tolerances are 5-10x the worst gap measured (other CPUs, GPU kernels and TF32 "fp32" on
# Ampere+ round differently), and far below what a precision bug does:
#   - a loss or gradient scaled wrong (a wrong token count, a loss divided twice): gaps >= 50%
#   - gradients left scaled by the GradScaler: AdamW is nearly scale-invariant and clipping hides
#     the size, so the loss barely moves; the pre-clip grad norm is off by the scale (2^16)
#   - a loss or reduction accumulated in bf16 instead of fp32: a sum of ~500 token losses of ~5
#     has a bf16 ulp of 16 (2^-8 x 4096): gaps of several percent
#   - an fp16 overflow let through: inf/NaN (finiteness check); not skipped and backed off by the
#     scaler: its saved scale does not match the overflows counted (exact check)
LOSS_TOL = {"fp32": 1e-5, "bf16": 1e-2, "fp16": 1e-3}
GRAD_NORM_TOL = {"fp32": 1e-4, "bf16": 5e-2, "fp16": 1e-2}
# Fused vs standard head, per tensor ||g_fused - g_std|| / ||g_std|| and the loss, on one batch
# from the same weights: both paths round the same products (logits in the compute dtype, softmax
# and loss in fp32) and differ only in summation order and chunking. Measured: fp32 2e-6, bf16
# 7e-6, fp16 5e-4. Tolerance: a few ulps of the compute dtype (bf16 1e-2 ~ 2.5 ulp), what two
# GEMM algorithms for the same product may disagree by; a wrong factor or a lost term is >= 1e-1.
HEAD_GRAD_TOL = {"fp32": 1e-5, "bf16": 1e-2, "fp16": 5e-3}
# Packed rows vs each document alone: max |logit difference| / max |reference logit|, the packed
# rows under the precision, the reference in fp32 (flash-attention: in the half dtype). Measured:
# fp32 4e-7, bf16 9e-3, fp16 1e-3 (the whole 2-layer model's rounding). A document that attends to
# its neighbour gives ~1 (the check measures that too and requires it to stand out).
# A preference step (packed pairs, fused head, the reference as LoRA adapters off) against each document alone
# through the model's own logits, both in the precision: relative gaps of the loss and of every gradient's norm.
# Measured on CPU: fp32 2e-5, bf16 4e-2, fp16 5e-3 (DPO, SimPO, KTO; a pairing or reference bug gives ~1).
PREFERENCE_TOL = {"fp32": 1e-4, "bf16": 1e-1, "fp16": 3e-2}
ATTENTION_TOL = {"fp32": 1e-5, "bf16": 3e-2, "fp16": 5e-3}
# A GRPO step (packed completions, fused head, the reference recorded packed) against each completion alone through
# the model's own logits, both in the precision: relative gaps of the loss and of every gradient's norm, per loss.
# Measured on CPU (grpo, dr_grpo, dapo, gspo): fp32 5.5e-6, bf16 4.1e-2, fp16 1.2e-2 (fp16 is no selftest row: its
# figure bounds "fp32" under TF32 on a GPU). Advantages shifted by one completion gave 4 (fp32); the reference's
# values spread onto the wrong completions 3e2 (bf16).
GRPO_TOL = {"fp32": 1e-4, "bf16": 2e-1, "fp16": 5e-2}
# FP8 linear layers (tensorwise e4m3 forward, e5m2 gradients; 3 and 2 mantissa bits) against bf16 on the
# same weights, one step on packed rows, relative gaps of the loss and of every gradient's norm.
# Measured on CPU (torch's emulated FP8 matmuls): loss 2.5e-5, gradients 1.1e-1 (e4m3 keeps 3 mantissa bits:
# unit roundoff 2^-4 = 6% per element). A missing or wrong scale gives ~1 or an overflow to inf.
FP8_TOL = 0.3
# trainforge's MoE step (model.experts_implementation: auto, the router's aux term) against transformers' eager experts
# with output_router_logits, same weights, one step on ~500 tokens: relative gaps of the cross-entropy, the aux loss and
# every gradient's norm. Measured on CPU (auto: grouped_mm), Qwen2-MoE with a shared expert, 8 batches: fp32 1.3e-6
# (full and LoRA), bf16 LoRA 9.7e-3 (both paths multiply the bf16 base's expert weights). fp16 stands for fp32 under
# TF32 on a GPU. One of the top-k experts' terms dropped from the grouped path gives 0.32-0.39; the aux term left out
# of the gradient ~1.
MOE_TOL = {"fp32": 1e-5, "bf16": 5e-2, "fp16": 5e-2}
# bf16 full fine-tune where the chosen path multiplies the fp32 master weights unrounded (grouped_mm on a CPU: torch's
# grouped GEMM is no autocast op) while eager's per-expert linear gets autocast's bf16: the gap is eager's own rounding,
# measured 5.1e-2 (7.1e-2 on ~1000 tokens), largest on the norms' and routers' gradients (sums whose terms cancel)
# and where rounding flips a router's near tie; with eager's experts kept in fp32 it is 9.8e-3. The fp32 row checks
# the same path at 1e-5.
MOE_MASTERS_TOL = 2e-1
MIN_DECREASE = 0.05  # the eval loss after training must be at least 5% below the one before
# Resume on CUDA: kernels such as the embedding backward add with atomics in no fixed order, so
# two identical runs differ in the last bits; bitwise equality is promised (and checked) on CPU.
CUDA_RESUME_TOL = 1e-3  # max |weight difference| / max |weight|


def relative_gap(values: list[float], reference: list[float]) -> float:
    return max((abs(v - r) / max(abs(r), 1e-12) for v, r in zip(values, reference)), default=0.0)


def fmt_values(values: list[float]) -> str:
    return "[" + ", ".join(f"{v:.4f}" for v in values) + "]"
