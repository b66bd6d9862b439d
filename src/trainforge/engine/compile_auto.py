"""``train.compile: auto``: compile when it pays off, judged by what this machine measured before.

The first compile of a model costs tens of seconds, but torch keeps compiled graphs on disk
(inductor's FX graph and AOTAutograd caches), so compiling the same shapes again takes a few
seconds. trainforge remembers, per machine and config shape, what compiling cost and how much
faster the compiled steps were (``compile_history.json`` in the trainforge cache). With that:
- a config compiled before on this machine, whose graphs are still in torch's cache, compiles
  from the first step when the measured speed-up over the steps left pays for the warm compile
  (reruns, sweeps and resumes get compiled speed at once);
- a config measured no faster compiled is not compiled again;
- an unknown config times a few eager steps first and compiles when the assumed speed-up
  pays for the assumed cold compile (``model.compile`` holds those assumptions).
Every compiled run measures its compile time and steady step time and updates the record.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
from pathlib import Path
from typing import Any

import torch

from ..model.compile import ASSUMED_COMPILE_S, ASSUMED_SPEEDUP, PROBE_STEPS

WARM_FRACTION = 0.15  # a compile from torch's warm on-disk cache, as a share of the cold one, until measured
# (the 6M benchmark model on CPU: ~32 s cold, ~3 s warm)
MIN_SPEEDUP = 1.05  # a compiled step measured less than this much faster is not worth compiling again
MEASURE_STEPS = 8  # compiled steps timed: the first ones compile (recompiles included), the last half give the steady time
HISTORY_FILE = "compile_history.json"


def compile_key(parts: dict[str, Any]) -> str:
    """A stable digest of everything that decides the compiled graphs (model shape, batch shape,
    precision, method, device, torch version)."""
    blob = json.dumps({**parts, "torch": torch.__version__}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def torch_cache_present() -> bool:
    """Whether inductor's on-disk cache exists (a cleared /tmp makes the next compile cold again)."""
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        return any(Path(cache_dir()).iterdir())
    except (ImportError, OSError):
        return False


