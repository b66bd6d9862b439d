"""End to end: ``trainforge train`` in a subprocess, then check every file the run wrote.

The strongest check reloads ``final/`` with plain transformers / PEFT and recomputes the eval
loss with trainforge's own data and eval code: it must equal ``summary.json``'s ``eval_loss``,
which proves ``final/`` holds exactly the model that was trained and evaluated.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from integration_helpers import root_conftest, run_cli, show

write_config = root_conftest().write_config

TRAIN_KEYS = {"step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "elapsed_s"}
SUMMARY_KEYS = {"wall_time_s", "steps", "tokens", "tokens_per_s", "peak_memory_bytes", "final_train_loss", "eval_loss"}


@pytest.fixture
def trainforge_cli(tmp_path):
    """Run ``trainforge <args>`` with the test's tmp_path as working directory."""
    return lambda *args: run_cli(list(args), tmp_path)


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _recompute_eval_loss(model: torch.nn.Module, tokenizer, run_config: Path) -> float:
    """Eval loss of ``model`` on the run's eval data, built exactly as the trainer builds it."""
    from rich.console import Console

    from trainforge.config.run import load_config
    from trainforge.data.loader import eval_batches
    from trainforge.engine.evaluate import evaluate
    from trainforge.data.plan import plan_data
    from trainforge.hardware.device import PRECISIONS
    from trainforge.metrics.console import ConsoleReporter

    cfg = load_config(run_config)
    plan = plan_data(cfg, tokenizer, ConsoleReporter(Console(quiet=True)))
    chosen = json.loads((Path(run_config).parent / "summary.json").read_text())["eval_batches"]  # eval_max_batches: auto
    batches = eval_batches(plan.eval_rows, plan.eval_collate, cfg.train.micro_batch_size, chosen)
    assert batches, "the eval split is empty"
    result = evaluate(model, batches, PRECISIONS["fp32"], torch.device("cpu"))
    return result["eval_loss"]


def _check_run_dir(run: Path, source_config: Path | None, overrides: list[str] = ()) -> tuple[dict, list[dict]]:
    """The files every run writes; returns (summary, metrics records)."""
    from trainforge.config.run import load_config

    for name in ("config.yaml", "metrics.jsonl", "summary.json", "final"):
        assert (run / name).exists(), f"{name} missing from {run}: {sorted(p.name for p in run.iterdir())}"
    assert (run / "final").is_dir()

    # config.yaml: the fully resolved config, every default spelled out
    written = yaml.safe_load((run / "config.yaml").read_text())
    resolved = load_config(source_config, list(overrides))
    assert written == resolved.model_dump(mode="json")
    assert written["optim"]["schedule"] == resolved.optim.schedule  # a default the source never mentioned
    assert load_config(run / "config.yaml") == resolved  # and it loads back to the same config

    # metrics.jsonl: train records and eval records
    records = _read_jsonl(run / "metrics.jsonl")
    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_loss" in r]
    assert train, records
    for r in train:
        assert TRAIN_KEYS <= r.keys(), r
        assert all(math.isfinite(r[k]) for k in TRAIN_KEYS), r
    steps = [r["step"] for r in train]
    assert all(a < b for a, b in zip(steps, steps[1:])), f"train steps not strictly increasing: {steps}"
    tokens = [r["tokens"] for r in train]
    assert all(a < b for a, b in zip(tokens, tokens[1:])), f"token counts not increasing: {tokens}"
    for r in evals:
        assert {"step", "eval_loss"} <= r.keys(), r
        assert math.isfinite(r["eval_loss"])

    # summary.json
    summary = json.loads((run / "summary.json").read_text())
    assert SUMMARY_KEYS <= summary.keys(), sorted(summary)
    assert summary["steps"] == resolved.train.max_steps == steps[-1]
    assert summary["tokens"] == tokens[-1]
    assert summary["final_train_loss"] == pytest.approx(train[-1]["loss"])
    assert summary["wall_time_s"] > 0 and summary["tokens_per_s"] > 0 and summary["peak_memory_bytes"] > 0
    if evals:
        assert evals[-1]["step"] == summary["steps"]
        assert summary["eval_loss"] == evals[-1]["eval_loss"]
    return summary, records


