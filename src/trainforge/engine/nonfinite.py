"""A non-finite loss or gradient never reaches the weights: skip the update, count it, stop on a streak."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..errors import EXIT_NONFINITE, TrainforgeError


class NonFiniteError(TrainforgeError, RuntimeError):
    """Too many optimizer steps in a row had a non-finite loss or gradient norm."""

    exit_code = EXIT_NONFINITE


def skip_update_if(optimizer: torch.optim.Optimizer, bad: torch.Tensor) -> None:
    """``optimizer.step()`` unless ``bad`` (a 0-dim bool tensor) is true; params and state stay untouched.

    Fused AdamW takes a ``found_inf`` tensor (the hook GradScaler uses) and skips the whole
    update, weight decay and step count included, inside the kernel: on a GPU the decision
    stays on the device and costs no host sync. Other optimizers get a plain host check.
    """
    if getattr(optimizer, "defaults", {}).get("fused"):  # torchao's CPUOffloadOptimizer has no defaults
        optimizer.found_inf = bad.float()
        try:
            optimizer.step()
        finally:
            optimizer.found_inf = None
    elif not bool(bad):  # host sync: only optimizers without a device-side skip come here
        optimizer.step()


class NonFiniteGuard:
    """Counts skipped steps on the device and raises ``NonFiniteError`` after ``limit`` in a row.

    On CUDA the streak is read one step late: each step copies its count to pinned host
    memory without blocking, and the next step reads it once that copy is done, by which
    time the GPU has long finished it. The hot loop never waits for the device, and a
    streak is caught at most one (skipped, hence harmless) step later. On the CPU there
    is no device to wait for, so the count is read at once.
    """

    def __init__(
        self, limit: int, device: torch.device, lagged: bool | None = None,
        newest_checkpoint: Callable[[], Path | None] | None = None,
        describe: Callable[[list[int]], str] | None = None,
    ):
        """``newest_checkpoint``: asked when the run stops, the checkpoint its message names (None: there is none);
        ``describe``: example indices -> a sentence naming their documents' sources and first words (``data.examples``)."""
        self.limit = limit
        self.newest_checkpoint = newest_checkpoint
        self.describe = describe
        self.total = torch.zeros((), dtype=torch.int64, device=device)
        self.streak = torch.zeros((), dtype=torch.int64, device=device)
        self.lagged = device.type == "cuda" if lagged is None else lagged
        self._host = torch.zeros((), dtype=torch.int64, pin_memory=device.type == "cuda")
        self._event = torch.cuda.Event() if device.type == "cuda" else None
        self._stream = torch.cuda.current_stream(device) if device.type == "cuda" else None  # the copy's stream
        self._host_step: int | None = None  # the step whose streak sits in _host
        self.recent: deque[tuple[int, list[int]]] = deque(maxlen=limit + 1)  # (step, example indices)

    def record(self, bad: torch.Tensor, step: int, indices: list[int]) -> None:
        """Count step ``step`` (``bad``: skipped); raise once ``limit`` steps in a row were skipped."""
        bad = bad.to(torch.int64)
        self.total += bad
        self.streak.add_(1).mul_(bad)  # +1 when skipped, back to 0 otherwise, without a branch
        self.recent.append((step, indices))
        if not self.lagged:
            self._check(int(self.streak), step)
            return
        if self._host_step is not None:
            if self._event is not None:
                self._event.synchronize()
            self._check(int(self._host), self._host_step)
        self._host.copy_(self.streak, non_blocking=True)
        if self._event is not None:
            self._event.record(self._stream)
        self._host_step = step

    def _check(self, streak: int, step: int) -> None:
        if streak < self.limit:
            return
        steps = [(s, idx) for s, idx in self.recent if step - streak < s <= step]
        listed = "; ".join(f"step {s}: {idx}" for s, idx in steps)
        rows = list(dict.fromkeys(i for _, idx in steps for i in idx))
        shown = self.describe(rows) if self.describe else ""
        raise NonFiniteError(
            f"training stopped at step {step}: the loss or gradient norm was not finite for {streak} steps in a row "
            f"(steps {step - streak + 1}-{step}, train.max_skipped_steps={self.limit}); their updates were skipped. "
            f"Example indices of those batches: {listed or 'not recorded'}.{shown} Check those examples, lower optim.lr "
            f"or raise optim.warmup_steps{self._last_good()}"
        )

    def _last_good(self) -> str:
        """Where the last good weights are, as the message's last clause (skipped updates never reach the weights)."""
        if self.newest_checkpoint is None:
            return ""
        newest = self.newest_checkpoint()
        if newest is None:
            return "; no checkpoint was saved before the stop, so none holds this run's weights (checkpoint.every_steps)"
        return f"; the newest checkpoint, {newest}, holds the last good weights (skipped steps never changed them)"

    def state_dict(self) -> dict[str, Any]:
        return {"total": self.total.detach().cpu().clone(), "streak": self.streak.detach().cpu().clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.total.copy_(state["total"])
        self.streak.copy_(state["streak"])


# ---------------------------------------------------------------- non-finite values at rest (checkpoints, final/)


def nonfinite_tensors(named: Any) -> list[tuple[str, int]]:
    """``(name, count of NaN/Inf values)`` of each floating tensor in ``named`` (pairs) that holds any;
    one ``isfinite`` pass per tensor, the values counted only where something was found."""
    found = []
    for name, t in named:
        if isinstance(t, torch.Tensor) and type(t) is not torch.Tensor and hasattr(t, "dequantize"):
            t = t.dequantize()  # a low-bit optimizer state (torchao): check the values it stands for
        if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()) and not bool(torch.isfinite(t).all()):
            found.append((name, int((~torch.isfinite(t)).sum())))
    return found


