"""The live advisor: while a run goes, it says what limits it and the one change to make, once per cause.

It reads what the log step already has (the metrics.jsonl record, the seconds the run has spent on
evaluation and checkpoints, the per-step losses and gradient norms the loop hands it as device
tensors), so it adds no host sync of its own: the per-step values are read in one batch at the log
step, where the loop syncs anyway. Thresholds and their reasons: ``thresholds.py``.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..hardware.device import load_per_core
from ..metrics.thresholds import limit

HISTORY = 50  # steps in the running medians of loss and gradient norm


@dataclass
class Advice:
    """One warning: ``cause`` (a key of the threshold table's family), what to do, and the figures."""

    cause: str
    message: str
    fields: dict[str, Any] = field(default_factory=dict)


@dataclass
class RunTimes:
    """Where the run's seconds went so far, as the log step sees them."""

    wall_s: float  # since setup began
    train_s: float  # in the step loop, eval and checkpoint pauses excluded
    eval_s: float
    evals_done: int
    evals_planned: int
    checkpoint_s: float
    steps_done: int
    max_steps: int
    window_s: float = 0.0  # the span of the log window being judged


class Advisor:
    """Judges each log window; ``observe`` returns the advice not given before (once per cause).

    ``capacity``: the bytes the run may use on its device (None: unknown); ``reprobe``: measures the
    device peak again and returns (FLOP/s, where from), for an MFU that cannot be true; ``judge_mfu``:
    False where the peak is no hardware peak (a CPU emulating the precision: its probe times a slow
    fallback kernel, which the run's own matmuls need not take), so MFU above 100% means nothing."""

    def __init__(
        self, capacity: int | None, reprobe: Callable[[], tuple[float, str]] | None = None, judge_mfu: bool = True,
        describe: Callable[[list[int]], str] | None = None, judge_loss: bool = True,
    ):
        """``describe``: example indices -> a sentence naming their documents' sources and first words (a spike's message);
        ``judge_loss``: False where the loss has no scale a spike could be measured against (grpo's policy-gradient loss
        sits near 0 with either sign, so a step 5x its median means nothing; its gradient norm is still judged)."""
        self.judge_loss = judge_loss
        self.capacity = capacity
        self.describe = describe
        self.reprobe = reprobe
        self.judge_mfu = judge_mfu
        self.given: set[str] = set()
        self.windows = 0
        self.best_tokens_per_s = 0.0
        self.losses: deque[float] = deque(maxlen=HISTORY)
        self.grad_norms: deque[float] = deque(maxlen=HISTORY)
        self._pending: list[tuple[int, torch.Tensor, torch.Tensor, list[int]]] = []
        self._graphs: int | None = None  # compiled graphs at the end of the first compiled window
        self._failures_seen: dict[Any, int] = {}
        self.recompiles = 0
        self.last_recompile_reason = ""
        self.evals_in_window = 0
        self._grew = False  # graphs were compiled again in the window being judged
        self.slow_windows = 0  # log windows in a row below the best
        self.collapsed_windows = 0  # log windows in a row whose MoE routing collapsed

    def record_step(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor, indices: list[int]) -> None:
        """Keep a step's loss and gradient norm (device tensors, not read now) and its example indices."""
        self._pending.append((step, loss.detach(), grad_norm.detach(), indices))

    def eval_ran(self) -> None:
        """An evaluation ran: its no-grad graphs are not recompiles of the training step."""
        self.evals_in_window += 1

    def observe(self, rec: dict[str, Any], times: RunTimes, compiled: bool = False) -> list[Advice]:
        """The advice of this log window (``rec``: its metrics.jsonl record) not given before; ``compiled``:
        the decoder runs through torch.compile (its recompiles are counted)."""
        pending, self._pending = self._pending, []
        found: list[Advice] = []
        warm = self.windows >= limit("warmup_windows")
        self.windows += 1
        found += self._spikes(pending)
        found += self._recompiles() if compiled else []
        judged = warm and times.window_s >= limit("min_window_s")  # long enough for its rates to mean something
        if judged:
            found += self._data_wait(rec)
            found += self._slow(rec)
        found += self._overheads(times)
        found += self._memory(rec)
        found += self._collapse(rec)
        if rec.get("tokens_per_s") and judged:
            self.best_tokens_per_s = max(self.best_tokens_per_s, rec["tokens_per_s"])
        self.evals_in_window = 0
        new = [a for a in found if a.cause not in self.given]
        self.given.update(a.cause for a in new)
        return new

    # --- the causes ---------------------------------------------------------------------------------

    def _data_wait(self, rec: dict[str, Any]) -> list[Advice]:
        pct = rec.get("data_wait_pct") or 0.0
        if pct <= limit("data_wait_pct"):
            return []
        load = load_per_core()
        if load > limit("busy_host_load"):
            why = f"the host is busy (load {load:.1f} per core): other processes take the cores the loader needs"
            fix = "run on a quieter machine or fewer concurrent jobs"
        else:
            why = "rows are read from the token store and collated on the training thread (tokenizing happened before the run)"
            fix = "keep data.cache_dir on a local disk, or use packing (fewer, fuller rows to collate)"
        return [Advice(
            "data_wait",
            f"step {rec['step']}: the loop waited for data {pct:.1f}% of the time (budget {limit('data_wait_pct'):g}%): {why}; {fix}",
            {"data_wait_pct": round(pct, 2), "load_per_core": round(load, 2)},
        )]

    def _slow(self, rec: dict[str, Any]) -> list[Advice]:
        tps, best = rec.get("tokens_per_s") or 0.0, self.best_tokens_per_s
        if not best or tps >= (1 - limit("slow_vs_expected")) * best:
            self.slow_windows = 0
            return []
        self.slow_windows += 1
        if self.slow_windows < limit("slow_windows"):
            return []
        load = load_per_core()
        if self._grew:
            why = f"a recompile in this window ({self.last_recompile_reason or 'reason not recorded'})"
        elif load > limit("busy_host_load"):
            why = f"a busy host (load {load:.1f} per core)"
        else:
            why = "thermal throttling or other work on the device; host syncs or a changed batch shape also slow a step"
        return [Advice(
            "slow",
            f"step {rec['step']}: {tps:,.0f} tokens/s is {1 - tps / best:.0%} below this run's best window ({best:,.0f}); "
            f"most likely {why}",
            {"tokens_per_s": round(tps, 1), "best_tokens_per_s": round(best, 1), "load_per_core": round(load, 2)},
        )]

    def impossible_mfu(self, step: int, mfu: float) -> Advice | None:
        """Advice (once per run) for an MFU above 100%, with the peak measured again where it can be: the log
        step asks before it writes the window's record, which never carries an impossible MFU."""
        if mfu <= limit("impossible_mfu") or not self.judge_mfu or "impossible_mfu" in self.given:
            return None
        self.given.add("impossible_mfu")
        text = f"step {step}: MFU {mfu:.0%} cannot be true: the device peak it divides by is too low"
        fields: dict[str, Any] = {"mfu": round(mfu, 3)}
        if self.reprobe is not None:
            peak, where = self.reprobe()
            fields["new_peak_flops"] = peak
            text += (f"; the peak probe was taken under load. Measured again now: {peak / 1e12:.3f} TFLOP/s ({where}); "
                     "MFU from here on divides by it")
        else:
            text += "; the GPU's profile in trainforge/hardware/profiles.py does not match this device (MFU not reported)"
        return Advice("impossible_mfu", text, fields)

    def _overheads(self, t: RunTimes) -> list[Advice]:
        found = []
        floor, share_limit = limit("overhead_min_s"), limit("overhead_pct") / 100
        if t.evals_done and t.steps_done:
            per_eval = t.eval_s / t.evals_done
            eval_total = per_eval * max(t.evals_planned, t.evals_done)
            train_total = t.train_s / t.steps_done * t.max_steps
            share = eval_total / max(eval_total + train_total + t.checkpoint_s, 1e-9)
            if share > share_limit and eval_total > floor:
                found.append(Advice(
                    "eval_time",
                    f"evaluation will take {share:.0%} of this run ({t.evals_planned} evals of {per_eval:.1f}s each against "
                    f"{train_total:.0f}s of training): set train.eval_max_batches: auto (sized to "
                    f"{limit('eval_share'):.0%} of the training compute) or fewer evals (train.eval_every)",
                    {"eval_s": round(t.eval_s, 2), "projected_eval_share": round(share, 3)},
                ))
        share = t.checkpoint_s / max(t.wall_s, 1e-9)
        if share > share_limit and t.checkpoint_s > floor:
            found.append(Advice(
                "checkpoint_time",
                f"checkpoint pauses took {t.checkpoint_s:.1f}s, {share:.0%} of the run so far: save less often "
                "(checkpoint.every_minutes / every_steps) or set checkpoint.async: true",
                {"checkpoint_s": round(t.checkpoint_s, 2), "share": round(share, 3)},
            ))
        return found

    def _memory(self, rec: dict[str, Any]) -> list[Advice]:
        peak = rec.get("reserved_memory_bytes") or rec.get("peak_memory_bytes")
        if not self.capacity or not peak or peak <= limit("memory_pct") / 100 * self.capacity:
            return []
        return [Advice(
            "memory",
            f"step {rec['step']}: peak memory {peak / 2**30:.2f} GiB is {peak / self.capacity:.0%} of the "
            f"{self.capacity / 2**30:.2f} GiB this run may use: a longer batch can run out. Lower "
            "train.micro_batch_size (raise train.grad_accum to keep the global batch) or set "
            "train.activation_checkpointing: true",
            {"peak_memory_bytes": int(peak), "capacity_bytes": int(self.capacity)},
        )]

    def _collapse(self, rec: dict[str, Any]) -> list[Advice]:
        """A mixture-of-experts layer whose most-loaded expert takes most of its tokens, window after window."""
        top, even = rec.get("expert_load_max"), rec.get("expert_load_even")
        line = even + limit("collapse_share") * (1 - even) if top is not None and even and even < 1 else None
        if line is None or top < line:
            self.collapsed_windows = 0
            return []
        self.collapsed_windows += 1
        if self.collapsed_windows < limit("collapse_windows"):
            return []
        layers = rec.get("expert_load_max_by_layer") or [top]
        worst = max(range(len(layers)), key=layers.__getitem__)
        fix = ("raise the load-balancing loss's coefficient (model.router_aux_loss: a number above the one this run "
               "trains with, router_aux_loss_coef in summary.json) or lower optim.lr" if "aux_loss" in rec else
               "set model.router_aux_loss: true (the load-balancing loss is off: nothing pulls the load back to "
               "even) or lower optim.lr")
        return [Advice(
            "routing_collapse",
            f"step {rec['step']}: mixture-of-experts routing collapsed: in MoE layer {worst} one expert took {top:.0%} "
            f"of the tokens for {self.collapsed_windows} log windows in a row ({sum(v >= line for v in layers)} of "
            f"{len(layers)} layers above {line:.0%}; an even load gives each expert {even:.1%}). The other experts get "
            f"little gradient and the layer works as one expert: {fix}",
            {"expert_load_max": round(top, 4), "expert_load_even": even, "layer": worst, "line": round(line, 4)},
        )]

    def _spikes(self, pending: list[tuple[int, torch.Tensor, torch.Tensor, list[int]]]) -> list[Advice]:
        if not pending:
            return []
        # one read for the whole window; the log step has just synchronized the device anyway
        values = torch.stack([torch.stack([loss.float(), g.float()]) for _, loss, g, _ in pending]).tolist()
        found = []
        for (step, _, _, indices), (loss, grad_norm) in zip(pending, values, strict=True):
            for name, value, history in (("loss", loss, self.losses), ("grad_norm", grad_norm, self.grad_norms)):
                if value != value or value in (float("inf"), float("-inf")) or (name == "loss" and not self.judge_loss):
                    continue  # non-finite steps are the non-finite guard's (skipped and named there)
                if len(history) >= limit("spike_history"):
                    median = statistics.median(history)
                    if median > 0 and value > limit(f"{name}_spike") * median:
                        found.append(self._spike(name, step, value, median, indices))
                history.append(value)
        return found

    def _spike(self, name: str, step: int, value: float, median: float, indices: list[int]) -> Advice:
        shown = ", ".join(map(str, indices[:16])) + (", ..." if len(indices) > 16 else "")
        documents = self.describe(indices) if self.describe else ""
        label = "loss" if name == "loss" else "gradient norm"
        return Advice(
            f"{name}_spike",
            f"step {step}: {label} {value:.4g} is {value / median:.1f}x the median of the last steps ({median:.4g}). "
            f"Example indices of that step: {shown or 'not recorded'}.{documents} Check those examples; if spikes recur, lower "
            "optim.lr, raise optim.warmup_steps or keep optim.max_grad_norm on",
            {"value": value, "median": median, "spike_step": step, "example_indices": indices[:64]},
        )

    def _recompiles(self) -> list[Advice]:
        self._grew = False
        from torch._dynamo.utils import counters, guard_failures

        graphs = int(counters["stats"]["unique_graphs"])
        reasons = []
        for code, failures in list(guard_failures.items()):
            seen = self._failures_seen.get(code, 0)
            reasons += [r for r in failures[seen:] if "grad_mode" not in r]  # eval's no-grad graphs are expected
            self._failures_seen[code] = len(failures)
        if self._graphs is None:  # the first compiled window compiles: what follows counts
            self._graphs = graphs
            return []
        grew, self._graphs = graphs - self._graphs, graphs
        if grew <= 0 or (self.evals_in_window and not reasons):
            return []
        self._grew = True
        self.recompiles += grew
        if reasons:
            self.last_recompile_reason = reasons[-1]
        if self.recompiles < limit("recompiles"):
            return []
        return [Advice(
            "recompiles",
            f"the compiled model recompiled {self.recompiles} times after its first compile; last change: "
            f"{self.last_recompile_reason or 'not recorded'}. Keep shapes fixed (data.packing: true gives full rows "
            "of one length) or set train.compile: false",
            {"recompiles": self.recompiles, "reason": self.last_recompile_reason},
        )]