# ---------------------------------------------------------------- full fine-tune


def test_full_finetune_writes_run_dir_and_final_is_the_trained_model(tmp_path, trainforge_cli, finetune_config):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = write_config(tmp_path / "finetune.yaml", finetune_config)
    run = tmp_path / "run"
    proc = trainforge_cli("train", config, "--output", run)
    assert proc.returncode == 0, show(proc)

    summary, records = _check_run_dir(run, config)
    assert summary["steps"] == 8
    assert [r["step"] for r in records if "loss" in r] == [2, 4, 6, 8]  # log.every_steps=2
    assert [r["step"] for r in records if "eval_loss" in r] == [0, 8]  # before and after
    assert summary["eval_loss"] < summary["eval_loss_before"], "8 steps at lr 1e-3 should lower the eval loss"

    final = run / "final"
    model = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(final)
    assert not hasattr(model, "peft_config")
    recomputed = _recompute_eval_loss(model, tokenizer, run / "config.yaml")
    assert recomputed == pytest.approx(summary["eval_loss"], rel=1e-5)


# ---------------------------------------------------------------- LoRA


def test_lora_finetune_final_is_adapter_that_reproduces_eval_loss(tmp_path, trainforge_cli, finetune_config, tiny_model_dir):
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = write_config(tmp_path / "finetune.yaml", finetune_config)
    run = tmp_path / "run"
    proc = trainforge_cli("train", config, "--set", "model.method=lora", "--output", run)
    assert proc.returncode == 0, show(proc)

    summary, _ = _check_run_dir(run, config, ["model.method=lora"])
    assert yaml.safe_load((run / "config.yaml").read_text())["model"]["method"] == "lora"
    assert summary["trainable_parameters"] < summary["parameters"]

    final = run / "final"
    names = {p.name for p in final.iterdir()}
    assert "adapter_config.json" in names, names
    assert names & {"adapter_model.safetensors", "adapter_model.bin"}, names

    tokenizer = AutoTokenizer.from_pretrained(final)
    model = AutoPeftModelForCausalLM.from_pretrained(final, dtype=torch.float32)
    recomputed = _recompute_eval_loss(model, tokenizer, run / "config.yaml")
    assert recomputed == pytest.approx(summary["eval_loss"], rel=1e-5)

    # the adapter changed the model: the base alone evaluates differently
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    base_loss = _recompute_eval_loss(base, tokenizer, run / "config.yaml")
    assert base_loss == pytest.approx(summary["eval_loss_before"], rel=1e-5)  # LoRA starts as the identity
    assert abs(base_loss - summary["eval_loss"]) > 1e-4, (base_loss, summary["eval_loss"])


# ---------------------------------------------------------------- --set overrides


def test_set_overrides_reach_the_run(tmp_path, trainforge_cli, finetune_config):
    config = write_config(tmp_path / "finetune.yaml", finetune_config)
    run = tmp_path / "run"
    overrides = ["train.max_steps=3", "optim.lr=5e-4", "train.cpu_threads=1"]
    proc = trainforge_cli("train", config, *[a for o in overrides for a in ("--set", o)], "--output", run)
    assert proc.returncode == 0, show(proc)
    assert "| cpu (1 thread) |" in proc.stdout, show(proc)

    summary, records = _check_run_dir(run, config, overrides)
    assert summary["steps"] == 3
    written = yaml.safe_load((run / "config.yaml").read_text())
    assert written["optim"]["lr"] == 0.0005
    assert written["train"]["max_steps"] == 3 and written["train"]["cpu_threads"] == 1
    assert max(r["step"] for r in records if "loss" in r) == 3
    assert all(r["lr"] <= 5e-4 for r in records if "lr" in r)


# ---------------------------------------------------------------- the built-in default


