"""Library log lines a trainforge user cannot act on, dropped: in the CLI's process and in the processes it starts
(``bench``'s variants). A leaf: imports nothing of ours."""

from __future__ import annotations

import logging
import warnings


def quiet_library_logs() -> None:
    """Raise the level of library loggers whose warnings are noise for a trainforge user (each says why)."""
    # torchao (optim.name: adamw_4bit, offload; imported by peft too) logs, on every import, each CUDA
    # extension a CPU build lacks: noise in a run's console, not something the user can act on
    logging.getLogger("torchao").setLevel(logging.ERROR)
    # ... and registers enums with torch's pytree in a way torch 2.13 deprecates (transformers imports
    # torchao whenever it is installed): a warning for torchao's authors, not for the user
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
    # bitsandbytes (imported by peft for every LoRA run, eval, generate and export) logs on a CPU with AVX512-BF16
    # that its 4-bit CPU kernel needs the `kernels` package: 'Failed to load ...', on runs that use no 4-bit weight
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    # On a GPU (seen on an H200, liger-kernel 0.8.5, torch 2.11), every run with Liger's kernels logged that its
    # optional CuTe DSL backend is not installed (Liger uses its Triton kernels then), and every compiled one
    # logged 46 tracebacks (3,800 lines): torch cannot parse Liger's RMSNorm kernel to find what it writes and
    # assumes it writes every input. Neither changes the numbers (selftest passed there); neither is the user's to
    # act on. That one comes through dynamo's own logger: only its message is dropped, dynamo's other warnings stay
    logging.getLogger("liger_kernel.backends.registry").setLevel(logging.ERROR)
    dynamo = logging.getLogger("torch._dynamo")
    if not any(isinstance(f, _DropMessages) for f in dynamo.filters):
        dynamo.addFilter(_DropMessages("Encountered an exception in identify_mutated_tensors"))
    # ... and compiling Liger's SwiGLU warns that dynamo traces through the lru_cache of a function of the GPU's
    # architecture and the width (`_should_tile`): the same answer cached or not
    warnings.filterwarnings(
        "ignore", message=r"Dynamo detected a call to a `functools\.lru_cache`-wrapped function at 'swiglu\.py", category=UserWarning
    )


class _DropMessages:
    """A logging filter that drops the records whose message starts with one of ``starts``."""

    def __init__(self, *starts: str) -> None:
        self.starts = starts

    def filter(self, record) -> bool:
        return not str(record.msg).startswith(self.starts)
