"""``trainforge selftest``: every training path on the device at hand, checked, in about a minute.

The matrix is defined once, in ``cases.py``; the CLI and the unit tests run the same cases
through the same runner. A case trains a tiny Llama for a few steps through the real entry point
(``engine.trainer.train``: data preparation, checkpoints, evaluation, ``final/``, a sample)
and is checked against the fp32 run of the same (data, method, head):

    precision {fp32, bf16, fp16 + GradScaler}
  x data      {concat:     text joined and cut into blocks (packing: concat, too_long: split),
               packed:     text documents packed, boundaries kept (packing: true),
               completion: prompt/completion, completion-only loss, one padded example per row,
               chat:       OpenAI-style {"messages": [...]}, assistant-only loss, packed}
  x method    {full: from model.init (untied head), lora: a local "pretrained" model (tied head)}
  x head      {fused: chunked LM-head loss, standard: the model's own head + cross-entropy}
  + compiled  train.compile: true, on one case
  + checkpointing  train.activation_checkpointing: true, on a full and a LoRA case
  + tiled-offload  the same two with train.tiled_mlp and train.activation_offload: true (the long-context levers)

Beside the training cases, per precision: fused vs standard gradients on a batch with masked
positions, a run stopped after a checkpoint and resumed against the uninterrupted one, and
packed attention against a reference computed one document at a time, each preference loss and (fp32, bf16)
each GRPO loss from packed rows and the fused head against one document at a time, (fp32, bf16) a tiny
mixture-of-experts model's step, full and LoRA, with the experts implementation ``auto`` picks and the router's aux
loss against the model's own eager experts and transformers' loss with router logits; once: the non-finite
guard as CUDA runs it (read one step late) and pinned host memory. On CUDA the same matrix runs
on the GPU, which exercises what only runs there: flash-attention varlen over packed documents
(when flash_attn is installed), pinned memory with non-blocking copies, the lagged guard.

Nothing is downloaded: tokenizer, model and data are built locally from fixed seeds, once per
cache directory (``selftest/`` in trainforge's cache), which several selftests may share at once.

Modules, one job each (no module imports the package itself):

    cases.py       the matrix: ``Case``, ``matrix``, ``CHECKS``, ``plan``, each case's run config
    tolerances.py  how far each precision may depart from fp32, and why
    results.py     ``Result``; ``CheckOutcome`` (``CheckFailed``, ``Skip``) that end a case or check early
    assets.py      tokenizer, "pretrained" model and data, built once per cache (``trainforge.rundir.atomic``)
    reporters.py   the silent reporter the training runs report to
    grpo.py        the GRPO check's made rollout and its loss written out one completion at a time
    training.py    a training case: train, check, compare with the fp32 reference
    checks.py      the checks beside the training cases
    moe.py         the mixture-of-experts checks: a tiny Qwen2-MoE, trainforge's experts path vs eager
    probes.py      what the checks measure with (masked batch, packed-attention gap)
    lifecycle.py   the resume check's hand-wired run: stopped after a checkpoint as SIGTERM does
    runner.py      ``SelfTest`` (runs and remembers results), ``run_selftest``, the table, the JSON
"""

from __future__ import annotations

from .assets import ASSETS_VERSION, BACKWARD, FORWARD, MODEL_INIT, PRETRAIN_STEPS, WORDS, Assets, build_assets
from .cases import (
    CASES,
    CHECKPOINT_EVERY,
    CHECKS,
    DATA_SHAPES,
    HEADS,
    METHODS,
    PRECISIONS,
    QUICK,
    STEPS,
    Case,
    case_config,
    matrix,
    plan,
)
from .moe import MOE_INIT, MOE_ROWS
from .probes import attention_implementations, packed_attention_gap
from .results import CheckFailed, CheckOutcome, Result, Skip
from .runner import SelfTest, render_table, results_json, run_selftest
from .tolerances import ATTENTION_TOL, CUDA_RESUME_TOL, GRAD_NORM_TOL, HEAD_GRAD_TOL, LOSS_TOL, MIN_DECREASE, MOE_TOL

__all__ = [
    "ASSETS_VERSION", "ATTENTION_TOL", "BACKWARD", "CASES", "CHECKPOINT_EVERY", "CHECKS", "CUDA_RESUME_TOL",
    "DATA_SHAPES", "FORWARD", "GRAD_NORM_TOL", "HEADS", "HEAD_GRAD_TOL", "LOSS_TOL", "METHODS", "MIN_DECREASE",
    "MODEL_INIT", "MOE_INIT", "MOE_ROWS", "MOE_TOL", "PRECISIONS", "PRETRAIN_STEPS", "QUICK", "STEPS", "WORDS", "Assets", "Case", "CheckFailed",
    "CheckOutcome", "Result", "SelfTest", "Skip", "attention_implementations", "build_assets", "case_config",
    "matrix", "packed_attention_gap", "plan", "render_table", "results_json", "run_selftest",
]
