"""Mixture-of-experts models through the real CLI: the router aux loss logged, routing that cannot run refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from integration_helpers import root_conftest, run_cli, show

write_config = root_conftest().write_config

MOE_INIT = {
    "architecture": "qwen3_moe", "hidden_size": 32, "intermediate_size": 48, "moe_intermediate_size": 16,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 4,
    "num_experts_per_tok": 2, "max_position_embeddings": 128,
}


def moe_config(tokenizer_dir: Path, data_dir: Path, **init) -> dict:
    return {
        "model": {"init": {**MOE_INIT, **init}, "tokenizer": str(tokenizer_dir)},
        "data": {"train": str(data_dir / "text_train.jsonl"), "max_length": 64},
        "train": {"max_steps": 4, "micro_batch_size": 2, "grad_accum": 2, "precision": "fp32", "device": "cpu"},
        "log": {"every_steps": 2, "report": False, "sample_prompt": None},
    }


def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def test_from_scratch_moe_logs_its_router_aux_loss(tmp_path, tiny_tokenizer_dir, toy_data_dir):
    cfg = write_config(tmp_path / "moe.yaml", moe_config(tiny_tokenizer_dir, toy_data_dir))
    proc = run_cli(["train", cfg, "--output", tmp_path / "run"], tmp_path)
    assert proc.returncode == 0, show(proc)
    steps = [r for r in records(tmp_path / "run") if "loss" in r]
    assert [r["step"] for r in steps] == [2, 4]
    for r in steps:  # top-2 of 4 experts: 2.0 when the load is even, more when it is not
        assert 1.9 < r["aux_loss"] < 4.0, r
    assert "| aux " in proc.stdout


def test_router_aux_loss_switched_off(tmp_path, tiny_tokenizer_dir, toy_data_dir):
    settings = moe_config(tiny_tokenizer_dir, toy_data_dir)
    settings["model"]["router_aux_loss"] = False
    settings["train"]["max_steps"] = 2
    proc = run_cli(["train", write_config(tmp_path / "moe.yaml", settings), "--output", tmp_path / "run"], tmp_path)
    assert proc.returncode == 0, show(proc)
    assert not any("aux_loss" in r for r in records(tmp_path / "run"))


def test_more_experts_per_token_than_experts_is_exit_2_naming_both(tmp_path, tiny_tokenizer_dir, toy_data_dir):
    cfg = write_config(tmp_path / "moe.yaml", moe_config(tiny_tokenizer_dir, toy_data_dir, num_experts_per_tok=8))
    proc = run_cli(["train", cfg, "--output", tmp_path / "run"], tmp_path)
    assert proc.returncode == 2, show(proc)
    assert "num_experts_per_tok (8)" in proc.stderr and "num_experts (4)" in proc.stderr, show(proc)
    assert "Traceback" not in proc.stderr


def test_model_dir_whose_config_routes_too_many_is_exit_2(tmp_path, tiny_tokenizer_dir, toy_data_dir):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    fields = {k: v for k, v in MOE_INIT.items() if k != "architecture"}
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(vocab_size=320, **fields))
    model.save_pretrained(tmp_path / "moe")
    config = json.loads((tmp_path / "moe" / "config.json").read_text())
    config["num_experts_per_tok"] = 6
    (tmp_path / "moe" / "config.json").write_text(json.dumps(config))
    settings = moe_config(tiny_tokenizer_dir, toy_data_dir)
    settings["model"] = {"path": str(tmp_path / "moe"), "tokenizer": str(tiny_tokenizer_dir)}
    proc = run_cli(["train", write_config(tmp_path / "moe.yaml", settings), "--output", tmp_path / "run"], tmp_path)
    assert proc.returncode == 2, show(proc)
    assert "config.json" in proc.stderr and "num_experts_per_tok (6)" in proc.stderr, show(proc)
