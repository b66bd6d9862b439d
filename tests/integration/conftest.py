"""Helpers for the integration tests: run the real ``trainforge`` CLI in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

CLI_TIMEOUT_S = 180


def run_cli(args: list[str], cwd: Path, timeout: float = CLI_TIMEOUT_S) -> subprocess.CompletedProcess:
    """``python -m trainforge <args>`` in ``cwd``; stdout and stderr captured as text."""
    env = dict(os.environ)
    env.update(
        PYTHONUNBUFFERED="1",
        HF_HUB_OFFLINE="1",  # everything is local; never reach for the network
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
    )
    return subprocess.run(
        [sys.executable, "-m", "trainforge", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture
def trainforge_cli(tmp_path) -> Callable[..., subprocess.CompletedProcess]:
    """Run ``trainforge <args>`` with the test's tmp_path as working directory."""

    def run(*args: str, timeout: float = CLI_TIMEOUT_S) -> subprocess.CompletedProcess:
        return run_cli([str(a) for a in args], tmp_path, timeout)

    return run
