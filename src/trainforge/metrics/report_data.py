"""Reading run directories for report.html: metrics, events, summary and config, and the events to mark on the step axis.

Read from the run directory only: ``metrics.jsonl`` (train and eval records), ``events.jsonl``
(resumes, checkpoints and the pauses they cost, out-of-memory back-offs, stops on a signal),
``summary.json`` (absent while a run is going or after it stopped) and ``config.yaml``.
Skipped (non-finite) steps come from the ``skipped_steps`` count of the train records.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config.errors import ConfigError
from ..config.yaml_text import load_yaml, read_config_text
from ..errors import TrainforgeError
from ..rundir.lock import RUN_MARKER
from .sink import flat_config
from .tracker import EVENTS_FILE, read_events

# the kinds of event a report marks, in the order its legends and tables list them -> label
EVENT_LABELS = {
    "resume": "resume",
    "checkpoint": "checkpoint",
    "checkpoint_failed": "checkpoint failed",
    "oom_backoff": "out-of-memory back-off",
    "skipped": "skipped steps",
    "stop": "stopped by a signal",
    "advice": "advice",
}
EVENT_ORDER = [EVENT_LABELS[k] for k in ("skipped", "oom_backoff", "advice", "checkpoint", "checkpoint_failed", "stop", "resume")]
"""The order of the labels of events at one step, as a run meets them."""


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
    profiles: list[dict[str, Any]] = field(default_factory=list)  # log.profile_steps records: phases and profile_ops
    unreadable: list[str] = field(default_factory=list)  # "FILE: what is wrong": read as absent (or those lines skipped)

    @property
    def status(self) -> str:
        last = self.train[-1]["step"] if self.train else 0
        stops = [e for e in self.events if e.get("event") == "stop"]
        if self.summary is not None:
            return "finished"
        if stops and stops[-1].get("step") == last:
            return f"stopped by {stops[-1].get('signal') or 'a signal'} at step {last}"
        return f"running, or ended without a summary, at step {last}"


def _read_jsonl(path: Path, unreadable: list[str]) -> list[dict[str, Any]]:
    records, others = [], 0
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line being written right now, or torn by a crash
            continue
        if isinstance(record, dict):
            records.append(record)
        else:
            others += 1
    if others:
        unreadable.append(f"{path}: {others} line(s) hold JSON that is not an object; skipped")
    return records


def _json_kind(value: Any) -> str:
    """``array``, ``string``, ... : what JSON calls the type of a parsed value."""
    kinds = {list: "array", str: "string", bool: "boolean", int: "number", float: "number", type(None): "null"}
    return kinds.get(type(value), "object")


def _read_summary(path: Path, unreadable: list[str]) -> dict[str, Any] | None:
    """summary.json's object; None when there is none, or (named in ``unreadable``) when it is not a JSON object."""
    if not path.is_file():
        return None
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        unreadable.append(f"{path}: not valid JSON ({e}); read as if the run wrote none")
        return None
    if not isinstance(summary, dict):
        unreadable.append(f"{path}: holds a JSON {_json_kind(summary)}, not the object a run writes; "
                          "read as if the run wrote none (remove it, or restore the run's own)")
        return None
    return summary


def load_run(path: Path, before_metrics: bool = False) -> RunData:
    """A run directory's metrics, events, summary and config. ``before_metrics``: a run directory (its
    ``.trainforge-run`` marker) without metrics.jsonl, a run that ended during set-up, reads as one with no records
    (``doctor``; a report of it would hold nothing)."""
    path = Path(path)
    metrics = path / "metrics.jsonl"
    if not path.is_dir():
        raise ReportError(f"{path}: no such directory; give a run directory (the --output of trainforge train)")
    setup_only = before_metrics and not metrics.is_file() and (path / RUN_MARKER).is_file()
    if not metrics.is_file() and not setup_only:
        raise ReportError(f"{path}: no metrics.jsonl there; is it a trainforge run directory (the --output of trainforge train)?")
    unreadable: list[str] = []
    records = [] if setup_only else _read_jsonl(metrics, unreadable)
    summary, config_path = _read_summary(path / "summary.json", unreadable), path / "config.yaml"
    try:
        config = load_yaml(read_config_text(config_path), str(config_path))[0] if config_path.is_file() else None
    except ConfigError:  # not YAML, or over a limit (an alias bomb): the report goes without the config
        config = None
    run = RunData(
        path=path,
        name=path.resolve().name,
        train=[r for r in records if "loss" in r and "step" in r],
        evals=[r for r in records if "eval_loss" in r and "step" in r],
        events=read_events(path / EVENTS_FILE, unreadable),
        summary=summary,
        config=config if isinstance(config, dict) else None,
        profiles=[r for r in records if isinstance(r.get("profile"), dict) and "step" in r],
        unreadable=unreadable,
    )
    run.marks = _marks(run)
    return run


def _marks(run: RunData) -> dict[str, list[tuple[int, str]]]:
    """Per kind of event, the (step, note) places to mark on the step axis."""
    marks: dict[str, dict[int, str]] = {k: {} for k in EVENT_LABELS}
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
        elif kind == "advice":
            note = str(e.get("message", e.get("cause", "")))
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


def config_differences(runs: list[RunData]) -> list[str]:
    """The config keys whose values are not the same in every run (a key one run lacks differs)."""
    flats = [flat_config(r.config or {}) for r in runs]
    keys = sorted(set().union(*flats)) if flats else []
    missing = object()
    return [k for k in keys if len({json.dumps(f.get(k, missing), default=str, sort_keys=True) for f in flats}) > 1]
