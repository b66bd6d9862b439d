"""The report's charts: the curves each panel draws from a run, and a panel drawn as an inline PNG (matplotlib)."""

from __future__ import annotations

import base64
import io
import math
from dataclasses import dataclass
from typing import Any, Callable

from .report_data import EVENT_LABELS, RunData

RUN_COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22"]
# event kind (report_data.EVENT_LABELS) -> (colour, line style, line width) of its vertical lines
MARK_STYLES = {
    "resume": ("#6a0dad", "--", 1.6),
    "checkpoint": ("#9a9a9a", ":", 1.0),
    "checkpoint_failed": ("#b00020", ":", 1.6),
    "oom_backoff": ("#e85d04", "-.", 1.6),
    "skipped": ("#f4a100", "-", 1.3),
    "stop": ("#222222", (0, (1, 1)), 1.6),
    "advice": ("#0a9396", (0, (3, 1, 1, 1)), 1.3),
}


@dataclass
class Series:
    label: str
    x: list[float]
    y: list[float]
    style: dict[str, Any]


def _num(v: Any) -> float:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else math.nan


def _tokens_at(run: RunData, step: float) -> float:
    """Tokens trained by ``step``, interpolated between the train records (0 at step 0)."""
    import numpy as np

    steps = [0] + [r["step"] for r in run.train if "tokens" in r]
    tokens = [0] + [r["tokens"] for r in run.train if "tokens" in r]
    return float(np.interp(step, steps, tokens)) if len(steps) > 1 else math.nan


def _train_series(run: RunData, key: str, scale: float = 1.0, x: str = "step") -> tuple[list[float], list[float]]:
    rows = [r for r in run.train if key in r]
    return [_num(r.get(x)) for r in rows], [_num(r[key]) * scale for r in rows]


PanelFn = Callable[[RunData, int, bool], list[Series]]


def _loss(x: str) -> PanelFn:
    def series(run: RunData, i: int, several: bool) -> list[Series]:
        color = RUN_COLORS[i % len(RUN_COLORS)] if several else None
        prefix = f"{run.name}: " if several else ""
        xs, ys = _train_series(run, "loss", x=x)
        out = [Series(f"{prefix}train", xs, ys, {"color": color or "#1f77b4", "lw": 1.6})]
        if run.evals:
            steps = [r["step"] for r in run.evals]
            ex = steps if x == "step" else [_tokens_at(run, s) for s in steps]
            out.append(
                Series(f"{prefix}eval", ex, [_num(r["eval_loss"]) for r in run.evals],
                       {"color": color or "#d62728", "lw": 1.2, "ls": "--", "marker": "o", "ms": 4})
            )
        return out

    return series


def _metric(key: str, label: str, scale: float = 1.0, extra: tuple[str, str] | None = None) -> PanelFn:
    def series(run: RunData, i: int, several: bool) -> list[Series]:
        color = RUN_COLORS[i % len(RUN_COLORS)]
        xs, ys = _train_series(run, key, scale)
        name = run.name if several else label
        out = [Series(name, xs, ys, {"color": color, "lw": 1.5})]
        if extra and any(extra[0] in r for r in run.train):
            xs, ys = _train_series(run, extra[0], scale)
            out.append(Series(f"{run.name}: {extra[1]}" if several else extra[1], xs, ys, {"color": color, "lw": 1.2, "ls": "--"}))
        return out

    return series


