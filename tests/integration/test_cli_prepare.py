"""`trainforge prepare` builds the token cache; the next `train` on the same inputs reuses it and says so."""

from __future__ import annotations

import json

from integration_helpers import root_conftest, run_cli, show

write_config = root_conftest().write_config


def test_prepare_then_train_reuses_the_cache(tmp_path, finetune_config):
    finetune_config["data"]["cache_dir"] = str(tmp_path / "cache")
    finetune_config["train"]["max_steps"] = 2
    config = write_config(tmp_path / "run.yaml", finetune_config)
    prep = run_cli(["prepare", config], tmp_path, timeout=120)
    assert prep.returncode == 0, show(prep)
    assert "tokenizing into" in prep.stdout and "packed rows" in prep.stdout, show(prep)
    assert len(list((tmp_path / "cache" / "data").iterdir())) == 1
    proc = run_cli(["train", config, "--output", tmp_path / "run"], tmp_path, timeout=180)
    assert proc.returncode == 0, show(proc)
    assert "cache hit" in proc.stdout, show(proc)
    data = json.loads((tmp_path / "run" / "summary.json").read_text())["data"]
    assert data["cache_hit"] is True and data["format"] == "prompt_completion"
    assert 0.5 < data["row_efficiency"] <= 1.0 and data["rows"] > 0
    for key in ("truncated", "dropped_too_long", "dropped_masked", "bad_rows"):
        assert key in data


def test_prepare_skip_bad_rows_reports_them(tmp_path, finetune_config, toy_data_dir):
    lines = (toy_data_dir / "pc_train.jsonl").read_text().splitlines()
    lines.insert(2, "{broken")
    (tmp_path / "bad.jsonl").write_text("\n".join(lines) + "\n")
    finetune_config["data"].update(train=str(tmp_path / "bad.jsonl"), on_bad_row="skip")
    config = write_config(tmp_path / "run.yaml", finetune_config)
    proc = run_cli(["prepare", config], tmp_path, timeout=120)
    assert proc.returncode == 0, show(proc)
    assert "1 bad rows skipped" in proc.stdout and "bad.jsonl:3" in proc.stdout, show(proc)
    finetune_config["data"]["on_bad_row"] = "error"
    config = write_config(tmp_path / "run.yaml", finetune_config)
    proc = run_cli(["prepare", config], tmp_path, timeout=120)
    assert proc.returncode == 2 and "bad.jsonl:3: malformed JSON" in proc.stderr, show(proc)
