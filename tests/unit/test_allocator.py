"""The CUDA allocator's expandable segments: asked for before CUDA starts, never over a user's own setting."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from rich.console import Console
from typer.testing import CliRunner

from trainforge.hardware import allocator
from trainforge.hardware.allocator import (
    EXPANDABLE,
    TRAINFORGE_SET_ENV,
    allocator_settings,
    prefer_expandable_segments,
)

VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", TRAINFORGE_SET_ENV)


def clear(monkeypatch) -> None:
    """No allocator variable in this process, and whatever the test sets removed after it (a variable
    that was absent is recorded only through setenv: delenv alone would leave what the code sets)."""
    for name in VARS:
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


@pytest.mark.parametrize("version", ["2.11.0+cu130", "2.11.0", "2.8.0+cu128", "2.13.1"])
def test_a_cuda_build_gets_expandable_segments_under_both_names(version):
    """torch 2.9-2.11's CUDA allocator read expandable_segments only from the old name (pytorch#183387);
    older releases know only that one; newer document the new one: both are set."""
    env: dict[str, str] = {}
    prefer_expandable_segments(env, version)
    assert env["PYTORCH_ALLOC_CONF"] == EXPANDABLE and env["PYTORCH_CUDA_ALLOC_CONF"] == EXPANDABLE
    assert allocator_settings(env) == {"settings": EXPANDABLE, "variable": "PYTORCH_ALLOC_CONF", "set_by": "trainforge"}


@pytest.mark.parametrize("name", ["PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"])
def test_a_users_setting_under_either_name_is_left_alone(name):
    env = {name: "max_split_size_mb:512"}
    prefer_expandable_segments(env, "2.11.0+cu130")
    assert env == {name: "max_split_size_mb:512"}
    assert allocator_settings(env, in_effect=False) == {
        "settings": "max_split_size_mb:512", "variable": name, "set_by": "user", "expandable_segments": False}


def test_a_user_who_asked_for_expandable_segments_is_named_as_the_one_who_set_it():
    env = {"PYTORCH_CUDA_ALLOC_CONF": EXPANDABLE}
    prefer_expandable_segments(env, "2.11.0+cu130")
    assert allocator_settings(env)["set_by"] == "user"


@pytest.mark.parametrize("version", ["2.13.0+cpu", "2.5.1+rocm6.2", ""])
def test_cpu_and_rocm_builds_and_no_torch_are_left_alone(version):
    env: dict[str, str] = {}
    prefer_expandable_segments(env, version)
    assert env == {}
    assert allocator_settings(env) == {"settings": "default", "set_by": "torch"}


def test_every_cli_command_asks_before_it_runs(monkeypatch):
    """The CLI's root callback runs before any command touches CUDA (``config`` here)."""
    from trainforge.cli import app

    clear(monkeypatch)
    monkeypatch.setattr(allocator, "_torch_version", lambda: "2.11.0+cu130")
    done = CliRunner().invoke(app, ["config"])
    assert done.exit_code == 0, done.output
    assert os.environ["PYTORCH_ALLOC_CONF"] == EXPANDABLE and os.environ[TRAINFORGE_SET_ENV] == "1"


def test_a_run_started_from_python_asks_at_set_up(monkeypatch):
    """``train()`` called without the CLI (a notebook, the GPU suite) asks in set-up, before the device is picked."""
    from trainforge.config.run import load_config
    from trainforge.dist import DistContext
    from trainforge.engine.setup import choose_device_and_precision
    from trainforge.metrics.console import ConsoleReporter

    clear(monkeypatch)
    monkeypatch.setattr(allocator, "_torch_version", lambda: "2.11.0+cu130")
    cfg = load_config(None, ["train.device=cpu", "train.precision=fp32", "train.cpu_threads=1"])
    device, precision, _, _ = choose_device_and_precision(cfg, DistContext(), ConsoleReporter(Console(quiet=True)))
    assert device.type == "cpu" and precision.name == "fp32"
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == EXPANDABLE


@pytest.mark.skipif(torch.cuda.is_available(), reason="a build without CUDA")
def test_without_cuda_the_allocator_in_effect_is_unknown_not_an_error():
    assert allocator.expandable_segments_in_effect() is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_runs_with_expandable_segments_after_the_cli_asks():
    """On this GPU's torch, the variables trainforge sets do turn expandable segments on (the new name
    alone did not on 2.9-2.11), and a user's False keeps them off."""
    code = ("from trainforge.hardware.allocator import prefer_expandable_segments as p, expandable_segments_in_effect as e\n"
            "p()\nimport torch\ntorch.zeros(1, device='cuda')\nprint(e())")
    clean = {k: v for k, v in os.environ.items() if k not in VARS}
    ours = subprocess.run([sys.executable, "-c", code], env=clean, capture_output=True, text=True, timeout=120)
    assert ours.stdout.strip().splitlines()[-1] == "True", ours.stderr
    users = subprocess.run([sys.executable, "-c", code], env={**clean, "PYTORCH_ALLOC_CONF": "expandable_segments:False"},
                           capture_output=True, text=True, timeout=120)
    assert users.stdout.strip().splitlines()[-1] in ("False", "None"), users.stderr


def test_plan_prices_fragmentation_by_the_allocator_the_run_will_have(monkeypatch):
    """plan's reserved-over-allocated margin on a GPU: small under expandable segments (trainforge's
    default, and a user's own variable that asks for them), the default allocator's under a user's other
    setting; a CPU profile keeps its own."""
    from trainforge.engine.predict.fit import allocator_overhead
    from trainforge.hardware.profiles import ALLOCATOR_OVERHEAD, EXPANDABLE_ALLOCATOR_OVERHEAD, find_profile

    h100 = find_profile("h100")
    clear(monkeypatch)
    assert allocator_overhead(h100) == EXPANDABLE_ALLOCATOR_OVERHEAD < ALLOCATOR_OVERHEAD
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments: True")
    assert allocator_overhead(h100) == EXPANDABLE_ALLOCATOR_OVERHEAD
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:False")
    assert allocator_overhead(h100) == ALLOCATOR_OVERHEAD
    cpu = find_profile("h100").__class__(name="cpu", title="cpu", memory_gib=24, peak_tflops={"fp32": 1.0}, bandwidth_gbs=50,
                                         bf16=False, kind="cpu", allocator_overhead=0.3)
    assert allocator_overhead(cpu) == 0.3
