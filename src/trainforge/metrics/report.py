"""report.html: one self-contained page of one run, or of several compared, written atomically.

The page: the runs' summaries side by side (config differences first), the charts
(``report_charts.py``: plots drawn by matplotlib, inlined as PNG; no script, no network), the
events table and each run's config. What it shows of a run is read by ``report_data.py``.
"""

from __future__ import annotations

import errno
import html
import json
import math
import time
from pathlib import Path
from typing import Any, Callable

import yaml

from ..rundir.atomic import atomic_write_text
from .limits import ledger_from_files, rank_limits
from .report_charts import CAPTIONS, figure_png, panels_for
from .report_data import EVENT_LABELS, EVENT_ORDER, ReportError, RunData, config_differences, load_run
from .sink import flat_config

__all__ = ["REPORT_FILE", "ReportError", "render_html", "write_report"]

REPORT_FILE = "report.html"


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
    # every process's saves: summary.json's checkpoint_stall_s is only the process that wrote it (a resume's)
    stall = sum(e.get("pause_s", 0) for e in checkpoints) if checkpoints else s.get("checkpoint_stall_s")
    ooms = len(run.marks.get("oom_backoff", []))
    resumes = [step for step, _ in run.marks.get("resume", [])]
    before, after = s.get("eval_loss_before"), s.get("eval_loss")
    return {
        "data": _data_summary(s.get("data")),
        "status": run.status,
        "steps": _fmt(s.get("steps")),
        "tokens": _fmt(s.get("tokens")),
        "train time": _fmt(s.get("train_time_s"), "time"),
        # the process that wrote summary.json: a resume's own, while train time counts the whole run
        "wall time": _fmt(s.get("wall_time_s"), "time")
        + (f" (the process resumed at step {s['resumed_from_step']})" if s.get("resumed_from_step") is not None else ""),
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
        "limited by": _limits_line(run),
        "precision": _fmt(s.get("precision")),
        "device": _fmt(s.get("device")),
        "parameters (trainable)": f"{_fmt(s.get('parameters'))} ({_fmt(s.get('trainable_parameters'))})"
        if s.get("parameters") is not None else "-",
    }


def _limits_line(run: RunData) -> str:
    """What limited the run besides training, largest first (summary.json's ``limits``, else from its files)."""
    if run.summary is not None and isinstance(run.summary.get("limits"), list):
        limits = run.summary["limits"]
    else:
        times = [p.stat().st_mtime for p in run.path.glob("*.jsonl")]
        ledger = ledger_from_files(run.summary, run.train, run.events, max(times) if times else None)
        limits = rank_limits(ledger, ledger.get("wall_s", 0.0))
    return "; ".join(f"{x['cause']} {x['share']:.0%} ({x['seconds']:.1f}s)" for x in limits) or "nothing but training"


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
                rows.append((run.name, step, EVENT_LABELS[kind], note))
    if not rows:
        return "<p>No resumes, checkpoints, out-of-memory back-offs, skipped steps, stops or advice.</p>"
    # one step's events in the order they happen: a stop saves its checkpoint, and the resume comes after both
    rows.sort(key=lambda r: (r[0], r[1], EVENT_ORDER.index(r[2])))
    several = len(runs) > 1
    body = "".join(
        "<tr>" + (f"<td>{esc(name)}</td>" if several else "") + f"<td>{step}</td><td>{esc(kind)}</td><td>{esc(note)}</td></tr>"
        for name, step, kind, note in rows
    )
    head = ("<th>run</th>" if several else "") + "<th>step</th><th>event</th><th>details</th>"
    return f'<table class="events"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _profiles_section(runs: list[RunData]) -> str:
    """Profiled steps (``log.profile_steps``): the phases, where the device's (CPU: the host's) time went,
    and the costliest kernels; nothing when no run profiled a step."""
    esc = html.escape
    rows = []
    for run in runs:
        for p in run.profiles:
            phases = p["profile"]
            total = sum(phases.values()) or 1.0
            split = ", ".join(f"{k.removesuffix('_s')} {v * 1e3:.1f} ms ({v / total:.0%})" for k, v in phases.items())
            ops = p.get("profile_ops") or {}
            op_total = ops.get("op_seconds") or 0.0
            kinds = ", ".join(f"{k} {v / op_total:.0%}" for k, v in (ops.get("by_kind_s") or {}).items() if op_total and v / op_total >= 0.01)
            busy = f"{ops['device_busy']:.0%}" if ops.get("device_busy") is not None else "(CPU: host ops)"
            top = "<br>".join(f"{esc(t['name'][:90])} ({t['share']:.0%})" for t in (ops.get("top") or [])[:3])
            name = f"<td>{esc(run.name)}</td>" if len(runs) > 1 else ""
            rows.append(f"<tr>{name}<td>{p['step']}</td><td>{esc(split)}</td><td>{busy}</td><td>{esc(kinds)}</td><td>{top}</td></tr>")
    if not rows:
        return ""
    head = ("<th>run</th>" if len(runs) > 1 else "") + "<th>step</th><th>phases</th><th>device busy</th><th>time by kind</th><th>costliest</th>"
    return (f'<h2>Profiled steps</h2><p class="sub">log.profile_steps: each step\'s phases (synchronized at their edges), '
            f"where its kernel time went, and the torch profiler trace in profile/ of the run directory.</p>"
            f'<table class="events"><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table>')


