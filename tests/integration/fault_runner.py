"""``trainforge`` with faults injected at exact points, for the fault-injection tests.

    python fault_runner.py '<faults as JSON>' train CONFIG --output RUN ...

Faults (all optional; steps are 1-based optimizer steps):
  {"signal_in_step": [5, "SIGKILL"]}   send the signal to this process inside step 5's forward/backward
  {"signal_in_save": [6, "SIGKILL"]}   send it while step 6's checkpoint is written (state.pt done, meta.json not)
  {"nan_in_steps": [3, 4]}             make the loss of those steps NaN
  {"raise_in_step": [2, "message"]}    raise RuntimeError(message) inside step 2's forward/backward
  {"signal_in_eval": "SIGTERM"}        send the signal to this process as the first evaluation (before training) starts
  {"signal_in_eval_at": [4, 3, "SIGTERM"]}  send it before batch 3 of the evaluation at step 4 (train.eval_every);
                                       each evaluation prints "fault_runner: eval at step S: N batches" to stderr
  {"rank": 1, ...}                     under torchrun: inject the faults into rank 1 only
  {"pause_in_step": [5, "PATH"]}      inside step 5's forward/backward create PATH.paused, then wait (at
                                       most 10 minutes) for PATH to exist; signals sent meanwhile are handled
  {"pause_in_build": "PATH"}           build the token cache entry, then create PATH.paused and wait (at
                                       most 10 minutes) for PATH to exist before renaming it into place
  {"disk_full_from_save": [2, "DIR"]}  the disk under DIR fills up as step 2's checkpoint is written: that
                                       torch.save and, from then on, every open() for writing under DIR
                                       raise OSError(ENOSPC), as a full tmpfs would

The faults hook into trainforge by monkeypatching, so the product code carries no test switches.
"""

from __future__ import annotations

import json
import inspect
import os
import signal
import sys

import torch

import trainforge.engine.step as step_module
import trainforge.engine.trainer as trainer
from trainforge.rundir.checkpoint import step_dir_name
from trainforge.cli import main


def install(faults: dict) -> None:
    if "rank" in faults and int(os.environ.get("RANK", 0)) != faults["rank"]:
        return
    now = {"step": 0}  # the step being computed, counted over the whole run (a resume starts past 1)
    kill_step = faults.get("signal_in_step")
    nan_steps = set(faults.get("nan_in_steps", []))
    forward_backward = trainer.forward_backward_adaptive
    loss_sum = step_module.loss_sum

    pause_step = faults.get("pause_in_step")

    def watched_forward_backward(run, *args, **kwargs):
        now["step"] = run.step + 1
        if pause_step and now["step"] == pause_step[0]:
            _wait_for(pause_step[1])
        if kill_step and now["step"] == kill_step[0]:
            os.kill(os.getpid(), getattr(signal, kill_step[1]))
        if faults.get("raise_in_step") and now["step"] == faults["raise_in_step"][0]:
            raise RuntimeError(faults["raise_in_step"][1])
        return forward_backward(run, *args, **kwargs)

    def poisoned_loss_sum(*args, **kwargs):
        loss = loss_sum(*args, **kwargs)
        return loss * float("nan") if now["step"] in nan_steps else loss

    trainer.forward_backward_adaptive = watched_forward_backward

    eval_signal = faults.get("signal_in_eval")
    if eval_signal:
        run_eval = trainer.run_eval

        def signalled_eval(run, label):
            os.kill(os.getpid(), getattr(signal, eval_signal))
            return run_eval(run, label)

        trainer.run_eval = signalled_eval
    step_module.loss_sum = poisoned_loss_sum
    if faults.get("signal_in_eval_at"):
        _signal_in_eval_at(*faults["signal_in_eval_at"])

    pause = faults.get("pause_in_build")
    if pause:
        import trainforge.data.prepare as prepare

        build = prepare._build

        def build_then_wait(*args, **kwargs):
            build(*args, **kwargs)
            _wait_for(pause)

        prepare._build = build_then_wait

    save_fault = faults.get("signal_in_save")
    if save_fault:
        save = torch.save
        marker = f".{step_dir_name(save_fault[0])}.tmp"

        def save_then_signal(obj, f, *args, **kwargs):
            save(obj, f, *args, **kwargs)
            if marker in str(f):
                os.kill(os.getpid(), getattr(signal, save_fault[1]))

        torch.save = save_then_signal


    full = faults.get("disk_full_from_save")
    if full:
        _fill_disk(full[0], full[1])


def _signal_in_eval_at(step: int, batch: int, name: str) -> None:
    run_eval, evaluate = trainer.run_eval, trainer.evaluate
    at: dict = {"step": None}

    def noted_eval(run, label):
        at["step"] = run.step
        return run_eval(run, label)

    def counted_evaluate(*args, **kwargs):
        bound = inspect.signature(evaluate).bind(*args, **kwargs)  # the stop check, wherever run_eval passes it
        stop = bound.arguments.get("stop")
        ran = [0]

        def counted() -> None:
            ran[0] += 1
            if at["step"] == step and ran[0] == batch:
                os.kill(os.getpid(), getattr(signal, name))
            if stop is not None:
                stop()

        bound.arguments["stop"] = counted
        try:
            return evaluate(*bound.args, **bound.kwargs)
        finally:
            print(f"fault_runner: eval at step {at['step']}: {ran[0]} batches", file=sys.stderr, flush=True)

    trainer.run_eval, trainer.evaluate = noted_eval, counted_evaluate


def _fill_disk(step: int, directory: str) -> None:
    import builtins
    import errno

    root, marker, filled = os.path.realpath(directory), f".{step_dir_name(step)}.tmp", [False]
    real_open, real_save = builtins.open, torch.save

    def no_space(path) -> OSError:
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    def under_root(path) -> bool:
        return isinstance(path, (str, os.PathLike)) and os.path.realpath(path).startswith(root + os.sep)

    def full_open(file, mode="r", *args, **kwargs):
        if filled[0] and any(c in mode for c in "wax+") and under_root(file):
            raise no_space(file)
        return real_open(file, mode, *args, **kwargs)

    def full_save(obj, f, *args, **kwargs):
        filled[0] = filled[0] or marker in str(f)  # f: the checkpoint's checksumming writer, which names its file
        if filled[0] and (under_root(f) or root in str(f)):
            raise no_space(getattr(f, "name", f))
        return real_save(obj, f, *args, **kwargs)

    builtins.open, torch.save = full_open, full_save


def _wait_for(path: str) -> None:
    """Say "paused" (PATH.paused), then wait for the test to create PATH (10 minutes at most)."""
    import time
    from pathlib import Path

    Path(path + ".paused").touch()
    deadline = time.monotonic() + 600
    while not Path(path).exists() and time.monotonic() < deadline:
        time.sleep(0.05)


if __name__ == "__main__":
    install(json.loads(sys.argv[1]))
    sys.argv = ["trainforge", *sys.argv[2:]]
    sys.exit(main())
