"""`trainforge selftest` through the CLI: the table, the JSON, and the exit code of a failure."""

from __future__ import annotations

import json

import pytest
import torch

from integration_helpers import run_cli, show
from trainforge.tools.selftest import CHECKS, SelfTest, matrix


def test_quick_selftest_passes_and_prints_the_table(tmp_path):
    out = tmp_path / "selftest.json"
    proc = run_cli(["selftest", "--quick", "--out", out], tmp_path, timeout=300)
    assert proc.returncode == 0, show(proc)
    for column in ("path", "result", "loss vs fp32", "tokens/s"):
        assert column in proc.stdout, show(proc)
    names = [c.name for c in matrix(quick=True)] + list(CHECKS)
    lines = {line.split("│")[1].strip(): line for line in proc.stdout.splitlines() if line.count("│") > 2}
    for name in names:
        cuda_only = name == "pinned-memory" or name.startswith("kernels-")
        status = "skipped" if cuda_only and not torch.cuda.is_available() else "ok"
        assert name in lines and f" {status} " in lines[name], show(proc)
    assert "reference" in lines["fp32-chat-full-fused"] and "%" in lines["bf16-chat-full-fused"]
    assert "FAILED" not in proc.stdout and "passed" in proc.stdout
    # into a log (not a terminal), each path's line as it ends, before the table: a run cut off still says how far it got
    assert 0 < proc.stdout.index("  ok fp32-chat-full-fused (") < proc.stdout.index("┏"), show(proc)

    report = json.loads(out.read_text())
    assert report["passed"] is True and report["device"].startswith("cpu")
    results = {r["name"]: r for r in report["results"]}
    assert list(results) == names
    assert len(results["bf16-packed-full-fused"]["losses"]) == 8
    assert results["bf16-packed-full-fused"]["loss_gap"] < 1e-2


def test_a_failing_path_is_named_with_its_error_and_exits_1(tmp_path):
    SelfTest("cpu", workdir=tmp_path / "assets").assets  # built here, fault-free (its "pretrained" model is trained), cached for the CLI
    # every training run raises in its second step; the checks that train nothing still pass
    proc = run_cli(["selftest", "--quick"], tmp_path, timeout=300, faults={"raise_in_step": [2, "injected failure"]})
    assert proc.returncode == 1, show(proc)
    assert "FAILED fp32-packed-full-fused: RuntimeError: injected failure" in proc.stdout, show(proc)
    assert "FAILED bf16-packed-full-fused: RuntimeError: injected failure" in proc.stdout
    lines = {line.split("│")[1].strip(): line for line in proc.stdout.splitlines() if line.count("│") > 2}
    assert " ok " in lines["head-grads-bf16"] and " FAILED " in lines["resume-bf16"], show(proc)
    assert "FAILED" in proc.stdout.splitlines()[-1]


def test_a_signal_stops_the_whole_selftest(tmp_path):
    """SIGTERM (a job's time limit, ``timeout``) or Ctrl-C in a path's training stops selftest there with exit 75,
    as it stops a run. Before, only that path stopped (its run saved a checkpoint and raised) and the matrix went
    on: a GPU session's ``timeout 100`` on the CUDA matrix test did not end it."""
    SelfTest("cpu", workdir=tmp_path / "assets").assets  # built fault-free and cached for the CLI
    proc = run_cli(["selftest", "--quick"], tmp_path, timeout=300, faults={"signal_in_step": [2, "SIGTERM"]})
    assert proc.returncode == 75, show(proc)
    assert "selftest stopped by SIGTERM after 0 of " in proc.stderr, show(proc)
    assert "nothing was saved: run it again" in proc.stderr
    assert "bf16-" not in proc.stdout and "--output" not in proc.stderr, show(proc)  # no path after it ran; no resume advice


@pytest.mark.skipif(torch.cuda.is_available(), reason="asks for CUDA on a machine without it")
def test_cuda_on_a_machine_without_it_is_bad_input(tmp_path):
    proc = run_cli(["selftest", "--device", "cuda"], tmp_path)
    assert proc.returncode == 2, show(proc)
    assert "CUDA is not available" in proc.stderr
