"""``trainforge generate`` and ``export --merge`` through the real CLI on a tiny T5 LoRA run: the
prompt goes to the encoder and the decoder's text streams to stdout; the merged directory loads with
``AutoModelForSeq2SeqLM`` without peft and computes the adapter model's logits. Eval of the run (and
of the merged model) equals the run's eval_loss; the run's report.html says what its tokens count.
BART, chat turns and QLoRA: tests/unit/test_seq2seq_tools.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from rich.console import Console

from integration_helpers import root_conftest, run_cli, show
from seq2seq_models import build_t5, reverse_rows
from trainforge.config.run import RunConfig
from trainforge.metrics.console import ConsoleReporter

conftest = root_conftest()
QUIET = ConsoleReporter(Console(quiet=True))
PROMPT = "reverse: alpha gamma"


@pytest.fixture(scope="module")
def t5_lora_run(tmp_path_factory) -> tuple[Path, Path, dict]:
    """A tiny T5 LoRA run on source/target rows, trained in this process (training through the CLI is
    tested in test_cli_seq2seq.py); a few steps: greedy text is words, not yet the reversal."""
    from trainforge.engine.trainer import train

    d = tmp_path_factory.mktemp("t5-lora")
    model = build_t5(d / "t5")
    conftest.write_jsonl(d / "train.jsonl", reverse_rows(64, seed=1))
    conftest.write_jsonl(d / "eval.jsonl", reverse_rows(12, seed=2))
    cfg = RunConfig.model_validate({
        "model": {"path": str(model), "method": "lora", "lora": {"r": 8, "alpha": 16}},
        "data": {"train": str(d / "train.jsonl"), "eval": str(d / "eval.jsonl"), "max_length": 48, "max_target_length": 12,
                 "num_workers": 1},
        "train": {"max_steps": 12, "micro_batch_size": 8, "precision": "fp32", "device": "cpu", "compile": False, "eval_max_batches": None},
        "optim": {"lr": 1.0e-2, "warmup_steps": 1},
        "log": {"every_steps": 4, "report_to": []},  # the report is written: one test reads it
    })
    summary = train(cfg, d / "run", QUIET).summary
    return d / "run", d / "eval.jsonl", summary


def _adapter_model(run: Path):
    from peft import AutoPeftModelForSeq2SeqLM

    return AutoPeftModelForSeq2SeqLM.from_pretrained(run / "final", dtype=torch.float32).eval()


def test_generate_streams_the_decoders_text_for_the_encoded_prompt(t5_lora_run):
    from transformers import AutoTokenizer

    run, _, _ = t5_lora_run
    proc = run_cli(["generate", run, "--prompt", PROMPT, "--temperature", "0", "--max-new-tokens", "6"], run.parent)
    assert proc.returncode == 0, show(proc)
    assert "LoRA adapter" in proc.stderr and "precision fp32" in proc.stderr, show(proc)

    model = _adapter_model(run)
    assert type(model.get_base_model()).__name__ == "T5ForConditionalGeneration"
    tok = AutoTokenizer.from_pretrained(run / "final")
    enc = tok(PROMPT, return_tensors="pt")  # T5's tokenizer ends inputs with </s>, as training's sources
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=6, do_sample=False)
    expected = tok.decode(out[0], skip_special_tokens=True)
    assert expected.strip() and proc.stdout == expected + "\n", show(proc)  # stdout holds the generated text only


def test_export_merge_loads_as_a_seq2seq_model_without_peft_with_the_adapter_logits(t5_lora_run, tmp_path, monkeypatch):
    from transformers import AutoModelForSeq2SeqLM

    from trainforge.tools.evaluate import evaluate_model

    run, eval_file, summary = t5_lora_run
    out = tmp_path / "merged"
    proc = run_cli(["export", run, "--merge", "--out", out], tmp_path)
    assert proc.returncode == 0, show(proc)
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= names, names
    assert "adapter_config.json" not in names

    g = torch.Generator().manual_seed(0)
    ids, dec = torch.randint(3, 40, (2, 10), generator=g), torch.randint(3, 40, (2, 6), generator=g)
    with torch.no_grad():
        reference = _adapter_model(run)(input_ids=ids, decoder_input_ids=dec).logits
    with monkeypatch.context() as m:
        m.setitem(sys.modules, "peft", None)  # importing peft fails: the merged directory needs transformers only
        merged = AutoModelForSeq2SeqLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(merged).__name__ == "T5ForConditionalGeneration"
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids, decoder_input_ids=dec).logits, reference, atol=1e-5, rtol=1e-5)

    # eval: the run (its adapter on its base) and the merged plain directory given the run's data settings
    # both give the run's own final eval_loss on its eval file
    assert evaluate_model(run, str(eval_file), [], QUIET)["loss"] == pytest.approx(summary["eval_loss"], rel=1e-5, abs=1e-6)
    settings = ["data.max_length=48", "data.max_target_length=12", "train.micro_batch_size=8", "train.precision=fp32"]
    result = evaluate_model(out, str(eval_file), settings, QUIET)
    assert result["loss"] == pytest.approx(summary["eval_loss"], rel=1e-5) and result["format"] == "source_target"
    assert abs(result["loss"] - summary["eval_loss_before"]) > 0.1


def test_the_runs_report_says_what_its_tokens_count(t5_lora_run):
    run, _, summary = t5_lora_run
    page = (run / "report.html").read_text()
    assert "encoder-decoder: tokens count source and target tokens, losses are per target token" in page
    assert f"{summary['data']['train_target_tokens']:,} target tokens per epoch" in page
    assert f"{summary['eval_loss']:.4f}" in page