class CompileAuto:
    """Decides when to compile during a run and records what compiling gave."""

    def __init__(self, mode: bool | str, key: str, history_file: Path, device: torch.device):
        self.mode, self.key, self.file, self.device = mode, key, history_file, device
        self.known: dict[str, Any] = self._load().get(key, {})
        self.decided = mode is False
        self.eager_times: list[float] = []
        self.compiled_times: list[float] = []
        self.warm = bool(self.known) and torch_cache_present()
        self.skip_note: str | None = None  # why auto decided against compiling, once, for the console

    # ------------------------------------------------------------ decisions

    def at_start(self, remaining_steps: int) -> str | None:
        """Before the first step: the reason to compile right away, or None."""
        if self.mode is True:
            self.decided = True
            return "compile: as configured"
        if self.decided or not self.known:
            return None
        speedup, eager = self.known.get("speedup"), self.known.get("eager_step_s")
        if speedup is not None and speedup < MIN_SPEEDUP:
            self.decided = True  # measured not to help here: never compile this config
            self.skip_note = self.skipped_reason()
            return None
        if not (self.warm and speedup and eager):
            return None  # probe first, as for an unknown config
        cost = self._compile_cost()
        if self._pays_off(eager, remaining_steps, speedup, cost):
            self.decided = True
            return (
                f"compile: this config compiled before on this machine ({speedup:.2f}x faster, graphs in torch's "
                f"cache, ~{cost:.0f}s to load): compiling from the first step"
            )
        return None

    def after_eager_steps(self, remaining_steps: int) -> str | None:
        """After each eager step: the reason to compile now, once ``PROBE_STEPS`` steps are timed."""
        if self.decided or len(self.eager_times) < PROBE_STEPS:
            return None
        self.decided = True
        step_s = self._eager_step_s()
        # the measured speed-up, or from a compiled step time measured before (a run with compile: true)
        compiled_s = self.known.get("compiled_step_s")
        speedup = self.known.get("speedup") or (step_s / compiled_s if compiled_s else ASSUMED_SPEEDUP)
        if speedup < MIN_SPEEDUP:
            if "speedup" not in self.known:  # measured now, against a compiled run's step time: remember it
                self._save({**self.known, "eager_step_s": step_s, "speedup": speedup})
            self.skip_note = self.skipped_reason()
            return None
        cost = self._compile_cost()
        if self._pays_off(step_s, remaining_steps, speedup, cost):
            return f"compile: {step_s:.3f}s per eager step x {remaining_steps} steps left at {speedup:.2f}x pays for ~{cost:.0f}s of compiling"
        return None

    def _compile_cost(self) -> float:
        """Expected seconds of compiling: measured warm or cold for this config, else assumed."""
        cold = self.known.get("compile_s")
        if self.warm:
            if "warm_compile_s" in self.known:
                return self.known["warm_compile_s"]
            if cold is not None:
                return cold * WARM_FRACTION
        return cold if cold is not None else ASSUMED_COMPILE_S.get(self.device.type, 90.0)

    @staticmethod
    def _pays_off(step_s: float, remaining: int, speedup: float, compile_s: float) -> bool:
        return step_s * remaining * (1.0 - 1.0 / speedup) > compile_s

    def skipped_reason(self) -> str | None:
        """Why a config measured before is not compiled (for the console), or None."""
        speedup = self.known.get("speedup")
        if self.mode == "auto" and speedup is not None and speedup < MIN_SPEEDUP:
            return f"compile: skipped, this config measured only {speedup:.2f}x as fast compiled on this machine"
        return None

    # ------------------------------------------------------------ measurements

    def _eager_step_s(self) -> float | None:
        """Median eager step time of this run, the first (warm-up) step left out: one step slowed by other
        work on the machine must not buy a compile that the run's steady steps do not pay for."""
        return statistics.median(self.eager_times[1:]) if len(self.eager_times) > 1 else None

    def record_step(self, seconds: float, compiled: bool) -> None:
        """One optimizer step's wall time; after a compile's first ``MEASURE_STEPS`` steps, save the record."""
        if not compiled:
            self.eager_times.append(seconds)
            return
        self.compiled_times.append(seconds)
        if len(self.compiled_times) == MEASURE_STEPS:
            self._save_measurement()

    def measured(self) -> dict[str, float] | None:
        """This run's compile: seconds spent compiling (time above the steady pace in its first compiled
        steps, recompiles included), steady compiled and eager step times and their ratio; None until
        ``MEASURE_STEPS`` compiled steps ran."""
        if len(self.compiled_times) < MEASURE_STEPS:
            return None
        times = self.compiled_times[:MEASURE_STEPS]
        steady = statistics.median(times[len(times) // 2 :])
        out = {"compile_s": sum(max(t - steady, 0.0) for t in times), "compiled_step_s": steady}
        eager = self._eager_step_s()
        if eager:
            out |= {"eager_step_s": eager, "speedup": eager / steady}
        return out

    def _save_measurement(self) -> None:
        times = self.compiled_times
        steady = statistics.median(times[len(times) // 2 :])
        entry = dict(self.known)
        compile_s = sum(max(t - steady, 0.0) for t in times)  # time above the steady pace: compiling and recompiling
        entry["warm_compile_s" if self.warm else "compile_s"] = compile_s
        entry["compiled_step_s"] = steady
        eager = self._eager_step_s() or entry.get("eager_step_s")
        if eager:
            entry["eager_step_s"] = eager
            entry["speedup"] = eager / steady
        self._save(entry)

    def _save(self, entry: dict[str, Any]) -> None:
        history = self._load()
        history[self.key] = entry
        try:
            self.file.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.file.with_name(f"{self.file.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(history, indent=1))
            tmp.replace(self.file)  # atomic: a concurrent reader sees the old or the new table
        except OSError:
            pass  # a read-only cache only costs the next run its probe
        self.known = entry

    def _load(self) -> dict[str, Any]:
        try:
            return json.loads(self.file.read_text())
        except (OSError, ValueError):
            return {}
