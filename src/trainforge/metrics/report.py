"""report.html: one self-contained page (plots drawn by matplotlib, inlined as PNG; no script, no
network) of one run, or of several overlaid for comparison with their summaries side by side.

Read from the run directory only: ``metrics.jsonl`` (train and eval records), ``events.jsonl``
(resumes, checkpoints and the pauses they cost, out-of-memory back-offs, stops on a signal),
``summary.json`` (absent while a run is going or after it stopped) and ``config.yaml``.
Skipped (non-finite) steps come from the ``skipped_steps`` count of the train records.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import yaml

from ..atomic import atomic_write_text
from ..errors import TrainforgeError
from .sink import flat_config
from .tracker import EVENTS_FILE, read_events

REPORT_FILE = "report.html"
RUN_COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22"]
# event kind -> (label, colour, line style, line width)
MARKERS = {
    "resume": ("resume", "#6a0dad", "--", 1.6),
    "checkpoint": ("checkpoint", "#9a9a9a", ":", 1.0),
    "checkpoint_failed": ("checkpoint failed", "#b00020", ":", 1.6),
    "oom_backoff": ("out-of-memory back-off", "#e85d04", "-.", 1.6),
    "skipped": ("skipped steps", "#f4a100", "-", 1.3),
    "stop": ("stopped by a signal", "#222222", (0, (1, 1)), 1.6),
}


class ReportError(TrainforgeError, ValueError):
    """A directory that cannot be reported on (no metrics.jsonl); the CLI exits with code 2."""


@dataclass
class RunData:
    """What a report shows of one run directory."""

    path: Path
    name: str
    train: list[dict[str, Any]]
    evals: list[dict[str, Any]]
    events: list[dict[str, Any]]
    summary: dict[str, Any] | None
    config: dict[str, Any] | None
    marks: dict[str, list[tuple[int, str]]] = field(default_factory=dict)  # kind -> [(step, note)]

    @property
    def status(self) -> str:
        last = self.train[-1]["step"] if self.train else 0
        stops = [e for e in self.events if e.get("event") == "stop"]
        if self.summary is not None:
            return "finished"
        if stops and stops[-1].get("step") == last:
            return f"stopped by {stops[-1].get('signal') or 'a signal'} at step {last}"
        return f"running, or ended without a summary, at step {last}"


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written right now, or torn by a crash
            continue
    return records


def load_run(path: Path) -> RunData:
    """A run directory's metrics, events, summary and config."""
    path = Path(path)
    metrics = path / "metrics.jsonl"
    if not path.is_dir():
        raise ReportError(f"{path}: no such directory; give a run directory (the --output of trainforge train)")
    if not metrics.is_file():
        raise ReportError(f"{path}: no metrics.jsonl there; is it a trainforge run directory (the --output of trainforge train)?")
    records = _read_jsonl(metrics)
    summary_path, config_path = path / "summary.json", path / "config.yaml"
    try:
        summary = json.loads(summary_path.read_text()) if summary_path.is_file() else None
    except json.JSONDecodeError:
        summary = None
    try:
        config = yaml.safe_load(config_path.read_text()) if config_path.is_file() else None
    except yaml.YAMLError:
        config = None
    run = RunData(
        path=path,
        name=path.resolve().name,
        train=[r for r in records if "loss" in r and "step" in r],
        evals=[r for r in records if "eval_loss" in r and "step" in r],
        events=read_events(path / EVENTS_FILE),
        summary=summary,
        config=config if isinstance(config, dict) else None,
    )
    run.marks = _marks(run)
    return run


