"""How a run that ends is written down besides its steps: a stop by signal (a checkpoint, then exit 75), an
error (an ``error`` event for ``doctor``), and report.html, which every ending gets."""

from __future__ import annotations

from collections.abc import Callable

from ..rundir.checkpoint import step_dir_name
from ..dist import peer_failure
from ..metrics.tracker import read_metrics
from ..stop import Interrupted
from .run import Run


def stop_on_signal(run: Run) -> None:
    """SIGTERM/SIGINT arrived: save the finished step and stop (the CLI exits with code 75)."""
    run.reporter.stop()
    saved = run.saver.save_now(run.step, run.state_dict)
    where = f"checkpoint {step_dir_name(run.step)} saved" if saved else "saving a checkpoint failed (see above)"
    run.metrics.event("stop", run.step, signal=run.stop.name, saved=saved)
    raise Interrupted(f"{run.stop.name} at step {run.step}: {where}; to resume, run the same command with --output {run.out}",
                      run.stop.name)


def stop_before_first_step(run: Run) -> None:
    """SIGTERM/SIGINT arrived before this process trained a step: stop without a checkpoint (it would hold the
    starting weights, or the checkpoint just resumed); exit 75 all the same, the same command goes on."""
    if run.stop.requested and not run.dist.enabled:  # under torchrun the ranks agree on a stop at the first step
        run.metrics.event("stop", run.step, signal=run.stop.name, saved=False)
        run.stop.stop_before_training(run.out)


def eval_stop(run: Run, label: str) -> Callable[[], None] | None:
    """What the evaluation ``label`` checks between batches for SIGTERM/SIGINT, so that a long one does not outlast
    a scheduler's grace period: before this process trained a step (before training, or the evaluation a resumed
    run does again at its checkpoint's step), the set-up stop (nothing saved; the same command starts again);
    between steps (``train.eval_every``) and after training, the stop of a step (its checkpoint saved; the same
    command goes on: the stopped evaluation is not logged, and runs again first). None under torchrun (the ranks
    evaluate together)."""
    if run.dist.enabled:
        return None
    if label == "before training" or (label != "after training" and run.step == run.resumed_from):
        return lambda: stop_before_first_step(run)
    return lambda: stop_on_signal(run) if run.stop.requested else None


def eval_stopped_at_checkpoint(run: Run) -> bool:
    """Whether a signal stopped the evaluation due at the resumed checkpoint's step (``train.eval_every``): a stopped
    evaluation is not logged, and the checkpoint is saved at its step, so metrics.jsonl holds no eval record of that
    step. The resumed run evaluates there first, as the run that was not stopped did."""
    every = run.cfg.train.eval_every
    if run.dist.enabled or not run.eval_set or not (isinstance(every, int) and 0 < run.step < run.max_steps and run.step % every == 0):
        return False
    return not any(r.get("step") == run.step and "eval_loss" in r for r in read_metrics(run.metrics.path))


def record_failure(run: Run, error: Exception) -> None:
    """An ``error`` event for ``doctor``: what stopped the run, at which step, with which exit code (without it, a
    run that raised looked killed). Writing it must not hide the error itself (a full disk)."""
    kind, message = type(error).__name__, str(error)
    if run.dist.enabled and peer_failure(error):  # this rank only saw a peer go: say so, not gloo's socket text
        kind, message = "PeerFailure", (f"another process of the job failed or died first; its own output, or the "
                                        f"launcher's line naming it, says why (this rank saw: {kind}: {message})")
    try:
        run.metrics.event("error", run.step, type=kind, message=message[:2000], exit_code=getattr(error, "exit_code", 1))
    except Exception:  # noqa: BLE001 - the run's own error is the one to report
        pass


def write_report(run: Run) -> None:
    """report.html into the run directory (rank 0, ``log.report``), and to the trackers that keep files.
    A report that fails is a warning: the run's own files are already written."""
    if not (run.dist.is_main and run.cfg.log.report):
        return
    from ..metrics.report import write_report as render_report

    try:
        path = render_report([run.out], run.out / "report.html")
        run.metrics.artifact(path)
    except Exception as e:  # a report must never hide the run's own outcome (or error)
        run.reporter.warn(f"report.html not written: {type(e).__name__}: {e}")
    else:
        run.reporter.info(f"report: {path}")
