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


def test_from_scratch_moe_logs_its_router_aux_loss_and_expert_load(tmp_path, tiny_tokenizer_dir, toy_data_dir):
    settings = moe_config(tiny_tokenizer_dir, toy_data_dir)
    settings["log"]["report"] = True
    proc = run_cli(["train", write_config(tmp_path / "moe.yaml", settings), "--output", tmp_path / "run"], tmp_path)
    assert proc.returncode == 0, show(proc)
    steps = [r for r in records(tmp_path / "run") if "loss" in r]
    assert [r["step"] for r in steps] == [2, 4]
    for r in steps:  # top-2 of 4 experts: 2.0 when the load is even, more when it is not
        assert 1.9 < r["aux_loss"] < 4.0, r
        # each layer's most- and least-loaded expert's share of the real tokens; an even one is 2 / 4
        assert r["expert_load_even"] == 0.5 and len(r["expert_load_max_by_layer"]) == 2, r
        assert r["expert_load_max"] == pytest.approx(max(r["expert_load_max_by_layer"]), abs=1e-4), r
        assert r["expert_load_min"] == pytest.approx(min(r["expert_load_min_by_layer"]), abs=1e-4), r
        assert 0.5 <= r["expert_load_max"] <= 1.0 and 0.0 <= r["expert_load_min"] <= 0.5, r
    assert "| aux " in proc.stdout and "| load max " in proc.stdout
    from transformers import Qwen3MoeConfig  # the coefficient trained with: the config's (its default here)

    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["router_aux_loss_coef"] == Qwen3MoeConfig().router_aux_loss_coef
    report = (tmp_path / "run" / "report.html").read_text()
    assert 'alt="Expert load"' in report


def test_router_aux_loss_switched_off(tmp_path, tiny_tokenizer_dir, toy_data_dir):
    settings = moe_config(tiny_tokenizer_dir, toy_data_dir)
    settings["model"]["router_aux_loss"] = False
    settings["train"]["max_steps"] = 2
    proc = run_cli(["train", write_config(tmp_path / "moe.yaml", settings), "--output", tmp_path / "run"], tmp_path)
    assert proc.returncode == 0, show(proc)
    steps = [r for r in records(tmp_path / "run") if "loss" in r]
    assert not any("aux_loss" in r for r in steps)
    assert all("expert_load_max" in r for r in steps)  # the load is still measured
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["router_aux_loss_coef"] is None


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


def tiny_mixtral_dir(path: Path, tokenizer_dir: Path) -> Path:
    import torch
    from transformers import AutoTokenizer, MixtralConfig, MixtralForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = MixtralConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                           max_position_embeddings=128, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    MixtralForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def train_mixtral(tmp_path: Path, tokenizer_dir: Path, data_dir: Path, method: str):
    """(a tiny Mixtral directory, the CLI's process having trained ``method`` on it for 3 steps into tmp_path/run)."""
    base = tiny_mixtral_dir(tmp_path / "mixtral", tokenizer_dir)
    settings = moe_config(tokenizer_dir, data_dir)
    settings["model"] = {"path": str(base), "method": method}
    settings["train"]["max_steps"] = 3
    settings["optim"] = {"lr": 0.01}
    proc = run_cli(["train", write_config(tmp_path / f"{method}.yaml", settings), "--output", tmp_path / "run"], tmp_path)
    assert proc.returncode == 0, show(proc)
    return base, proc


def test_mixtral_lora_adapts_experts_not_router_and_merges_to_the_same_logits(tmp_path, tiny_tokenizer_dir, toy_data_dir):
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    base, proc = train_mixtral(tmp_path, tiny_tokenizer_dir, toy_data_dir, "lora")
    adapter = json.loads((tmp_path / "run" / "final" / "adapter_config.json").read_text())
    assert sorted(adapter["target_parameters"]) == ["experts.down_proj", "experts.gate_up_proj"]
    assert "gate" not in adapter["target_modules"]
    proc = run_cli(["export", tmp_path / "run", "--merge", "--out", tmp_path / "merged"], tmp_path)
    assert proc.returncode == 0, show(proc)
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), tmp_path / "run" / "final").eval()
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
        torch.testing.assert_close(merged(input_ids=ids).logits, peft(input_ids=ids).logits, rtol=1e-4, atol=1e-5)
    before, after = load_file(base / "model.safetensors"), load_file(tmp_path / "merged" / "model.safetensors")
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert any(".experts." in k for k in changed) and not any(k.endswith("gate.weight") for k in changed), changed