def _rewards(run: RunData, i: int, several: bool) -> list[Series]:
    """A preference run's implicit rewards of chosen and rejected (KTO: of desirable and undesirable examples)
    (train), and the eval margin of pairs."""
    color = RUN_COLORS[i % len(RUN_COLORS)]
    prefix = f"{run.name}: " if several else ""
    out = []
    kto = any("rewards_desirable" in r for r in run.train)
    sides = (("rewards_desirable", "desirable"), ("rewards_undesirable", "undesirable")) if kto else (
        ("rewards_chosen", "chosen"), ("rewards_rejected", "rejected"))
    for (key, label), style in zip(sides, ("-", ":")):
        xs, ys = _train_series(run, key)
        out.append(Series(prefix + label, xs, ys, {"color": color, "lw": 1.5, "ls": style}))
    evals = [r for r in run.evals if "eval_reward_margin" in r]
    if evals:
        out.append(Series(prefix + "eval margin", [r["step"] for r in evals], [_num(r["eval_reward_margin"]) for r in evals],
                          {"color": color, "lw": 1.2, "ls": "--", "marker": "o", "ms": 4}))
    return out


def _accuracy(run: RunData, i: int, several: bool) -> list[Series]:
    """A preference run's reward accuracy in %, train and eval."""
    color = RUN_COLORS[i % len(RUN_COLORS)]
    prefix = f"{run.name}: " if several else ""
    xs, ys = _train_series(run, "reward_accuracy", 100.0)
    out = [Series(prefix + "train", xs, ys, {"color": color, "lw": 1.5})]
    evals = [r for r in run.evals if "eval_reward_accuracy" in r]
    if evals:
        out.append(Series(prefix + "eval", [r["step"] for r in evals], [100.0 * _num(r["eval_reward_accuracy"]) for r in evals],
                          {"color": color, "lw": 1.2, "ls": "--", "marker": "o", "ms": 4}))
    return out


def _rl_rewards(run: RunData, i: int, several: bool) -> list[Series]:
    """A grpo run's mean reward of its completions (solid), each reward function's mean when it has several
    (dotted), and the held-out reward at its evaluations (eval_reward, dashed with markers)."""
    color = RUN_COLORS[i % len(RUN_COLORS)]
    prefix = f"{run.name}: " if several else ""
    xs, ys = _train_series(run, "reward")
    out = [Series(prefix + "reward", xs, ys, {"color": color, "lw": 1.6})]
    each = sorted({k for r in run.train for k in r if k.startswith("reward_") and k != "reward_accuracy"})
    for j, key in enumerate(each if len(each) > 1 else []):
        xs, ys = _train_series(run, key)
        out.append(Series(prefix + key[len("reward_"):], xs, ys, {"color": RUN_COLORS[(i + j + 1) % len(RUN_COLORS)],
                                                                    "lw": 1.1, "ls": ":"}))
    evals = [r for r in run.evals if "eval_reward" in r]
    if evals:
        out.append(Series(prefix + "held-out", [r["step"] for r in evals], [_num(r["eval_reward"]) for r in evals],
                          {"color": color, "lw": 1.2, "ls": "--", "marker": "o", "ms": 4}))
    return out


def _source_names(run: RunData) -> list[str]:
    """A mixture's sources, in the order its records name them (``loss/NAME``, ``eval_loss/NAME``)."""
    names: dict[str, None] = {}
    for r in run.train + run.evals:
        for k in r:
            if k.startswith(("loss/", "eval_loss/")):
                names.setdefault(k.split("/", 1)[1])
    return list(names)


def _by_source(run: RunData, i: int, several: bool) -> list[Series]:
    """A mixture's loss per source: train (solid) and eval (dashed), a color per source."""
    prefix = f"{run.name}: " if several else ""
    out = []
    for j, name in enumerate(_source_names(run)):
        color = RUN_COLORS[(i + j) % len(RUN_COLORS)]
        xs, ys = _train_series(run, f"loss/{name}")
        out.append(Series(prefix + name, xs, ys, {"color": color, "lw": 1.5}))
        evals = [r for r in run.evals if f"eval_loss/{name}" in r]
        if evals:
            out.append(Series(f"{prefix}{name} eval", [r["step"] for r in evals], [_num(r[f"eval_loss/{name}"]) for r in evals],
                              {"color": color, "lw": 1.2, "ls": "--", "marker": "o", "ms": 4}))
    return out


