"""``trainforge doctor RUN_DIR``: what happened to a run and what limited it, from its files alone.

It works on a finished run, one stopped by a signal, one still going, one that failed with an error (its
``error`` event: the step, the exit code and the message), and one killed with SIGKILL or crashed (no
summary.json, no event), one asked to stop by a signal that died before saving (its ``signal`` event), one that
ended during set-up (no metrics.jsonl yet): the state and the step it reached, what the same ``train`` command
does now, as ``train`` decides it (refused while a process holds the directory, nothing for a finished run, a resume
from the newest checkpoint that passes resume's own checks, ``checkpoint_fault``, with the steps that costs, or a
new start from step 0), the environment it ran in, whether its config still validates, the first time
estimate against what happened, where the wall time went (``metrics/limits.py``, as at the end of a
run) and the advice the live advisor gave while it ran.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..rundir.checkpoint import CheckpointInfo, scan_checkpoints
from ..config.run import ConfigError, load_config
from ..engine.resume import ATTEMPTS, checkpoint_fault, unfinished_without_checkpoint
from ..metrics.limits import describe_limits, ledger_from_files, rank_limits
from ..metrics.report_data import RunData, load_run
from ..rundir.lock import LEASE_FILE, LeaseInfo, read_lease, stale_reason


VERIFY_BYTES = 2 << 30  # checkpoints up to this size are read and checked as train checks them; larger ones on --verify


def diagnose(run_dir: Path, verify: bool | None = None) -> dict[str, Any]:
    """The diagnosis of the run in ``run_dir`` as plain data (``render`` writes it for people). ``verify``: read the
    checkpoints and check them as a resume does (checksums, loading, finite state); None: where the newest is at most
    ``VERIFY_BYTES`` (a full fine-tune's state of tens of GB would take minutes), else only that it is complete."""
    run = load_run(run_dir, before_metrics=True)  # ReportError (exit 2) when it is not a run directory
    starts = [e for e in run.events if e.get("event") == "start"]
    complete, broken = scan_checkpoints(run.path / "checkpoints")
    newest = complete[-1] if complete else None
    # the furthest step known: a logged step, the newest checkpoint, or an event (a run resumed and killed
    # before its first log step has logged nothing since, yet it stands at least at its checkpoint)
    steps = [run.train[-1]["step"]] if run.train else []
    steps += [newest.step] if newest else []
    steps += [e["step"] for e in run.events if isinstance(e.get("step"), int)]
    last_step = max(steps, default=0)
    max_steps = (run.summary or {}).get("steps") if run.summary else (starts[-1].get("max_steps") if starts else None)
    state = _state(run, last_step)
    if verify is None:
        verify = newest is None or sum(f.stat().st_size for f in newest.path.iterdir() if f.is_file()) <= VERIFY_BYTES
    if state.startswith("running"):
        resumable, damaged = None, []
    else:
        resumable, damaged = _resumable(complete) if verify else (newest, [])
    out: dict[str, Any] = {
        "run_dir": str(run.path),
        "state": state,
        "last_step": last_step,
        "max_steps": max_steps,
        "last_checkpoint": {"path": str(newest.path), "step": newest.step} if newest else None,
        "resumes_from": {"path": str(resumable.path), "step": resumable.step} if resumable else None,
        "damaged_checkpoints": damaged,
        "checkpoints_verified": verify,
        "incomplete_checkpoints": [f"{p.name}: {why}" for p, why in broken],
        "environment": starts[-1].get("env") if starts else None,
        "config": _config_check(run.path),
        "estimate": _estimate(run, max_steps),
        "advice": [{"step": e.get("step"), "cause": e.get("cause"), "message": e.get("message")}
                   for e in run.events if e.get("event") == "advice"],
        "unreadable": run.unreadable,
    }
    out["rerun"] = _rerun(run, state, last_step, resumable, bool(complete))
    ledger = ledger_from_files(run.summary, run.train, run.events, _last_seen(run.path))
    out["time"] = ledger
    finished = (run.summary or {}).get("limits")
    out["limits"] = finished if isinstance(finished, list) else rank_limits(ledger, ledger.get("wall_s", 0.0))
    return out


def _resumable(complete: list[CheckpointInfo]) -> tuple[CheckpointInfo | None, list[str]]:
    """The checkpoint ``trainforge train`` resumes (the newest that passes its own checks: ``checkpoint_fault``),
    and why each newer one is skipped. Mapped, not read into memory; its settings are the run's own config.yaml."""
    damaged = []
    for info in reversed(complete):
        reason, _ = checkpoint_fault(info, mmap=True)
        if reason is None:
            return info, damaged
        damaged.append(f"{info.path.name}: {reason}")
    return None, damaged


def _state(run: RunData, last_step: int) -> str:
    if run.summary is not None:
        return "finished"
    lease = read_lease(run.path / LEASE_FILE)
    live = isinstance(lease, LeaseInfo) and stale_reason(lease) is None
    latest = next((e for e in reversed(run.events) if e.get("event") in ("start", "stop", "error", "signal")), None)
    if latest is not None and latest["event"] == "stop" and latest.get("step") == last_step:  # not started again since
        return f"stopped by {latest.get('signal') or 'a signal'}"
    if latest is not None and latest["event"] == "error":
        return (f"failed at step {latest.get('step')} (exit code {latest.get('exit_code', 1)}): "
                f"{latest.get('type', 'error')}: {latest.get('message', '')}")
    if live:
        return f"running (process {lease.pid} on {lease.host} holds the run directory)"
    if latest is not None and latest["event"] == "signal":  # asked to stop, gone before its stop was recorded
        return (f"asked to stop by {latest.get('signal', 'a signal')} at step {latest.get('step')}, then ended before "
                "saving (a second signal stops at once; or a SIGKILL after the scheduler's grace period)")
    if not (run.path / "metrics.jsonl").is_file():
        return "ended during set-up (tokenizing or loading the model), before the first step: nothing trained"
    return "ended without a summary: killed (SIGKILL, out of memory, a lost node) or crashed"


def _rerun(run: RunData, state: str, last_step: int, resumable: CheckpointInfo | None, any_complete: bool) -> str:
    """What the same ``trainforge train`` command with ``--output`` at this run does now, as train decides it."""
    where = f"the same command with --output {run.path}"
    if run.path.parent.name == ATTEMPTS:
        return f"nothing: an earlier attempt, moved aside when the run in {run.path.parent.parent} started again"
    if state.startswith("running"):
        return (f"{where} is refused (exit 2) while that process holds the directory; one stopping on a signal is "
                "waited for, then resumed from the checkpoint it saves")
    if resumable is not None:
        if run.summary is not None and resumable.step >= int(run.summary.get("steps") or 0) and (run.path / "final").is_dir():
            return f"{where} trains nothing (the run finished): raise train.max_steps to train on"
        lost = max(0, last_step - resumable.step)
        return (f"{where} resumes from {resumable.path.name} (step {resumable.step}; {lost} logged steps after it are "
                "trained again)" + ("; fix what failed it first" if state.startswith("failed") else ""))
    if any_complete:
        return f"{where} is refused (exit 2): no checkpoint can be loaded; start again with another --output"
    refused = unfinished_without_checkpoint(run.path) if (run.path / "metrics.jsonl").is_file() else None
    if refused:
        return f"{where} is refused (exit 2): " + refused
    again = f"{where} starts again from step 0"
    if (run.path / "metrics.jsonl").is_file():
        again += f" (this attempt's files move to {ATTEMPTS}/N/)"
    return again + ("; fix what failed it first" if state.startswith("failed") else "")


def _config_check(run_dir: Path) -> str:
    path = run_dir / "config.yaml"
    if not path.is_file():
        return "no config.yaml"
    try:
        load_config(path, [])
    except ConfigError as e:
        return f"does not validate with this trainforge: {e}"
    return "valid"


def _estimate(run: RunData, max_steps: int | None) -> dict[str, Any] | None:
    """The run's first estimate of its training time against what it took (or is on course to take)."""
    estimates = [e for e in run.events if e.get("event") == "estimate"]
    if not estimates or not run.train or not max_steps:
        return None
    first, last = estimates[0], run.train[-1]
    per_step = float(last.get("elapsed_s") or 0.0) / max(last["step"], 1)
    actual = per_step * max_steps
    return {
        "at_step": first.get("step"),
        "estimated_train_s": first.get("train_s"),
        "actual_train_s" if run.summary is not None else "projected_train_s": round(actual, 2),
        "error": round(actual / first["train_s"] - 1, 3) if first.get("train_s") else None,
    }


def _last_seen(run_dir: Path) -> float | None:
    times = [p.stat().st_mtime for p in (run_dir / "metrics.jsonl", run_dir / "events.jsonl", run_dir / "summary.json") if p.is_file()]
    return max(times) if times else None


def render(d: dict[str, Any]) -> str:
    """The diagnosis as a few lines of text."""
    lines = [f"run: {d['run_dir']}"]
    lines += [f"unreadable: {x}" for x in d.get("unreadable", [])]
    steps = f"step {d['last_step']}" + (f" of {d['max_steps']}" if d["max_steps"] else "")
    lines.append(f"state: {d['state']}, at {steps}")
    ck = d["last_checkpoint"]
    lines.append(f"last checkpoint: {Path(ck['path']).name} (step {ck['step']})" if ck else "last checkpoint: none")
    lines += [f"  not complete: {x}" for x in d["incomplete_checkpoints"]]
    lines += [f"  skipped by a resume: {x}" for x in d["damaged_checkpoints"]]
    if not d.get("checkpoints_verified", True) and ck:
        lines.append("  checked: complete and of the size it should have; not read (large): --verify checks its "
                     "checksums and values as a resume does")
    lines.append(f"rerun: {d['rerun']}")
    env = d["environment"]
    if env:
        lines.append("environment: " + ", ".join(f"{k} {v}" for k, v in env.items()))
    lines.append(f"config.yaml: {d['config']}")
    est = d["estimate"]
    if est and est.get("estimated_train_s"):
        actual = est.get("actual_train_s", est.get("projected_train_s"))
        word = "took" if "actual_train_s" in est else "is on course for"
        lines.append(f"estimate: at step {est['at_step']} training was expected to take {est['estimated_train_s']:.1f}s; "
                     f"it {word} {actual:.1f}s ({est['error']:+.0%})")
    t = d["time"]
    lines.append(describe_limits(d["limits"], t.get("wall_s", 0.0), t.get("train_s", 0.0)))
    if d["advice"]:
        lines.append("advice given while it ran:")
        lines += [f"  step {a['step']}: {a['message']}" for a in d["advice"]]
    else:
        lines.append("advice given while it ran: none")
    return "\n".join(lines)


def render_json(d: dict[str, Any]) -> str:
    return json.dumps(d, indent=2)
