"""The ``train`` section of a run config: steps, batch, precision, evaluation, what runs on the device;
and how grad_accum and max_steps resolve from it."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from .base import MAX_ROWS, MAX_STEPS, Section
from .errors import ConfigError
from .preference import OBJECTIVES


class TrainSettings(Section):
    objective: Literal[OBJECTIVES] = Field(
        "sft",
        description="sft: next-token cross-entropy on the learned tokens; dpo, ipo, orpo, simpo: preference tuning on "
        "chosen/rejected pairs; kto: on completions labelled desirable or not (hyperparameters under preference; "
        "docs/preference.md)",
    )
    max_steps: int | None = Field(None, gt=0, le=MAX_STEPS, description="optimizer steps (or give epochs)")
    epochs: float | None = Field(None, gt=0, le=10**6, description="passes over the training data (or give max_steps)")
    micro_batch_size: int | Literal["auto"] = Field(
        8,
        description="rows per forward pass; auto: the largest the plan predicts fits in 90% of the device's "
        f"memory (see trainforge plan), at most global_batch_size / processes (> 0, <= {MAX_ROWS})",
    )
    grad_accum: int = Field(1, gt=0, le=MAX_ROWS, description="micro-batches per optimizer step")
    global_batch_size: int | None = Field(
        None, gt=0, le=MAX_ROWS * 16, description="rows per optimizer step over all processes; sets grad_accum to "
        "global_batch_size / (micro_batch_size x processes), which must divide it; a checkpoint then resumes on "
        "another number of processes (DDP)",
    )
    precision: Literal["auto", "bf16", "fp16", "fp32"] = Field(
        "auto", description="auto: bf16 where native, fp16 + loss scaling on older GPUs, else fp32"
    )
    activation_checkpointing: bool | Literal["auto"] = Field(
        "auto",
        description="recompute each decoder layer's activations in backward: less memory, ~1/3 more compute; "
        "auto: on only when the plan predicts the run does not fit without it",
    )
    tiled_mlp: bool | Literal["auto"] = Field(
        "auto",
        description="run each decoder layer's MLP over the sequence in tiles, each tile's intermediate recomputed in "
        "backward: the MLP keeps one tile's intermediate instead of the row's (long rows; Llama, Mistral, Qwen2/3, "
        "Gemma, Phi-3); auto: on only when the plan predicts the run does not fit without it (docs/long-context.md)",
    )
    activation_offload: bool | Literal["auto"] = Field(
        "auto",
        description="keep the checkpointed layers' inputs in host memory (pinned, copied on a side stream) instead of "
        "on the GPU; needs activation checkpointing (true turns it on); changes nothing on a CPU; auto: on only when "
        "the plan predicts the run does not fit without it (docs/long-context.md)",
    )
    compact_heap: bool | Literal["auto"] = Field(
        "auto",
        description="on a CPU (glibc), give every freed block of 1 MiB or more back to the system, so the process holds "
        "its live tensors and not the freed blocks of a step's many sizes (0.85 against 1.6 GiB at 13k tokens); a step "
        "5-25% slower; auto: on when the run needs activation checkpointing or the tiled MLP, or when its peak with "
        "glibc's default heap is predicted past 60% of memory (that heap can hold over 30% more at long rows; docs/long-context.md)",
    )
    fused_loss: bool = Field(
        True,
        description="LM head and cross-entropy fused and chunked over target positions only (no full logits "
        "tensor); false: the model's own head and a standard cross-entropy. Models whose head is not a plain "
        "linear layer (LoRA on the head, soft-capped logits) or whose logits are not that head over the decoder's "
        "output (ELECTRA, RoFormer: a probe of a few tokens, once per model) always take the standard path",
    )
    kernels: Literal["auto", "liger", "torch"] = Field(
        "auto",
        description="fused Triton kernels: liger (Liger Kernel's RMSNorm, RoPE, SwiGLU and fused linear "
        "cross-entropy; CUDA, pip install 'trainforge[gpu]'); torch: PyTorch's ops; auto: liger on CUDA when "
        "installed, else torch",
    )
    fp8: bool | Literal["tensorwise", "rowwise"] = Field(
        False,
        description="FP8 matmuls in the linear layers (torchao float8 training; weights, optimizer state, norms, "
        "attention and loss unchanged): true or tensorwise (per-tensor scales), rowwise (per-row scales: closer to "
        "bf16, slower); needs precision bf16 and a GPU with FP8 tensor cores (compute capability 8.9+; rowwise 9.0+), "
        "pays with train.compile; emulated (slow) on CPUs; pip install 'trainforge[gpu]' (docs/fp8.md)",
    )
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:\d+)?|mps)$", description="auto: CUDA when present, else CPU")
    cpu_threads: int | Literal["auto"] = Field(
        "auto",
        description="threads torch computes with on a CPU; auto: one per core, fewer while other work keeps cores busy "
        "(measured at the start and again at log steps: a thread on a busy core stalls every op), or OMP_NUM_THREADS "
        "where set; a number fixes the count (results can differ in the last bits between counts) (> 0, <= 1024)",
    )
    seed: int = Field(0, ge=0, lt=2**32, description="seeds initialization, data order, eval split and sampling")
    compile: bool | Literal["auto"] = Field(
        "auto",
        description="torch.compile the decoder; auto: after timing the first steps, only when the time "
        "it saves over the remaining steps exceeds the expected compile time",
    )
    eval_every: int | Literal["auto"] | None = Field(
        None, description="evaluate every N steps (always at start and end); auto: ten times over the run "
        f"(every max_steps / 10 steps); (> 0, <= {MAX_STEPS})",
    )
    eval_max_batches: int | Literal["auto"] | None = Field(
        "auto",
        description="eval batches per evaluation; auto: as many as keep all of the run's evaluations within 5% "
        f"of its training compute (at least one); null: all; (> 0, <= {MAX_STEPS})",
    )
    max_skipped_steps: int = Field(
        3,
        ge=1,
        le=MAX_STEPS,
        description="stop (exit code 3) after this many steps in a row skipped for a non-finite loss or grad norm",
    )
    distributed: Literal["auto", "ddp", "fsdp"] = Field(
        "auto",
        description="under torchrun: ddp (full replica per process) or fsdp (FSDP2, weights/grads/optimizer sharded); "
        "auto: ddp when weights+grads+optimizer state fit on one device, else fsdp",
    )
    dist_timeout_s: float = Field(
        600.0,
        gt=0,
        le=7 * 24 * 3600,
        description="under torchrun: a collective waiting longer than this for another process fails the job",
    )

    @field_validator("eval_every", "eval_max_batches")
    @classmethod
    def _eval_range(cls, v: int | str | None, info: ValidationInfo) -> int | str | None:
        if isinstance(v, int) and not 0 < v <= MAX_STEPS:
            unit = "steps" if info.field_name == "eval_every" else "batches"
            raise ValueError(f"must be a number of {unit} (> 0, <= {MAX_STEPS}), auto or null")
        return v

    @field_validator("fp8", mode="before")
    @classmethod
    def _fp8_choice(cls, v: object) -> object:
        if isinstance(v, str) and v.lower() in ("true", "false"):
            return v.lower() == "true"
        if not isinstance(v, bool) and v not in ("tensorwise", "rowwise"):
            raise ValueError("must be true (tensorwise), false, tensorwise or rowwise")
        return v

    @field_validator("cpu_threads")
    @classmethod
    def _thread_count(cls, v: int | str) -> int | str:
        if isinstance(v, int) and not 0 < v <= 1024:
            raise ValueError("must be auto or a number of threads (> 0, <= 1024)")
        return v

    @field_validator("micro_batch_size")
    @classmethod
    def _positive_batch(cls, v: int | str) -> int | str:
        if isinstance(v, int) and v <= 0:
            raise ValueError("must be a positive number of rows, or auto")
        if isinstance(v, int) and v > MAX_ROWS:
            raise ValueError(f"at most {MAX_ROWS} rows per forward pass")
        return v

    @model_validator(mode="after")
    def _one_length(self) -> "TrainSettings":
        if self.max_steps is not None and self.epochs is not None:
            raise ValueError("give train.max_steps or train.epochs, not both")
        return self


def resolve_grad_accum(train: "TrainSettings", world_size: int) -> int:
    """Micro-batches per optimizer step: ``train.grad_accum``, or derived from ``train.global_batch_size``."""
    if train.global_batch_size is None:
        return train.grad_accum
    if train.micro_batch_size == "auto":
        raise ConfigError("train.micro_batch_size: auto must be resolved (engine/fit.py) before grad_accum")
    per_pass = train.micro_batch_size * world_size
    if train.global_batch_size % per_pass:
        raise ConfigError(
            f"train.global_batch_size={train.global_batch_size} is not a multiple of micro_batch_size x processes = "
            f"{train.micro_batch_size} x {world_size} = {per_pass}; use a multiple of {per_pass} or change train.micro_batch_size"
        )
    accum = train.global_batch_size // per_pass
    if "grad_accum" in train.model_fields_set and train.grad_accum != accum:
        raise ConfigError(
            f"train.grad_accum={train.grad_accum} contradicts train.global_batch_size={train.global_batch_size} "
            f"(which needs grad_accum {accum} at micro_batch_size {train.micro_batch_size} x {world_size} processes); give one of them"
        )
    return accum


def resolve_max_steps(train: TrainSettings, batches_per_epoch: int) -> int:
    """Optimizer steps for the run: max_steps, or epochs over the data (default: one epoch)."""
    if train.max_steps is not None:
        return train.max_steps
    epochs = train.epochs if train.epochs is not None else 1.0
    return max(1, math.ceil(epochs * batches_per_epoch / train.grad_accum))
