"""Helpers for the integration tests: run the real ``trainforge`` CLI in a subprocess.

Not a conftest.py on purpose: a second ``conftest`` module (there is no ``__init__.py`` here)
would shadow ``tests/conftest.py`` for ``from conftest import ...``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

CLI_TIMEOUT_S = 180
ROOT_CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"


def root_conftest() -> ModuleType:
    """``tests/conftest.py`` as a module, for its helpers (write_config, write_jsonl)."""
    mod = sys.modules.get("conftest")
    if mod is not None and Path(getattr(mod, "__file__", "")).resolve() == ROOT_CONFTEST:
        return mod
    name = "trainforge_tests_conftest"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT_CONFTEST)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[name] = module
    return sys.modules[name]


FAULT_RUNNER = Path(__file__).resolve().with_name("fault_runner.py")


def cli_command(args: list, faults: dict | None = None, nproc: int = 0) -> tuple[list[str], dict[str, str]]:
    """(argv, environment) of ``python -m trainforge <args>`` as the tests run it (see ``run_cli``)."""
    env = dict(os.environ)
    env.update(
        PYTHONUNBUFFERED="1",
        HF_HUB_OFFLINE="1",  # everything is local; never reach for the network
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
    )
    # torch on one thread, as in the tests' own process (conftest._one_thread); under --nproc the
    # launcher gives each worker its share of the cores itself, as a user's run gets it
    if "--nproc" not in map(str, args):
        env.setdefault("OMP_NUM_THREADS", "1")
    entry = ["-m", "trainforge"] if faults is None else [str(FAULT_RUNNER), json.dumps(faults)]
    if nproc:  # under torchrun, as a user would start it: every process gets this environment
        entry = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *entry]
        env.setdefault("OMP_NUM_THREADS", "1")
    return [sys.executable, *entry, *(str(a) for a in args)], env


def run_cli(
    args: list, cwd: Path, timeout: float = CLI_TIMEOUT_S, faults: dict | None = None, nproc: int = 0,
    input: str | None = None,
) -> subprocess.CompletedProcess:
    """``python -m trainforge <args>`` in ``cwd``; stdout and stderr captured as text; ``input``: its stdin.

    With ``faults``, the CLI runs under ``fault_runner.py``, which injects them (see there);
    with ``nproc``, under ``torchrun --standalone --nproc_per_node nproc``.
    """
    argv, env = cli_command(args, faults, nproc)
    if not nproc and os.environ.get("TRAINFORGE_TESTS_COLD") != "1":
        warm = WarmCli.for_env(env)
        if warm is not None:
            return warm.run(argv, cwd, env, input, timeout)
    return subprocess.run(argv, cwd=cwd, env=env, input=input, capture_output=True, text=True, timeout=timeout)


WARM_CLI = Path(__file__).resolve().with_name("warm_cli.py")


class WarmCli:
    """The client of ``warm_cli.py``: one warm process per test worker and environment, started at the first
    ``run_cli`` that needs it. ``TRAINFORGE_*`` variables are read when a command runs, never at import, so they may
    differ from call to call; any other difference gets a warm process of its own, started with that environment at its second call.
    Once a warm process fails to answer, every call is a plain subprocess. ``TRAINFORGE_TESTS_COLD=1`` turns it off."""

    _instances: "dict[frozenset, WarmCli]" = {}  # by environment (TRAINFORGE_* aside): a test's own one gets its own
    _seen: "set[frozenset]" = set()
    _broken = False
    KEEP = 2  # warm processes per worker: the usual environment and the latest other one

    def __init__(self, env: dict[str, str]):
        import socket

        self.env = env
        ours, theirs = socket.socketpair()
        self.proc = subprocess.Popen([sys.executable, str(WARM_CLI), str(theirs.fileno())], env=env, pass_fds=[theirs.fileno()],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        theirs.close()
        self.sock = ours
        self.stream = ours.makefile("rw", encoding="utf-8")

    # read when a command runs, never at import: PYTEST_CURRENT_TEST names each test (and its phase), so keying on it
    # gave every test a cold first call and a warm process of its own
    PER_CALL = ("TRAINFORGE_", "PYTEST_CURRENT_TEST")

    @classmethod
    def key(cls, env: dict[str, str]) -> frozenset:
        return frozenset((k, v) for k, v in env.items() if not k.startswith(cls.PER_CALL))

    @classmethod
    def for_env(cls, env: dict[str, str]) -> "WarmCli | None":
        """The warm process for this environment (started now if there is none), or None once one has failed."""
        if cls._broken:
            return None
        key = cls.key(env)
        warm = cls._instances.pop(key, None)  # put back below as the most recently used
        if warm is not None and warm.proc.poll() is None:
            cls._instances[key] = warm
        elif key not in cls._seen:  # an environment's first call runs cold: one seen once never pays for a warm start
            cls._seen.add(key)
            return None
        else:
            while len(cls._instances) >= cls.KEEP:  # the least recently used goes
                old = cls._instances.pop(next(iter(cls._instances)))
                old.proc.kill()
                old.proc.wait()
            warm = cls._instances[key] = cls(env)
        return warm

    def drop(self) -> None:
        self.proc.kill()
        self.proc.wait()
        WarmCli._instances = {k: v for k, v in WarmCli._instances.items() if v is not self}

    def run(self, argv: list[str], cwd: Path, env: dict[str, str], input: str | None, timeout: float) -> subprocess.CompletedProcess:
        import socket
        import tempfile

        with tempfile.TemporaryDirectory(prefix="warm-cli-") as tmp:
            files = {k: str(Path(tmp) / k) for k in ("stdin", "stdout", "stderr")}
            if input is not None:
                Path(files["stdin"]).write_text(input)
            request = {"argv": argv[1:], "cwd": str(cwd), "env": env, **files, "stdin": files["stdin"] if input is not None else None}
            try:
                self.sock.settimeout(None)
                self.stream.write(json.dumps(request) + "\n")
                self.stream.flush()
                pid = json.loads(self.stream.readline())["pid"]
            except (OSError, ValueError, KeyError):  # the warm process is gone: plain subprocesses from here on
                WarmCli._broken = True
                return subprocess.run(argv, cwd=cwd, env=env, input=input, capture_output=True, text=True, timeout=timeout)
            read = lambda name: Path(files[name]).read_text(errors="replace")  # noqa: E731
            self.sock.settimeout(timeout)
            try:
                answer = self.stream.readline()
            except socket.timeout:  # a timed-out socket file cannot be read again: a new warm process next time
                os.kill(pid, 9)
                self.drop()
                raise subprocess.TimeoutExpired(argv, timeout, output=read("stdout"), stderr=read("stderr")) from None
            code = json.loads(answer)["returncode"]
            return subprocess.CompletedProcess(argv, code, read("stdout"), read("stderr"))


def start_cli(
    args: list, cwd: Path, faults: dict | None = None, env: dict[str, str] | None = None
) -> subprocess.Popen:
    """``run_cli`` without waiting: the process runs beside the test (``env``: extra variables);
    read it with ``.communicate(timeout=...)``."""
    argv, full_env = cli_command(args, faults)
    full_env.update(env or {})
    return subprocess.Popen(argv, cwd=cwd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def show(proc: subprocess.CompletedProcess) -> str:
    """Everything a failing assertion should print."""
    return f"exit code {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
