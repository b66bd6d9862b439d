"""`trainforge train --preset smoke` proves the built-in default end to end, and says what it resolved."""

from __future__ import annotations

import json

import pytest
import yaml

from integration_helpers import run_cli, show


@pytest.mark.slow
def test_smoke_preset_on_the_built_in_default(tmp_path):
    proc = run_cli(["train", "--preset", "smoke", "--output", "run", "--set", "train.precision=fp32"], tmp_path)
    assert proc.returncode == 0, show(proc)
    run = tmp_path / "run"
    resolved = yaml.safe_load((run / "config.yaml").read_text())
    assert resolved["preset"] == "smoke" and resolved["train"]["max_steps"] == 20 and resolved["train"]["compile"] is False
    assert resolved["data"]["max_documents"] == 200 and resolved["train"]["eval_max_batches"] == 2
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 20 and (run / "final" / "config.json").is_file()
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("step-")) == ["step-00000020"]
    # the live advisor is silent on the built-in default: no false alarm on a healthy run. The advice the test
    # machine may rightly earn: the CPU peak probe cached by another test was taken while the other test worker
    # computed, so MFU came out above 100% and the advisor measured the peak again; and a slowdown it puts down to
    # a busy host (more processes than cores: the suite beside other work)
    warnings = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("warning:")]
    assert set(summary["advice"]) <= {"impossible_mfu", "slow"}, show(proc)
    assert all("the peak probe was taken under load" in line or "most likely a busy host" in line for line in warnings), show(proc)
    assert "what limited this run" in proc.stdout


def test_an_unknown_preset_exits_2_with_the_names(tmp_path):
    proc = run_cli(["train", "--preset", "quick", "--output", "run"], tmp_path)
    assert proc.returncode == 2, show(proc)
    assert "preset 'quick' is not known; the presets are: smoke, production" in proc.stderr
