"""Memory levers through the real CLI: activation checkpointing (full, LoRA), the bf16 frozen base,
QLoRA and DoRA; each trains, reports what it did in summary.json, and resumes exactly."""

from __future__ import annotations

import copy
import json
import platform
import shutil
from pathlib import Path

import pytest

from integration_helpers import root_conftest, run_cli, show

write_config = root_conftest().write_config


@pytest.fixture(scope="module")
def llama64_dir(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    """A tiny Llama at width 64 (bitsandbytes' CPU 4-bit kernels need blocks of 64 inputs)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from trainforge.model.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny_tokenizer_dir)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         max_position_embeddings=128, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)  # fmt: skip
    path = tmp_path_factory.mktemp("llama64")
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _train(tmp_path: Path, cfg: dict, name: str, *overrides: str, cli: bool = True) -> tuple[dict, list[dict]]:
    """``trainforge train`` in a subprocess; ``cli=False``: the same run in this process (for a reference
    run that the test compares the CLI's against: it saves an interpreter start and torch's import)."""
    config = write_config(tmp_path / f"{name}.yaml", cfg)
    run = tmp_path / name
    if cli:
        proc = run_cli(["train", config, "--output", run, *[a for o in overrides for a in ("--set", o)]], tmp_path)
        assert proc.returncode == 0, show(proc)
    else:
        from rich.console import Console

        from trainforge.config.run import load_config
        from trainforge.engine.trainer import train
        from trainforge.metrics.console import ConsoleReporter

        train(load_config(config, list(overrides)), run, ConsoleReporter(Console(quiet=True)))
    losses = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r and "step" in r]
    return json.loads((run / "summary.json").read_text()), losses


def _config(finetune_config: dict, model_dir: Path, **model) -> dict:
    cfg = copy.deepcopy(finetune_config)
    cfg["model"] = {"path": str(model_dir), **model}
    cfg["train"].update(max_steps=4, grad_accum=1)
    cfg["log"] = {"every_steps": 1, "report": False}
    return cfg


@pytest.mark.parametrize("method", ["full", "lora"])
def test_activation_checkpointing_gives_the_same_losses(tmp_path, finetune_config, tiny_model_dir, method):
    cfg = _config(finetune_config, tiny_model_dir, method=method)
    plain, plain_losses = _train(tmp_path, cfg, "plain", cli=False)  # the reference
    checked, checked_losses = _train(tmp_path, cfg, "checked", "train.activation_checkpointing=true")
    assert checked["activation_checkpointing"] is True and plain["activation_checkpointing"] is False
    # a CPU run that needs checkpointing gives its heap's freed blocks back (hardware/heap.py), the plain one not
    assert checked["compact_heap"] is (platform.libc_ver()[0] == "glibc") and plain["compact_heap"] is False
    assert [r["loss"] for r in checked_losses] == pytest.approx([r["loss"] for r in plain_losses], rel=1e-5)
    assert checked["eval_loss"] == pytest.approx(plain["eval_loss"], rel=1e-5)


def test_lora_on_a_bf16_run_stores_the_base_in_bf16(tmp_path, finetune_config, tiny_model_dir):
    summary, _ = _train(tmp_path, _config(finetune_config, tiny_model_dir, method="lora"), "bf16", "train.precision=bf16")
    weights = summary["weights"]
    assert set(weights["frozen"]) == {"bfloat16"} and set(weights["trainable"]) == {"float32"}
    assert weights["trainable"]["float32"] == summary["trainable_parameters"]


def _resumes_exactly(tmp_path: Path, cfg: dict, *overrides: str) -> dict:
    """Train 4 steps with a checkpoint at 2; a copy of the run cut back to that checkpoint resumes
    to the same losses and the same final adapter."""
    cfg = copy.deepcopy(cfg)
    cfg["checkpoint"] = {"every_steps": 2, "keep_last": 3}
    whole, losses = _train(tmp_path, cfg, "whole", *overrides)
    cut = tmp_path / "cut"
    shutil.copytree(tmp_path / "whole", cut)
    for later in [p for p in (cut / "checkpoints").iterdir() if p.is_dir() and not p.name.endswith("00000002")]:
        shutil.rmtree(later)
    (cut / "checkpoints" / "latest").write_text("step-00000002")
    shutil.rmtree(cut / "final")
    (cut / "summary.json").unlink()
    lines = (cut / "metrics.jsonl").read_text().splitlines()
    (cut / "metrics.jsonl").write_text("".join(line + "\n" for line in lines if json.loads(line).get("step", 0) <= 2))
    resumed, resumed_losses = _train(tmp_path, cfg, "cut", *overrides)
    assert resumed["resumed_from_step"] == 2
    assert [r["loss"] for r in resumed_losses if r["step"] > 2] == [r["loss"] for r in losses if r["step"] > 2]
    a, b = (json.loads((tmp_path / n / "final" / "adapter_config.json").read_text()) for n in ("whole", "cut"))
    a["target_modules"], b["target_modules"] = sorted(a["target_modules"]), sorted(b["target_modules"])  # a set in PEFT
    assert a == b
    assert (tmp_path / "whole" / "final" / "adapter_model.safetensors").read_bytes() == (cut / "final" / "adapter_model.safetensors").read_bytes()
    return whole


def test_dora_trains_resumes_exactly_and_final_loads(tmp_path, finetune_config, tiny_model_dir):
    from peft import PeftConfig

    cfg = _config(finetune_config, tiny_model_dir, method="lora", lora={"use_dora": True, "use_rslora": True})
    summary = _resumes_exactly(tmp_path, cfg)
    peft_config = PeftConfig.from_pretrained(tmp_path / "whole" / "final")
    assert peft_config.use_dora and peft_config.use_rslora and summary["eval_loss"] is not None


def test_qlora_trains_with_checkpointing_resumes_exactly_and_keeps_the_adapter_only(tmp_path, finetune_config, llama64_dir):
    pytest.importorskip("bitsandbytes", reason="QLoRA needs the qlora extra")
    cfg = _config(finetune_config, llama64_dir, method="qlora")
    cfg["train"]["precision"] = "auto"
    summary = _resumes_exactly(tmp_path, cfg, "train.activation_checkpointing=true")
    assert summary["weights"]["frozen"]["nf4"] > 0 and set(summary["weights"]["trainable"]) == {"float32"}
    files = sorted(p.name for p in (tmp_path / "whole" / "final").iterdir())
    assert "adapter_model.safetensors" in files and "model.safetensors" not in files
    step2 = tmp_path / "whole" / "checkpoints"
    assert all(p.stat().st_size < 5_000_000 for c in step2.iterdir() for p in c.rglob("*") if p.is_file())  # no base weights
