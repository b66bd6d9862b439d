"""Low-bit optimizers train the built-in default through the real CLI and say what they hold."""

from __future__ import annotations

import json

import pytest
import yaml

from integration_helpers import run_cli, show


@pytest.mark.slow
@pytest.mark.parametrize("name, bytes_per_value", [("adamw_8bit", 2.1), ("adamw_4bit", 1.2)])
def test_low_bit_optimizer_trains_the_built_in_default(tmp_path, name, bytes_per_value):
    proc = run_cli(["train", "--output", "run", "--set", f"optim.name={name}", "--set", "train.max_steps=3",
                    "--set", "data.max_documents=100", "--set", "train.precision=fp32", "--set", "train.eval_max_batches=1"], tmp_path)
    assert proc.returncode == 0, show(proc)
    assert f"optimizer: {name}" in proc.stdout
    run = tmp_path / "run"
    assert yaml.safe_load((run / "config.yaml").read_text())["optim"]["name"] == name
    summary = json.loads((run / "summary.json").read_text())
    assert summary["optimizer"]["name"] == name and summary["steps"] == 3
    # the state is what the name promises: about these bytes per trainable value (AdamW's: 8)
    state = summary["optimizer"]["state_bytes"]
    assert 0 < state < bytes_per_value * summary["trainable_parameters"]


def test_offload_on_a_cpu_is_refused_naming_the_setting(tmp_path):
    proc = run_cli(["train", "--output", "run", "--set", "optim.offload=cpu", "--set", "train.device=cpu"], tmp_path)
    assert proc.returncode == 2, show(proc)
    assert "optim.offload: cpu" in proc.stderr and "set optim.offload: none" in proc.stderr