def _marks(run: RunData) -> dict[str, list[tuple[int, str]]]:
    """Per kind of event, the (step, note) places to mark on the step axis."""
    marks: dict[str, dict[int, str]] = {k: {} for k in MARKERS}
    for e in run.events:
        kind, step = e.get("event"), e.get("step")
        if kind not in marks or not isinstance(step, int):
            continue
        if kind == "checkpoint":
            note = f"paused {e.get('pause_s', 0):.2f}s"
        elif kind == "oom_backoff":
            note = f"micro-batch {e.get('micro_batch_size')} x accumulation {e.get('grad_accum')}"
        elif kind == "resume":
            note = f"from {e.get('checkpoint', 'a checkpoint')}"
        elif kind == "stop":
            note = f"{e.get('signal', 'signal')}, checkpoint {'saved' if e.get('saved') else 'not saved'}"
        else:
            note = str(e.get("error", ""))
        marks[kind][step] = note
    s = run.summary or {}
    if not any(e.get("event") == "resume" for e in run.events) and isinstance(s.get("resumed_from_step"), int):
        marks["resume"][s["resumed_from_step"]] = "resumed (from summary.json)"  # runs without events.jsonl
    if not marks["oom_backoff"]:
        for b in s.get("oom_backoffs") or []:
            marks["oom_backoff"][b["step"]] = f"micro-batch {b.get('micro_batch_size')} x accumulation {b.get('grad_accum')}"
    before = 0
    for r in run.train:
        n = r.get("skipped_steps") or 0
        if n > before:
            marks["skipped"][r["step"]] = f"{n - before} skipped by step {r['step']} ({n} in all)"
        before = max(before, n)
    return {k: sorted(v.items()) for k, v in marks.items() if v}


# ---------------------------------------------------------------- plots


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


CAPTIONS = {
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


def _figure_png(title: str, ylabel: str, xaxis: str, series: list[Series], runs: list[RunData], log_ratio: float | None) -> str:
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
            label, color, ls, lw = MARKERS[kind]
            for step, _ in places:
                x = step if xaxis == "step" else _tokens_at(run, step)
                if math.isfinite(x):
                    ax.axvline(x, color=color, ls=ls, lw=lw, alpha=0.9, zorder=0)
                    seen.add(kind)
    handles, labels = ax.get_legend_handles_labels()
    for kind in MARKERS:
        if kind in seen:
            label, color, ls, lw = MARKERS[kind]
            handles.append(Line2D([], [], color=color, ls=ls, lw=lw))
            labels.append(label)
    if handles and (len(handles) > 1 or len(runs) > 1):
        ax.legend(handles, labels, fontsize=8, loc="best", framealpha=0.85)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return base64.b64encode(buf.getvalue()).decode("ascii")


# ---------------------------------------------------------------- tables


def _fmt_time(s: Any) -> str:
    if not isinstance(s, (int, float)) or not math.isfinite(s):
        return "-"
    s = int(round(s))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m}:{sec:02d}"


def _fmt(v: Any, kind: str = "") -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if kind == "gib" and isinstance(v, (int, float)):
        return f"{v / 2**30:.2f} GiB"
    if kind == "pct" and isinstance(v, (int, float)):
        return f"{100 * v:.1f}%"
    if kind == "loss" and isinstance(v, (int, float)):
        return f"{v:.4f}"
    if kind == "time":
        return _fmt_time(v)
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.4g}"
    return str(v)


def _summary_rows(run: RunData) -> dict[str, str]:
    """The run's headline numbers; from summary.json, else from its last records (a stopped run)."""
    s = dict(run.summary or {})
    last = run.train[-1] if run.train else {}
    if run.summary is None and last:
        s.update(steps=last.get("step"), tokens=last.get("tokens"), train_time_s=last.get("elapsed_s"),
                 final_train_loss=last.get("loss"), peak_memory_bytes=last.get("peak_memory_bytes"))
        if run.evals:
            s["eval_loss"] = run.evals[-1].get("eval_loss")
    checkpoints = [e for e in run.events if e.get("event") == "checkpoint"]
    stall = s.get("checkpoint_stall_s", sum(e.get("pause_s", 0) for e in checkpoints) if checkpoints else None)
    ooms = len(run.marks.get("oom_backoff", []))
    resumes = [step for step, _ in run.marks.get("resume", [])]
    before, after = s.get("eval_loss_before"), s.get("eval_loss")
    return {
        "data": _data_summary(s.get("data")),
        "status": run.status,
        "steps": _fmt(s.get("steps")),
        "tokens": _fmt(s.get("tokens")),
        "train time": _fmt(s.get("train_time_s"), "time"),
        "wall time": _fmt(s.get("wall_time_s"), "time"),
        "tokens/s": _fmt(s.get("tokens_per_s")),
        "MFU": _fmt(s.get("mfu"), "pct"),
        "peak memory": _fmt(s.get("peak_memory_bytes"), "gib"),
        "final train loss": _fmt(s.get("final_train_loss"), "loss"),
        "eval loss": _fmt(after, "loss") + (f" ({_fmt(before, 'loss')} before training)" if before is not None else ""),
        "eval perplexity": _fmt(s.get("eval_ppl")),
        "skipped steps": _fmt(s.get("skipped_steps", (run.train[-1].get("skipped_steps") if run.train else None))),
        "out-of-memory back-offs": _fmt(ooms),
        "resumed at steps": ", ".join(map(str, resumes)) or "-",
        "checkpoint pauses": (f"{len(checkpoints)} saves, " if checkpoints else "") + (f"{stall:.2f}s" if stall is not None else "-"),
        "precision": _fmt(s.get("precision")),
        "device": _fmt(s.get("device")),
        "parameters (trainable)": f"{_fmt(s.get('parameters'))} ({_fmt(s.get('trainable_parameters'))})"
        if s.get("parameters") is not None else "-",
    }