def checkpoint_tensors(state: dict[str, Any]) -> Any:
    """The trained weights and the optimizer state in a checkpoint's ``state.pt`` (pairs of name, tensor);
    nothing for FSDP checkpoints, whose weights and optimizer state lie in ``sharded/``."""
    yield from (state.get("model") or {}).items()
    for pid, pstate in ((state.get("optimizer") or {}).get("state") or {}).items():
        yield from _nested(pstate, f"of parameter {pid}")


def _nested(values: dict[str, Any], where: str) -> Any:
    """Pairs of name and value through nested dicts (bitsandbytes keeps its 8-bit state in one)."""
    for key, value in values.items():
        if isinstance(value, dict):
            yield from _nested(value, where)
        else:
            yield f"optimizer state {key} {where}", value


def describe(found: list[tuple[str, int]], most: int = 3) -> str:
    """``1,024 non-finite values in 1 tensor (model.embed_tokens.weight: 1,024)``."""
    total = sum(n for _, n in found)
    listed = ", ".join(f"{name}: {n:,}" for name, n in found[:most]) + (", ..." if len(found) > most else "")
    return f"{total:,} non-finite values in {len(found)} tensor{'s' if len(found) != 1 else ''} ({listed})"


def final_weights_check(model: torch.nn.Module, weights: dict[str, torch.Tensor] | None, warn: Any) -> dict[str, Any]:
    """Before ``final/`` is written: are the trained weights finite? ``weights``: the full state FSDP gathered
    on rank 0 (else the model's trainable parameters are read). Warns and returns the summary.json
    fields when they are not; ``{}`` when they are."""
    named = weights.items() if weights is not None else ((n, p.detach()) for n, p in model.named_parameters() if p.requires_grad)
    found = nonfinite_tensors(named)
    if not found:
        return {}
    warn(
        f"THE TRAINED WEIGHTS ARE NOT FINITE: {describe(found)}. final/ is written as it is and summary.json records "
        "nonfinite_weights: true; do not use it. The checkpoints before the damage hold finite weights: "
        "resume from one of them (--resume PATH) after lowering optim.lr or checking the data"
    )
    return {"nonfinite_weights": True, "nonfinite_tensors": {name: n for name, n in found}}
