"""The matrix: which training paths (``Case``) and checks selftest runs, and each case's run config."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...hardware.device import cuda_has_native_bf16
from .assets import MODEL_INIT, Assets, str_or_none

PRECISIONS = ("fp32", "bf16", "fp16")
DATA_SHAPES = ("concat", "packed", "completion", "chat")
METHODS = ("full", "lora")
HEADS = ("fused", "standard")

STEPS = 8  # optimizer steps per case: enough for the loss to fall clearly, few enough to stay fast
CHECKPOINT_EVERY = 4  # a mid-run and an end-of-run checkpoint; the resume check stops after step 4


@dataclass(frozen=True)
class Case:
    """One training path: precision x data shape x method x head (x compiled)."""

    precision: str
    data: str
    method: str
    head: str
    compiled: bool = False
    checkpointing: bool = False  # train.activation_checkpointing
    long_context: bool = False  # train.tiled_mlp and train.activation_offload (on a CPU offload moves nothing)

    @property
    def name(self) -> str:
        return (
            f"{self.precision}-{self.data}-{self.method}-{self.head}"
            + ("-compiled" if self.compiled else "")
            + ("-checkpointing" if self.checkpointing else "")
            + ("-tiled-offload" if self.long_context else "")
        )

    @property
    def reference(self) -> "Case":
        """The fp32 eager case of the same data, method and head: what this one must track."""
        return Case("fp32", self.data, self.method, self.head)


QUICK = {("concat", "full", "fused"), ("packed", "full", "fused"), ("completion", "full", "fused"), ("chat", "full", "fused"),
         ("packed", "full", "standard"), ("chat", "lora", "fused"), ("completion", "lora", "standard")}
"""The ``--quick`` subset, per precision: every data shape, LoRA and the standard head."""


def matrix(quick: bool = False, compiled_precision: str | None = "bf16", compiled_lora: bool = False) -> list[Case]:
    """The cases, fp32 references first. ``quick``: ``QUICK`` per precision and no compile.
    ``compiled_precision``: the precision of the compiled case (None: none); ``compiled_lora``: a compiled LoRA
    case too (fused LoRA layers inside regionally compiled decoder layers, what a GPU LoRA run takes)."""
    cases = [
        Case(p, d, m, h)
        for p in PRECISIONS
        for d in DATA_SHAPES
        for m in METHODS
        for h in HEADS
        if not quick or (d, m, h) in QUICK
    ]
    if compiled_precision and not quick:
        cases.append(Case(compiled_precision, "packed", "full", "fused", compiled=True))
        if compiled_lora:
            cases.append(Case(compiled_precision, "chat", "lora", "fused", compiled=True))
    # activation checkpointing recomputes each layer in backward, then the long-context levers on top (a micro-batch
    # of 256 tokens in tiles of 64): each must track the plain run
    for long_context in (False, True):
        cases += [Case("fp32", "packed", "full", "fused", checkpointing=True, long_context=long_context),
                  Case(compiled_precision or "bf16", "chat", "lora", "fused", checkpointing=True, long_context=long_context)]
    return cases


CASES = matrix()
"""The full matrix (as on CPU), for test parametrization."""

CHECKS = (
    *(f"head-grads-{p}" for p in PRECISIONS),
    *(f"attention-{p}" for p in PRECISIONS),
    *(f"resume-{p}" for p in PRECISIONS),
    *(f"kernels-{p}" for p in PRECISIONS),
    *(f"preference-{p}" for p in PRECISIONS),
    *(f"grpo-{p}" for p in ("fp32", "bf16")),
    *(f"moe-{m}-{p}" for m in METHODS for p in ("fp32", "bf16")),
    "fp8-bf16",
    "nonfinite-guard",
    "pinned-memory",
)
"""The checks beside the training cases; every one is cheap, ``--quick`` runs them all."""


def case_config(case: Case, assets: Assets, device: str, cache_dir: Path | None = None) -> dict[str, Any]:
    """The run config of a case: a few steps with checkpoints, eval, final save and a sample."""
    train_file, eval_file = assets.data[case.data]
    data: dict[str, Any] = {
        "train": str(train_file),
        "eval": str(eval_file),
        "max_length": 64,
        "num_workers": 1,  # tiny data: a process pool would cost more than it saves
        "cache_dir": str_or_none(cache_dir),
        "packing": {"concat": "concat", "packed": True, "completion": False, "chat": True}[case.data],
    }
    if case.data == "concat":
        data["too_long"] = "split"
    if case.method == "lora":
        model = {"path": str(assets.pretrained), "method": "lora", "lora": {"r": 8, "alpha": 16}}
    else:
        model = {"init": dict(MODEL_INIT), "tokenizer": str(assets.tokenizer), "method": "full"}
    return {
        "model": model,
        "data": data,
        "train": {
            "max_steps": STEPS,
            "micro_batch_size": 4,
            "grad_accum": 2,  # loss normalization and (fp16) loss scaling across micro-batches
            "precision": case.precision,
            "device": device,
            "fused_loss": case.head == "fused",
            "compile": case.compiled,
            "activation_checkpointing": case.checkpointing,
            "tiled_mlp": case.long_context,
            "activation_offload": case.long_context,
            "eval_max_batches": 2,
            "seed": 0,
        },
        # LoRA trains only its low-rank update (B starts at zero): a larger step
        "optim": {"lr": 5e-3 if case.method == "lora" else 3e-3, "warmup_steps": 0, "schedule": "constant"},
        "checkpoint": {"every_steps": CHECKPOINT_EVERY, "every_minutes": None, "keep_last": 2},
        # the end-of-run sample decodes eagerly, compiled or not (engine/trainer.py)
        "log": {"every_steps": 1, "tensorboard": False, "report": False, "sample_prompt": "alpha beta", "sample_tokens": 6},
    }


def plan(device: torch.device, quick: bool = False) -> tuple[list[Case], list[str]]:
    """The cases and checks ``trainforge selftest`` runs on ``device``: the compiled cases in the
    precision ``auto`` picks on a GPU (fp16 on GPUs without bf16), bf16 elsewhere; a compiled LoRA case on
    CUDA only (on a CPU its compile costs more than the rest of the matrix)."""
    compiled = "fp16" if device.type == "cuda" and not cuda_has_native_bf16(device) else "bf16"
    return matrix(quick, compiled, compiled_lora=device.type == "cuda"), list(CHECKS)
