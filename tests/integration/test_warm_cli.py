"""The warm start of the tests' CLI calls (warm_cli.py) answers as a fresh ``python -m trainforge`` does: the same
exit code and output, its own working directory and environment, stdin, and a timeout that ends the call."""

from __future__ import annotations

import subprocess

import pytest
from integration_helpers import WarmCli, cli_command, run_cli


def test_a_warm_call_answers_as_a_cold_one(tmp_path, monkeypatch):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  max_steps: many\n")
    run_cli(["train", bad.name], tmp_path)  # an environment's first call may run cold; the second is warm
    warm = run_cli(["train", bad.name], tmp_path)  # a relative path: the child works in the test's directory
    warm_process = WarmCli._instances[WarmCli.key(cli_command([])[1])].proc
    assert warm_process.poll() is None  # the call above went through the warm process
    monkeypatch.setenv("TRAINFORGE_TESTS_COLD", "1")
    cold = run_cli(["train", bad.name], tmp_path)
    assert warm.returncode == cold.returncode == 2
    assert warm.stdout == cold.stdout and warm.stderr == cold.stderr and "max_steps" in warm.stderr


def test_stdin_environment_and_timeout_reach_the_child(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINFORGE_CACHE", str(tmp_path / "elsewhere"))  # TRAINFORGE_* differ per call: still warm
    proc = run_cli(["config", "--reference"], tmp_path, input="ignored\n")
    assert proc.returncode == 0 and "data.train" in proc.stdout
    env = cli_command([])[1]
    assert WarmCli.for_env({**env, "TRAINFORGE_X": "1"}) is WarmCli.for_env(env)
    # pytest names the running test in the environment: the next test's calls share this warm process
    assert WarmCli.key({**env, "PYTEST_CURRENT_TEST": "tests/x.py::test_next (call)"}) == WarmCli.key(env)
    assert WarmCli.for_env({**env, "OTHER": "1"}) is None  # another environment: cold at first,
    other = WarmCli.for_env({**env, "OTHER": "1"})  # then a warm process of its own, with it
    assert other is not WarmCli.for_env(env) and other.env["OTHER"] == "1"
    with pytest.raises(subprocess.TimeoutExpired):
        run_cli(["train", "--set", "train.max_steps=100000"], tmp_path, timeout=0.5)