def _config_block(run: RunData) -> str:
    esc = html.escape
    text = yaml.safe_dump(run.config, sort_keys=False) if run.config else "(no config.yaml)"
    return f"<details><summary>config of {esc(run.name)}</summary><pre>{esc(text)}</pre></details>"


# ---------------------------------------------------------------- the page


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
    for title, ylabel, xaxis, panel, log_ratio in panels_for(runs):
        series = [s for i, r in enumerate(runs) for s in panel(r, i, several)]
        png = figure_png(title, ylabel, xaxis, series, runs, log_ratio)
        figures.append(
            f'<figure><img alt="{esc(title)}" src="data:image/png;base64,{png}"><figcaption>{esc(CAPTIONS[title])}</figcaption></figure>'
        )
    names = ", ".join(r.name for r in runs)
    title = f"trainforge report: {names}"
    where = "; ".join(str(r.path) for r in runs)
    notes = "".join(f'<p class="sub">unreadable: {esc(n)}</p>' for r in runs for n in r.unreadable)
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{esc(title)}</title>'
        f"<style>{CSS}</style></head><body>"
        f"<h1>{esc(title)}</h1>"
        f'<p class="sub">{esc(where)} | written {esc(time.strftime("%Y-%m-%d %H:%M:%S"))}</p>'
        f"{notes}"
        f"<h2>{'Runs side by side' if several else 'Summary'}</h2>{_table(runs)}"
        f'<h2>Curves</h2><p class="sub">Vertical lines mark resumes, checkpoints (and the pause each cost), '
        f"out-of-memory back-offs, skipped steps and stops; the events table lists them.</p>"
        f'<div class="grid">{"".join(figures)}</div>'
        f"<h2>Events</h2>{_events_table(runs)}"
        f"{_profiles_section(runs)}"
        f"<h2>Config</h2>{''.join(_config_block(r) for r in runs)}"
        "</body></html>\n"
    )


def write_report(run_dirs: list[Path], out: Path | None = None, warn: Callable[[str], None] | None = None) -> Path:
    """Write the report of ``run_dirs`` to ``out`` (default: RUN_DIR/report.html for one run,
    ./report.html for several), atomically; returns its path. ``warn`` gets each file read as absent (unreadable)."""
    if not run_dirs:
        raise ReportError("give at least one run directory")
    runs = [load_run(Path(p)) for p in run_dirs]
    for note in (n for r in runs for n in r.unreadable):
        if warn is not None:
            warn(note)
    names = [r.name for r in runs]
    for r in runs:
        if names.count(r.name) > 1:
            r.name = str(r.path)  # two runs of the same name from different places: tell them apart
    out = Path(out) if out is not None else (runs[0].path / REPORT_FILE if len(runs) == 1 else Path(REPORT_FILE))
    page = render_html(runs)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        return atomic_write_text(out, page)  # a browser (or a second writer) never sees half a page
    except OSError as e:  # disk full, read-only, ...: the environment's, said with the path (exit 2)
        free = "free space there, or " if e.errno in (errno.ENOSPC, errno.EDQUOT) else ""
        raise ReportError(f"cannot write {out}: {e.strerror or e}; {free}write it elsewhere with --out FILE") from e
