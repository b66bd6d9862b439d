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
    return subprocess.run(argv, cwd=cwd, env=env, input=input, capture_output=True, text=True, timeout=timeout)


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