def _expert_load(run: RunData, i: int, several: bool) -> list[Series]:
    """A mixture-of-experts run's expert load in %: the worst layer's most-loaded expert (solid), the lowest
    least-loaded expert (dashed), and the even share every expert would have (dotted)."""
    color = RUN_COLORS[i % len(RUN_COLORS)]
    prefix = f"{run.name}: " if several else ""
    out = []
    for key, label, style in (("expert_load_max", "most-loaded expert (worst layer)", "-"),
                              ("expert_load_min", "least-loaded expert (lowest layer)", "--"),
                              ("expert_load_even", "even load", ":")):
        xs, ys = _train_series(run, key, 100.0)
        out.append(Series(prefix + label, xs, ys, {"color": "#7f7f7f" if style == ":" and not several else color,
                                                   "lw": 1.5 if style == "-" else 1.1, "ls": style}))
    return out


CAPTIONS = {
    "Expert load": "mixture-of-experts runs: the share of a layer's real tokens that chose an expert among their top-k, "
    "over the steps since the previous record: the most-loaded expert of the worst layer, the least-loaded of the "
    "lowest, and the even share (top_k / experts); metrics.jsonl has each layer's. The advisor warns when one expert "
    "takes most tokens for several windows",
    "Loss per source": "a mixture of sources: each source's mean loss over its own target tokens (train: the steps since "
    "the previous record; eval: its held-out rows)",
    "Reward accuracy": "preference runs: the share of pairs whose chosen reply gets the higher implicit reward (KTO: of "
    "examples whose reward is on the side of beta x KL their label asks for) (train: the pairs since the previous "
    "record; eval: the eval pairs)",
    "Rewards": "preference runs: mean implicit reward (beta x log-ratio against the reference) of chosen and rejected, "
    "and the eval margin between them (KTO: of desirable and undesirable examples)",
    "Reward": "grpo runs: mean reward of the step's sampled completions (the weighted sum of rl.rewards; with several, "
    "each function's mean dotted), and the mean reward on held-out prompts at evaluations",
    "Completion length": "grpo runs: mean tokens of the step's sampled completions, the end token included "
    "(metrics.jsonl's truncated: the share that hit rl.max_completion_length)",
    "Loss against steps": "train: mean loss of the steps since the previous record; eval: loss on the eval set",
    "Loss against tokens": "the same against real (non-padding) tokens trained, for runs of different batch sizes",
    "Learning rate": "at each logged step, after warmup and schedule",
    "Gradient norm (before clipping)": "global L2 norm of the gradients; optim.max_grad_norm clips above it",
    "Throughput": "real input tokens per second over the steps since the previous record (all processes; "
    "encoder-decoder runs: source and target tokens)",
    "MFU (model FLOPs utilization)": "model FLOPs per second / the device's peak in the run's precision",
    "Peak memory": "peak so far: CUDA memory allocated (reserved by the allocator: dashed), or the process's peak RSS on a CPU",
    "Data wait": "share of the time the loop waited for the next batch",
}

# (title, y label, x axis, series, y log scale when the values span this ratio or more)
PANELS: list[tuple[str, str, str, PanelFn, float | None]] = [
    ("Loss against steps", "loss", "step", _loss("step"), None),
    ("Loss against tokens", "loss", "tokens", _loss("tokens"), None),
    ("Learning rate", "learning rate", "step", _metric("lr", "lr"), None),
    ("Gradient norm (before clipping)", "grad norm", "step", _metric("grad_norm", "grad norm"), 50.0),
    ("Throughput", "tokens/s", "step", _metric("tokens_per_s", "tokens/s"), None),
    ("MFU (model FLOPs utilization)", "MFU %", "step", _metric("mfu", "MFU", 100.0), None),
    ("Peak memory", "GiB", "step", _metric("peak_memory_bytes", "peak allocated", 2.0**-30, ("reserved_memory_bytes", "reserved")), None),
    ("Data wait", "% of step time", "step", _metric("data_wait_pct", "waiting for data"), None),
]