def test_mixtral_qlora_trains_4bit_experts_and_merges_what_it_computed(tmp_path, tiny_tokenizer_dir, toy_data_dir):
    """QLoRA quantizes the routed experts too (the weight facts count them as nf4); ``export --merge`` merges the
    adapters into the experts rounded through NF4, so the merged model computes what the trained QLoRA model did."""
    pytest.importorskip("bitsandbytes")
    import torch
    from transformers import AutoModelForCausalLM

    base, proc = train_mixtral(tmp_path, tiny_tokenizer_dir, toy_data_dir, "qlora")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert "frozen nf4" in proc.stdout and summary.get("lora_expert_weights_factored") == 4, proc.stdout[-2000:]
    proc = run_cli(["export", tmp_path / "run", "--merge", "--out", tmp_path / "merged"], tmp_path)
    assert proc.returncode == 0, show(proc)
    from safetensors.torch import load_file

    from trainforge.config.run import RunConfig
    from trainforge.model.load import build_model
    from trainforge.model.tokenizer import load_tokenizer

    # the trained QLoRA model as trainforge computes it (NF4 linear layers and experts, fp32 compute), its adapters
    cfg = RunConfig.model_validate({"model": {"path": str(base), "method": "qlora"}, "data": {"train": str(toy_data_dir)}})
    qlora = build_model(cfg.model, load_tokenizer(str(base)), seed=0, compute_dtype=torch.float32)
    adapters = load_file(tmp_path / "run" / "final" / "adapter_model.safetensors")
    params = {n.replace(".default", ""): p for n, p in qlora.named_parameters()}
    assert adapters.keys() <= params.keys()
    for name, value in adapters.items():
        params[name].data.copy_(value)
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
        torch.testing.assert_close(merged(input_ids=ids).logits, qlora.eval()(input_ids=ids).logits, rtol=1e-4, atol=1e-5)


def test_switch_transformers_trains_with_its_router_z_loss(tmp_path):
    """The one family whose transformers model adds a router z-loss (encoder-decoder, eager attention only:
    ``auto`` picks eager for it)."""
    import torch
    from seq2seq_models import reverse_rows, t5_tokenizer
    from transformers import SwitchTransformersConfig, SwitchTransformersForConditionalGeneration

    tok = t5_tokenizer()
    config = SwitchTransformersConfig(
        vocab_size=len(tok), d_model=32, d_kv=8, d_ff=48, num_layers=4, num_decoder_layers=4, num_heads=4,
        num_experts=4, num_sparse_encoder_layers=2, num_sparse_decoder_layers=2, pad_token_id=0, eos_token_id=1,
        decoder_start_token_id=0)
    torch.manual_seed(0)
    SwitchTransformersForConditionalGeneration(config).save_pretrained(tmp_path / "switch")
    tok.save_pretrained(tmp_path / "switch")
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in reverse_rows(32)))
    settings = {
        "model": {"path": str(tmp_path / "switch")},
        "data": {"train": str(data), "max_length": 32, "max_target_length": 12},
        "train": {"max_steps": 2, "micro_batch_size": 4, "grad_accum": 2, "precision": "fp32", "device": "cpu"},
        "log": {"every_steps": 2, "report": False, "sample_prompt": None},
    }
    proc = run_cli(["train", write_config(tmp_path / "switch.yaml", settings), "--output", tmp_path / "run"], tmp_path)
    assert proc.returncode == 0, show(proc)
    (rec,) = [r for r in records(tmp_path / "run") if "loss" in r]
    assert rec["z_loss"] > 0 and rec["aux_loss"] > 0, rec
    assert "| z " in proc.stdout and "attention eager" in proc.stdout
