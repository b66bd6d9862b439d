"""The one table of what the live advisor and the run's limits count as a problem, with the reasons.

Every threshold the advisor (``advisor.py``), the end-of-run limits (``limits.py``), ``doctor`` and the
automatic eval size use is here, once; ``docs/advisor.md`` prints this table (a test keeps them equal).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Threshold:
    value: float
    unit: str
    reason: str


THRESHOLDS: dict[str, Threshold] = {
    "data_wait_pct": Threshold(
        5.0, "% of step time",
        "the guides' budget for input: above it the device idles waiting for batches, and the fix (workers, "
        "a pre-tokenized store, a faster disk) is cheap next to the time lost",
    ),
    "min_window_s": Threshold(
        0.5, "seconds",
        "speed and data wait are judged on log windows at least this long: a shorter one holds too few steps for "
        "its rate to mean anything (one page fault or garbage collection moves it)",
    ),
    "slow_windows": Threshold(
        2, "windows in a row",
        "a slowdown is named once it lasts this many log windows: one slow window is a hiccup",
    ),
    "slow_vs_expected": Threshold(
        0.30, "fraction below",
        "a window this much slower than this run's best steady window, or this machine's past steady speed for "
        "the same config, is not noise (run-to-run spread on a quiet machine is a few percent)",
    ),
    "busy_host_load": Threshold(
        1.0, "load average per core",
        "above one runnable process per core, other work competes with the run for the CPU: the likely cause "
        "of data wait or a slowdown the run did not cause itself",
    ),
    "impossible_mfu": Threshold(
        1.0, "MFU",
        "no run does more FLOPs than the device's peak: above it the peak figure is wrong (a CPU probe taken "
        "while other work ran, or a GPU profile of the wrong model)",
    ),
    "overhead_pct": Threshold(
        10.0, "% of the run so far",
        "evaluation or checkpoint pauses above this share of the wall time cost more than they tell or protect",
    ),
    "overhead_min_s": Threshold(
        5.0, "seconds",
        "below this an eval or checkpoint cost is not worth a warning, whatever its share (a smoke run)",
    ),
    "recompiles": Threshold(
        3, "recompiles",
        "a compiled graph that keeps recompiling after its first compile pays compile time again each time: "
        "a shape or a Python value changes between steps",
    ),
    "loss_spike": Threshold(
        2.0, "x running median",
        "a finite loss this far above the median of the last steps is a bad batch or an unstable step, not "
        "the noise between batches",
    ),
    "grad_norm_spike": Threshold(
        10.0, "x running median",
        "gradient norms vary more than losses; ten times the recent median is a spike even early in training",
    ),
    "spike_history": Threshold(
        10, "steps",
        "a running median needs this many steps before a spike can be told from the start of training",
    ),
    "memory_pct": Threshold(
        90.0, "% of device memory",
        "above this, the next longer batch or fragmentation can run out of memory: act before the out-of-memory "
        "back-off has to",
    ),
    "collapse_share": Threshold(
        0.5, "of the way from an even share to all tokens",
        "mixture-of-experts routing has collapsed when a layer's most-loaded expert is chosen by more than halfway "
        "from its even share (top_k / experts) to every token: one expert takes most of the layer's tokens and "
        "the others get little gradient. Measured from the even share, it means the same for 8 experts top-2 "
        "(62.5% of tokens) as for 128 experts top-8 (53%); a merely uneven load stays below it",
    ),
    "collapse_windows": Threshold(
        2, "log windows in a row",
        "a collapse is named once it lasts this many log windows (each already the mean over its steps): routing "
        "moves fast early on, a collapse that stays is the one that costs the run",
    ),
    "warmup_windows": Threshold(
        1, "log windows",
        "the first logged window holds warm-up (allocator, caches, compile, loader start): speed and data "
        "wait are judged from the next one on",
    ),
    "eval_share": Threshold(
        0.05, "of the training compute",
        "train.eval_max_batches: auto sizes each evaluation so that all of them together cost at most this "
        "share of the run's training FLOPs (an eval token costs a forward, a trained token a forward and a "
        "backward)",
    ),
    "limit_min_pct": Threshold(
        1.0, "% of wall time",
        "the end-of-run 'what limited this run' lists causes above this share of the wall time",
    ),
}


def limit(name: str) -> float:
    """The value of the threshold ``name``."""
    return THRESHOLDS[name].value


def markdown_table() -> str:
    """THRESHOLDS as the Markdown table of docs/advisor.md."""
    rows = ["| name | value | unit | why |", "|---|---|---|---|"]
    rows += [f"| `{name}` | {t.value:g} | {t.unit} | {t.reason} |" for name, t in THRESHOLDS.items()]
    return "\n".join(rows)
