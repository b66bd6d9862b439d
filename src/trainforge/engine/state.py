"""The parts of a run's state that no component owns: its counters, the random generators, the trained weights.

Every part of a run that has state offers ``state_dict()`` / ``load_state_dict()`` (torchtitan's
``Stateful``): the components already do (optimizer, scheduler, scaler, loader, log window,
non-finite guard); this module gives the rest the same shape, so ``Run.state_dict`` is the union
of its parts and no field is listed twice.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from ..errors import TrainforgeError
from .sharded import load_sharded, sharded_state


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass
class Counters:
    """What the loop counts and remembers between steps; all of it is checkpointed."""

    step: int = 0  # optimizer steps completed
    schedule_steps: int = 0  # horizon of the LR schedule: max_steps, or the original one after a resume
    tokens_seen: int = 0
    data_wait_s: float = 0.0
    loop_time_s: float = 0.0
    # the device peak x the loop's seconds, summed as the run goes: the whole run's MFU where a resume changed the
    # processes or the device (0 where the peak is unknown)
    peak_flop_s: float = 0.0
    last_train_loss: float | None = None
    eval_before: dict[str, float] = field(default_factory=dict)
    last_eval: dict[str, float] = field(default_factory=dict)
    oom_backoffs: list[dict[str, int]] = field(default_factory=list)
    eval_s: float = 0.0  # seconds spent evaluating
    evals: int = 0  # evaluations run

    def state_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # a deep copy: later steps do not change a snapshot being written

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A checkpoint's counters; one written before a counter existed leaves that counter at its default."""
        for f in dataclasses.fields(self):
            if f.name in state:
                setattr(self, f.name, state[f.name])
        self.oom_backoffs = list(self.oom_backoffs)


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights a checkpoint holds: LoRA adapters only, or everything for full training."""
    if hasattr(model, "peft_config"):  # adapters only; the frozen (maybe 4-bit) base is rebuilt from model.path
        return {n: p.detach() for n, p in model.named_parameters() if "lora_" in n}
    return model.state_dict()


@dataclass
class TrainedWeights:
    """The trained weights and the optimizer's state of them; under FSDP this rank's shards, written beside
    the checkpoint by its writer (so ``load_state_dict`` reads them from ``path``)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    sharded: bool = False

    def state_dict(self) -> dict[str, Any]:
        if self.sharded:
            return sharded_state(self.model, self.optimizer)
        return {"model": trainable_state(self.model), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any], path: Any = None) -> None:
        if self.sharded:
            load_sharded(self.model, self.optimizer, path)
            return
        self.model.load_state_dict(state["model"], strict=False)
        self.optimizer.load_state_dict(state["optimizer"])


class ResumeError(TrainforgeError, RuntimeError):
    """The checkpoint cannot continue this run (it is unusable, or the run's settings changed)."""


def resumed_grad_accum(state: dict[str, Any], world_size: int) -> int:
    """The accumulation that keeps a checkpoint's global batch on ``world_size`` processes at its micro-batch
    (the one after any out-of-memory back-off); ``ResumeError`` where none does."""
    saved_world = len(state.get("rng_ranks") or [None])  # one random state per process that wrote it
    micro, accum = state["micro_batch_size"], state["grad_accum"]
    rows = micro * accum * saved_world
    if rows % (micro * world_size):
        raise ResumeError(
            f"cannot resume a global batch of {rows} rows (micro-batch {micro} x accumulation {accum} x {saved_world} "
            f"process(es)) on {world_size} processes: {micro * world_size} rows per pass do not divide it; resume on "
            f"a number of processes that divides {rows // micro}"
        )
    return rows // (micro * world_size)


def rank_seed(seed: int, rank: int, step: int = 0) -> int:
    """The torch seed of data-parallel process ``rank`` (its own dropout masks), at ``step`` for a process a
    resumed checkpoint had no random state of (resumed on more processes)."""
    return seed + 1_000_003 * rank + 7_919 * step


def capture_rng() -> dict[str, Any]:
    """Python's, numpy's, torch's and CUDA's generators, as tensors and numbers (checkpoints load weights-only)."""
    np_state = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": {
            "keys": torch.from_numpy(np_state[1].astype(np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def restore_rng(state: dict[str, Any]) -> None:
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = state["numpy"]
    keys = n["keys"].numpy().astype(np.uint32)
    np.random.set_state(("MT19937", keys, n["pos"], n["has_gauss"], n["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])