def _data_summary(stats: Any) -> str:
    """The data a finished run trained on, in a line: format, rows and the target tokens losses average over
    (an encoder-decoder's ``tokens`` count source and target tokens; its losses are per target token)."""
    if not isinstance(stats, dict) or "format" not in stats:
        return "-"
    parts = [str(stats["format"])]
    if stats.get("encoder_decoder"):
        parts[0] += " (encoder-decoder: tokens count source and target tokens, losses are per target token)"
    if isinstance(stats.get("train_rows"), int):
        parts.append(f"{stats['train_rows']:,} train rows")
    if isinstance(stats.get("train_target_tokens"), int):
        parts.append(f"{stats['train_target_tokens']:,} target tokens per epoch")
    return ", ".join(parts)


def config_differences(runs: list[RunData]) -> list[str]:
    """The config keys whose values are not the same in every run (a key one run lacks differs)."""
    flats = [flat_config(r.config or {}) for r in runs]
    keys = sorted(set().union(*flats)) if flats else []
    missing = object()
    return [k for k in keys if len({json.dumps(f.get(k, missing), default=str, sort_keys=True) for f in flats}) > 1]


def _config_value(run: RunData, key: str) -> str:
    flat = flat_config(run.config or {})
    if key not in flat:
        return "(not set)"
    v = flat[key]
    return json.dumps(v) if isinstance(v, (list, dict)) else _fmt(v) if not isinstance(v, (int, float)) else str(v)


def _table(runs: list[RunData]) -> str:
    esc = html.escape
    head = "".join(f"<th>{esc(r.name)}</th>" for r in runs)
    rows: list[str] = []
    if len(runs) > 1:
        diffs = config_differences(runs)
        differ = "1 key differs" if len(diffs) == 1 else f"{len(diffs)} keys differ"
        rows.append(f'<tr class="group"><th colspan="{len(runs) + 1}">config differences ({differ})</th></tr>')
        for key in diffs:
            cells = "".join(f"<td>{esc(_config_value(r, key))}</td>" for r in runs)
            rows.append(f'<tr class="diff"><th>{esc(key)}</th>{cells}</tr>')
        if not diffs:
            rows.append(f'<tr><td colspan="{len(runs) + 1}">the runs have the same config</td></tr>')
        rows.append(f'<tr class="group"><th colspan="{len(runs) + 1}">summary</th></tr>')
    summaries = [_summary_rows(r) for r in runs]
    for key in summaries[0]:
        cells = "".join(f"<td>{esc(s[key])}</td>" for s in summaries)
        rows.append(f"<tr><th>{esc(key)}</th>{cells}</tr>")
    return f'<table class="summary"><thead><tr><th></th>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table>'


