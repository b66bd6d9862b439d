"""``data.max_length: auto`` through the real CLI: the run says what it took and why (console, summary.json, the
run's config.yaml), and a resume of it takes its checkpoint's length and continues exactly."""

from __future__ import annotations

import copy
import json
import shutil

import yaml

from integration_helpers import root_conftest, run_cli, show

write_config = root_conftest().write_config


def losses(run) -> dict[int, float]:
    records = map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r["loss"] for r in records if "loss" in r and "step" in r}


def test_auto_takes_the_model_positions_and_a_resume_keeps_its_length(tmp_path, finetune_config):
    cfg = copy.deepcopy(finetune_config)  # the tiny Llama declares 128 positions: far below this machine's memory
    cfg["data"]["max_length"] = "auto"
    cfg["train"].update(max_steps=4, grad_accum=1)
    cfg["checkpoint"] = {"every_steps": 2, "keep_last": 3}
    cfg["log"] = {"every_steps": 1, "report": False}
    config = write_config(tmp_path / "run.yaml", cfg)
    whole = tmp_path / "whole"
    proc = run_cli(["train", config, "--output", whole], tmp_path)
    assert proc.returncode == 0, show(proc)
    why = "128: capped by the model's max_position_embeddings (128); a rough estimate of a step there"
    assert f"max_length auto -> {why}" in proc.stdout
    summary = json.loads((whole / "summary.json").read_text())
    assert summary["max_length"] == 128 and summary["max_length_reason"].startswith(why)
    assert yaml.safe_load((whole / "config.yaml").read_text())["data"]["max_length"] == 128  # the run's resolved config

    cut = tmp_path / "cut"  # the same run stopped after its step-2 checkpoint
    shutil.copytree(whole, cut)
    for later in [p for p in (cut / "checkpoints").iterdir() if p.is_dir() and not p.name.endswith("00000002")]:
        shutil.rmtree(later)
    (cut / "checkpoints" / "latest").write_text("step-00000002")
    shutil.rmtree(cut / "final")
    (cut / "summary.json").unlink()
    kept = [line for line in (cut / "metrics.jsonl").read_text().splitlines() if json.loads(line).get("step", 0) <= 2]
    (cut / "metrics.jsonl").write_text("".join(line + "\n" for line in kept))
    proc = run_cli(["train", config, "--output", cut], tmp_path)  # the same config, max_length: auto
    assert proc.returncode == 0, show(proc)
    assert "max_length auto -> 128: as in the checkpoint being resumed" in proc.stdout
    resumed = json.loads((cut / "summary.json").read_text())
    assert resumed["resumed_from_step"] == 2 and resumed["max_length"] == 128
    assert {s: v for s, v in losses(cut).items() if s > 2} == {s: v for s, v in losses(whole).items() if s > 2}
