"""In-process training on tiny models: it learns, it is deterministic, final/ is the trained model."""

from __future__ import annotations

import json

import pytest
import torch
from rich.console import Console

from trainforge.config.run import RunConfig
from trainforge.engine.trainer import train
from trainforge.metrics.console import ConsoleReporter
from trainforge.metrics.tracker import read_metrics

TRAIN_KEYS = ("loss", "lr", "grad_norm", "tokens")


def quiet() -> ConsoleReporter:
    return ConsoleReporter(Console(quiet=True))


def run(config: dict, out) -> tuple:
    result = train(RunConfig.model_validate(config), out, quiet())
    return result, read_metrics(out / "metrics.jsonl")


@pytest.fixture
def text_config(finetune_config, toy_data_dir):
    cfg = dict(finetune_config)
    cfg["data"] = {
        "train": str(toy_data_dir / "text_train.jsonl"),
        "eval": str(toy_data_dir / "text_eval.jsonl"),
        "max_length": 32,
    }
    cfg["train"] = {**cfg["train"], "max_steps": 40, "micro_batch_size": 8, "grad_accum": 1, "eval_every": 20}
    cfg["optim"] = {"lr": 3e-3, "warmup_steps": 4}
    cfg["log"] = {"every_steps": 5, "report": False}
    return cfg


def test_learnable_task_reaches_clearly_lower_eval_loss(text_config, tmp_path):
    result, records = run(text_config, tmp_path / "run")
    s = result.summary
    assert s["eval_loss"] < 0.6 * s["eval_loss_before"], s
    evals = [r["eval_loss"] for r in records if "eval_loss" in r]
    assert [r["step"] for r in records if "eval_loss" in r] == [0, 20, 40]
    assert evals[0] > evals[1] > evals[2]


def test_same_seed_same_metrics_other_seed_differs(text_config, tmp_path):
    text_config["train"]["max_steps"] = 10
    _, a = run(text_config, tmp_path / "a")
    _, b = run(text_config, tmp_path / "b")
    strip = lambda recs: [{k: r[k] for k in r if k in TRAIN_KEYS or k.startswith("eval") or k == "step"} for r in recs]
    assert strip(a) == strip(b)
    text_config["train"]["seed"] = 1
    _, c = run(text_config, tmp_path / "c")
    assert strip(c) != strip(a)


@pytest.mark.parametrize("method", ["full", "lora"])
def test_final_dir_reloads_to_the_trained_model(finetune_config, tmp_path, method):
    finetune_config["model"]["method"] = method
    result, _ = run(finetune_config, tmp_path / "run")
    final = tmp_path / "run" / "final"
    if method == "lora":
        from peft import AutoPeftModelForCausalLM

        assert (final / "adapter_config.json").is_file()
        reloaded = AutoPeftModelForCausalLM.from_pretrained(final)
    else:
        from transformers import AutoModelForCausalLM

        reloaded = AutoModelForCausalLM.from_pretrained(final)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(final)
    ids = torch.tensor([tok("continue: alpha beta gamma")["input_ids"]])
    result.model.eval()
    reloaded.eval()
    with torch.no_grad():
        expected = result.model(input_ids=ids).logits
        got = reloaded(input_ids=ids).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 8 and summary["trainable_parameters"] <= summary["parameters"]
    if method == "lora":
        assert summary["trainable_parameters"] < summary["parameters"] / 2
    # the weights are as readable as config.json (transformers 5 wrote them 0600: nobody else on the machine could load them)
    config_mode = (final / ("adapter_config.json" if method == "lora" else "config.json")).stat().st_mode & 0o777
    assert {p.stat().st_mode & 0o777 for p in final.glob("*.safetensors")} == {config_mode}


def test_lora_trains_only_adapters(finetune_config, tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    finetune_config["model"]["method"] = "lora"
    finetune_config["model"]["lora"] = {"r": 4, "alpha": 8}
    result, _ = run(finetune_config, tmp_path / "run")
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    merged_names = {k.replace("base_model.model.", "").replace(".base_layer", ""): v for k, v in result.model.state_dict().items()}
    for name, value in base.items():
        torch.testing.assert_close(merged_names[name], value, rtol=0, atol=0, msg=name)  # frozen base untouched
    lora_b = [v for k, v in result.model.state_dict().items() if "lora_B" in k]
    assert lora_b and any(v.abs().sum() > 0 for v in lora_b)  # adapters moved from their zero init