def test_builtin_default_runs_when_shrunk(tmp_path, trainforge_cli):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run = tmp_path / "default-run"
    overrides = [
        "train.max_steps=4",
        "data.max_documents=12",
        "train.eval_every=2",
        "log.every_steps=2",
        "log.sample_tokens=8",
        "model.init.hidden_size=32",
        "model.init.intermediate_size=64",
        "model.init.num_hidden_layers=1",
        "model.tokenizer_vocab_size=400",
        "log.report=false",
    ]
    proc = trainforge_cli("train", *[a for o in overrides for a in ("--set", o)], "--output", run)
    assert proc.returncode == 0, show(proc)
    for phrase in ("eval before", "eval after", "sample"):
        assert phrase in proc.stdout, show(proc)

    summary, records = _check_run_dir(run, None, overrides)
    assert summary["steps"] == 4
    assert [r["step"] for r in records if "eval_loss" in r] == [0, 2, 4]
    assert "sample" in summary

    final = run / "final"
    model = AutoModelForCausalLM.from_pretrained(final)
    tokenizer = AutoTokenizer.from_pretrained(final)
    assert model.config.hidden_size == 32 and model.config.num_hidden_layers == 1
    assert len(tokenizer) <= model.get_input_embeddings().num_embeddings
    ids = tokenizer("def ", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert model(input_ids=ids).logits.shape[-1] == model.config.vocab_size


# ---------------------------------------------------------------- refusing to reuse a run directory


def test_output_dir_holding_a_run_is_refused(tmp_path, trainforge_cli, finetune_config):
    config = write_config(tmp_path / "finetune.yaml", finetune_config)
    run = tmp_path / "previous-run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    (run / "config.yaml").write_text("# the earlier run's config\n")

    proc = trainforge_cli("train", config, "--output", run)
    assert proc.returncode == 2, show(proc)
    assert str(run) in proc.stderr, show(proc)
    assert "Traceback" not in proc.stderr, show(proc)
    # nothing of the earlier run was touched
    assert (run / "metrics.jsonl").read_text() == '{"step": 1, "loss": 1.0}\n'
    assert (run / "config.yaml").read_text() == "# the earlier run's config\n"
    assert sorted(p.name for p in run.iterdir()) == ["config.yaml", "metrics.jsonl"]


def test_a_folder_that_is_not_a_run_is_refused_and_left_as_it_was(tmp_path, trainforge_cli, finetune_config):
    config = write_config(tmp_path / "finetune.yaml", finetune_config)
    mine = tmp_path / "my-folder"
    mine.mkdir()
    (mine / "config.yaml").write_text("# my own notes\n")
    (mine / "report.html").write_text("<p>my report</p>")

    proc = trainforge_cli("train", config, "--output", mine)
    assert proc.returncode == 2, show(proc)
    assert "is not a trainforge run directory" in proc.stderr and "config.yaml" in proc.stderr, show(proc)
    assert "Traceback" not in proc.stderr, show(proc)
    assert (mine / "config.yaml").read_text() == "# my own notes\n"
    assert (mine / "report.html").read_text() == "<p>my report</p>"
    assert sorted(p.name for p in mine.iterdir()) == ["config.yaml", "report.html"]

    empty = tmp_path / "empty"
    empty.mkdir()
    proc = trainforge_cli("train", config, "--output", empty, "--set", "train.max_steps=1")
    assert proc.returncode == 0, show(proc)
    assert (empty / "final").is_dir()


# ---------------------------------------------------------------- console output is text, not markup


def test_sample_text_with_brackets_is_printed_verbatim(tmp_path, trainforge_cli, finetune_config):
    cfg = dict(finetune_config, log={"every_steps": 1, "sample_prompt": "x[/i] = ", "sample_tokens": 4, "report": False})
    cfg["train"] = dict(cfg["train"], max_steps=1)
    config = write_config(tmp_path / "finetune.yaml", cfg)
    run = tmp_path / "run"
    proc = trainforge_cli("train", config, "--output", run)
    assert proc.returncode == 0, show(proc)
    assert (run / "summary.json").exists()
    assert "x[/i] = " in proc.stdout, show(proc)