def _events_table(runs: list[RunData]) -> str:
    esc = html.escape
    rows = []
    for run in runs:
        for kind, places in run.marks.items():
            for step, note in places:
                rows.append((run.name, step, MARKERS[kind][0], note))
    if not rows:
        return "<p>No resumes, checkpoints, out-of-memory back-offs, skipped steps or stops.</p>"
    rows.sort(key=lambda r: (r[0], r[1]))
    several = len(runs) > 1
    body = "".join(
        "<tr>" + (f"<td>{esc(name)}</td>" if several else "") + f"<td>{step}</td><td>{esc(kind)}</td><td>{esc(note)}</td></tr>"
        for name, step, kind, note in rows
    )
    head = ("<th>run</th>" if several else "") + "<th>step</th><th>event</th><th>details</th>"
    return f'<table class="events"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _config_block(run: RunData) -> str:
    esc = html.escape
    text = yaml.safe_dump(run.config, sort_keys=False) if run.config else "(no config.yaml)"
    return f"<details><summary>config of {esc(run.name)}</summary><pre>{esc(text)}</pre></details>"


CSS = """
body { font-family: -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; margin: 24px; color: #1b1b1b; }
h1 { font-size: 22px; margin-bottom: 4px; } h2 { font-size: 17px; margin-top: 28px; }
.sub { color: #555; margin-top: 0; }
.grid { display: grid; grid-template-columns: repeat(auto-fill, minmax(560px, 1fr)); gap: 12px; }
figure { margin: 0; border: 1px solid #e3e3e3; border-radius: 6px; padding: 6px; background: #fff; }
figure img { width: 100%; height: auto; display: block; }
figcaption { font-size: 12px; color: #555; padding: 2px 4px; }
table { border-collapse: collapse; font-size: 13px; }
th, td { border: 1px solid #ddd; padding: 4px 10px; text-align: left; vertical-align: top; }
thead th { background: #f3f3f3; }
tr.group th { background: #eef3fb; }
tr.diff th, tr.diff td { background: #fff6d9; }
pre { background: #f7f7f7; padding: 8px; font-size: 12px; overflow-x: auto; }
"""


def render_html(runs: list[RunData]) -> str:
    """The report page of ``runs`` (one or several)."""
    esc = html.escape  # figures are drawn by matplotlib's Figure API to PNG bytes: no pyplot, no display
    several = len(runs) > 1
    figures = []
    for title, ylabel, xaxis, panel, log_ratio in PANELS:
        series = [s for i, r in enumerate(runs) for s in panel(r, i, several)]
        png = _figure_png(title, ylabel, xaxis, series, runs, log_ratio)
        figures.append(
            f'<figure><img alt="{esc(title)}" src="data:image/png;base64,{png}"><figcaption>{esc(CAPTIONS[title])}</figcaption></figure>'
        )
    names = ", ".join(r.name for r in runs)
    title = f"trainforge report: {names}"
    where = "; ".join(str(r.path) for r in runs)
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{esc(title)}</title>'
        f"<style>{CSS}</style></head><body>"
        f"<h1>{esc(title)}</h1>"
        f'<p class="sub">{esc(where)} | written {esc(time.strftime("%Y-%m-%d %H:%M:%S"))}</p>'
        f"<h2>{'Runs side by side' if several else 'Summary'}</h2>{_table(runs)}"
        f'<h2>Curves</h2><p class="sub">Vertical lines mark resumes, checkpoints (and the pause each cost), '
        f"out-of-memory back-offs, skipped steps and stops; the events table lists them.</p>"
        f'<div class="grid">{"".join(figures)}</div>'
        f"<h2>Events</h2>{_events_table(runs)}"
        f"<h2>Config</h2>{''.join(_config_block(r) for r in runs)}"
        "</body></html>\n"
    )


def write_report(run_dirs: list[Path], out: Path | None = None) -> Path:
    """Write the report of ``run_dirs`` to ``out`` (default: RUN_DIR/report.html for one run,
    ./report.html for several), atomically; returns its path."""
    if not run_dirs:
        raise ReportError("give at least one run directory")
    runs = [load_run(Path(p)) for p in run_dirs]
    names = [r.name for r in runs]
    for r in runs:
        if names.count(r.name) > 1:
            r.name = str(r.path)  # two runs of the same name from different places: tell them apart
    out = Path(out) if out is not None else (runs[0].path / REPORT_FILE if len(runs) == 1 else Path(REPORT_FILE))
    page = render_html(runs)
    out.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write_text(out, page)  # a browser (or a second writer) never sees half a page
