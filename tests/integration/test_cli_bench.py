"""`trainforge bench` through the CLI: a table, a JSON file, one result per variant."""

from __future__ import annotations

import json

from integration_helpers import root_conftest, run_cli, show

write_config = root_conftest().write_config


def test_bench_sweep_writes_json(tmp_path, finetune_config):
    config = write_config(tmp_path / "run.yaml", finetune_config)
    out = tmp_path / "bench.json"
    proc = run_cli(
        ["bench", config, "--sweep", "train.micro_batch_size=2,4", "--steps", "3", "--warmup", "1", "--synthetic", "--out", out],
        tmp_path,
        timeout=300,
    )
    assert proc.returncode == 0, show(proc)
    assert "tokens/s" in proc.stdout and "MFU" in proc.stdout, show(proc)
    results = json.loads(out.read_text())
    assert [r["overrides"] for r in results] == [
        ["train.micro_batch_size=2", "train.grad_accum=4"],
        ["train.micro_batch_size=4", "train.grad_accum=2"],
    ]
    for r in results:
        assert r["tokens_per_s"] > 0 and r["peak_memory_bytes"] > 0 and 0 <= r["data_wait_pct"] <= 100
    # the same global batch over the same rows: the same loss, whatever the micro-batch
    assert abs(results[0]["loss"] - results[1]["loss"]) < 1e-4
    assert not (tmp_path / "checkpoints").exists()
