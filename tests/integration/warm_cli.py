"""A warm start for the integration tests' CLI runs: one process per test worker imports torch, transformers
and trainforge once, then forks a fresh child for every ``run_cli`` call.

Each child is a process of its own, as ``python -m trainforge`` would be: its own pid, working directory,
environment, stdin/stdout/stderr (files the test reads back), signal handlers, exit code (``-N`` when a signal
ends it), and the shutdown of a real interpreter (non-daemon threads joined, then the atexit handlers). What it
skips is only the interpreter's start and the imports, about five CPU-seconds of every CLI call on these
machines. The start-up path itself stays covered by the runs that are still real subprocesses (``--nproc``,
``start_cli``, the smoke runs before every stop). The fault runner runs here too: its monkeypatches live in the
child alone.

Protocol on the socket whose fd is argv[1], one JSON object per line:
request ``{"argv", "cwd", "env", "stdin", "stdout", "stderr"}`` (argv without the interpreter); answers ``{"pid"}``, then ``{"returncode"}``.
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import runpy
import socket
import sys
import threading
import traceback

# what nearly every CLI call imports; a module that fails to import here is simply imported by the child
PRELOAD = (
    "torch", "transformers", "safetensors.torch", "peft", "trainforge.cli", "trainforge.engine.trainer",
    "trainforge.engine.setup", "trainforge.tools.plan", "trainforge.model.load", "trainforge.data.prepare",
    "transformers.models.llama.modeling_llama", "transformers.models.gpt2.modeling_gpt2",
)


def run_child(request: dict) -> int:
    """In the forked child: become the CLI process the request describes and run it to its exit code."""
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for fd, path, flags in ((0, request["stdin"] or os.devnull, os.O_RDONLY),
                            (1, request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                            (2, request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
        opened = os.open(path, flags, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    sys.path[0] = os.getcwd()  # as `python -m` sets it: the working directory, not this file's folder
    code: object = 0
    try:
        argv = request["argv"]  # after the interpreter's path: ["-m", "trainforge", ...] or [script, ...]
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:  # the fault runner: its faults installed in this child only, as in its own process
            sys.argv = list(argv)
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as stop:
        code = stop.code
    except BaseException:  # noqa: BLE001 - an uncaught error ends a real interpreter with its traceback and 1
        traceback.print_exc()
        code = 1
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    try:  # the interpreter's own shutdown order: wait for non-daemon threads, then the atexit handlers
        threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
    return int(code) & 0xFF


def serve(sock: socket.socket) -> None:
    """Answer requests until the test worker closes its end."""
    stream = sock.makefile("rw", encoding="utf-8")
    for line in stream:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                sock.close()
                stream.close()
                code = run_child(request)
            finally:
                os._exit(code)
        stream.write(json.dumps({"pid": pid}) + "\n")
        stream.flush()
        _, status = os.waitpid(pid, 0)
        stream.write(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}) + "\n")
        stream.flush()


def main() -> None:
    sock = socket.socket(fileno=int(sys.argv[1]))
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - the child imports it itself, and reports what goes wrong there
            pass
    serve(sock)


if __name__ == "__main__":
    main()