# shown only when a run of the report trained a preference objective (train.objective: dpo, ipo, orpo, simpo, kto)
PREFERENCE_PANELS: list[tuple[str, str, str, PanelFn, float | None]] = [
    ("Reward accuracy", "% of pairs", "step", _accuracy, None),
    ("Rewards", "reward", "step", _rewards, None),
]


# shown only when a run of the report trained with online RL (train.objective: grpo)
RL_PANELS: list[tuple[str, str, str, PanelFn, float | None]] = [
    ("Reward", "reward", "step", _rl_rewards, None),
    ("Completion length", "tokens", "step", _metric("completion_length", "completion length"), None),
]


def panels_for(runs: list[RunData]) -> list[tuple[str, str, str, PanelFn, float | None]]:
    """The report's panels: the preference ones after the loss when a run has reward metrics, the RL ones when a
    run logged completion lengths."""
    panels = PANELS
    if any("reward_accuracy" in r for run in runs for r in run.train):
        panels = PANELS[:2] + PREFERENCE_PANELS + PANELS[2:]
    if any("completion_length" in r for run in runs for r in run.train):
        panels = panels[:2] + RL_PANELS + panels[2:]
    if any("expert_load_max" in r for run in runs for r in run.train):  # mixture-of-experts: load after the loss
        panels = panels[:2] + [("Expert load", "% of tokens", "step", _expert_load, None)] + panels[2:]
    if any(_source_names(run) for run in runs):  # a mixture: its loss per source after the loss
        panels = panels[:2] + [("Loss per source", "loss", "step", _by_source, None)] + panels[2:]
    return panels


def figure_png(title: str, ylabel: str, xaxis: str, series: list[Series], runs: list[RunData], log_ratio: float | None) -> str:
    """One panel as a base64 PNG: the series, and the runs' events as vertical lines."""
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.ticker import EngFormatter, MaxNLocator

    fig = Figure(figsize=(6.4, 3.5), dpi=100)
    fig.subplots_adjust(left=0.12, right=0.98, top=0.9, bottom=0.15)
    ax = fig.add_subplot()
    ax.set_title(title, fontsize=11)
    ax.set_xlabel("step" if xaxis == "step" else "tokens trained")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if xaxis == "tokens":
        ax.xaxis.set_major_formatter(EngFormatter(sep=""))
    else:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    values = [v for s in series for v in s.y if math.isfinite(v)]
    for s in series:
        if any(math.isfinite(v) for v in s.y):
            ax.plot(s.x, s.y, label=s.label, **s.style)
    if not values:
        ax.text(0.5, 0.5, "not measured in this run" if runs[0].train else "no steps logged yet",
                ha="center", va="center", transform=ax.transAxes, color="#666666")
    elif log_ratio and min(values) > 0 and max(values) / min(values) >= log_ratio:
        ax.set_yscale("log")
    else:  # 2e-3, not 0.00200: tick labels stay short and the axis label stays on the figure
        ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 5))
    seen: set[str] = set()
    for run in runs:
        for kind, places in run.marks.items():
            color, ls, lw = MARK_STYLES[kind]
            for step, _ in places:
                x = step if xaxis == "step" else _tokens_at(run, step)
                if math.isfinite(x):
                    ax.axvline(x, color=color, ls=ls, lw=lw, alpha=0.9, zorder=0)
                    seen.add(kind)
    handles, labels = ax.get_legend_handles_labels()
    for kind in EVENT_LABELS:
        if kind in seen:
            color, ls, lw = MARK_STYLES[kind]
            handles.append(Line2D([], [], color=color, ls=ls, lw=lw))
            labels.append(EVENT_LABELS[kind])
    if handles and (len(handles) > 1 or len(runs) > 1):
        ax.legend(handles, labels, fontsize=8, loc="best", framealpha=0.85)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return base64.b64encode(buf.getvalue()).decode("ascii")
