"""``trainforge generate``, ``eval`` and ``export`` through the real CLI, on the demo's run (shrunk)
and on a LoRA run: eval of a run equals the run's own final eval loss, generation streams the
model's text, and the merged export loads without PEFT and computes the adapter model's logits."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainforge.tools.evaluate import render
from integration_helpers import CLI_TIMEOUT_S, root_conftest, run_cli, show

conftest = root_conftest()


def _train(run: Path, args: list) -> dict:
    proc = run_cli(["train", *args, "--output", run], run.parent)
    assert proc.returncode == 0, show(proc)
    return json.loads((run / "summary.json").read_text())


def _cli_with_stdin(args: list, stdin: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return subprocess.run(
        [sys.executable, "-m", "trainforge", *(str(a) for a in args)],
        input=stdin, cwd=cwd, env=env, capture_output=True, text=True, timeout=CLI_TIMEOUT_S,
    )


def _eval_json(model: Path, data: Path, *extra: str) -> dict:
    proc = run_cli(["eval", model, "--data", data, "--json", *extra], model.parent)
    assert proc.returncode == 0, show(proc)
    result = json.loads(proc.stdout)  # stdout holds the JSON object only; progress went to stderr
    assert result["perplexity"] == pytest.approx(math.exp(result["loss"]))
    assert result["tokens"] > 0
    return result


def _evaluate(model: Path, data: Path, overrides: list[str]) -> dict:
    """``trainforge eval``'s function, in this process."""
    from rich.console import Console

    from trainforge.metrics.console import ConsoleReporter
    from trainforge.tools.evaluate import evaluate_model

    return evaluate_model(model, str(data), overrides, ConsoleReporter(Console(quiet=True)))


# ---------------------------------------------------------------- a LoRA run


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, tiny_model_dir, toy_data_dir) -> tuple[Path, dict]:
    d = tmp_path_factory.mktemp("lora")
    config = conftest.write_config(d / "lora.yaml", {
        "model": {"path": str(tiny_model_dir), "method": "lora", "lora": {"r": 4, "alpha": 16}},
        "data": {"train": str(toy_data_dir / "pc_train.jsonl"), "eval": str(toy_data_dir / "pc_eval.jsonl"), "max_length": 64},
        "train": {"max_steps": 4, "micro_batch_size": 4, "precision": "fp32", "device": "cpu", "eval_max_batches": None},
        "optim": {"lr": 3.0e-3, "warmup_steps": 1},
        "log": {"every_steps": 2, "report": False},
    })
    run = d / "run"
    return run, _train(run, [config])


def _adapter_model(run: Path):
    from peft import AutoPeftModelForCausalLM

    return AutoPeftModelForCausalLM.from_pretrained(run / "final", dtype=torch.float32).eval()


def test_eval_of_a_lora_run_equals_its_final_eval_loss(lora_run, toy_data_dir):
    run, summary = lora_run
    result = _eval_json(run, toy_data_dir / "pc_eval.jsonl")
    assert result["loss"] == pytest.approx(summary["eval_loss"], rel=1e-5, abs=1e-6)
    assert result["precision"] == summary["precision"] == "fp32"
    assert result["format"] == "prompt_completion"
    assert abs(result["loss"] - summary["eval_loss_before"]) > 1e-4  # the adapter was loaded, not the base alone

    # completion-only masks as in training: with the prompt learned too, more tokens count
    # (in this process: the CLI's own path is checked above, an interpreter start costs seconds)
    everything = _evaluate(run, toy_data_dir / "pc_eval.jsonl", ["data.train_on_prompt=true"])
    assert everything["tokens"] > result["tokens"]
    assert f"{result['loss']:.6f}" in render(result) and "perplexity" in render(result)


def test_generate_streams_the_adapter_models_text(lora_run):
    from transformers import AutoTokenizer

    from trainforge.model.generate import generate

    run, _ = lora_run
    args = ["--max-new-tokens", "12", "--temperature", "1.0", "--seed", "5"]
    proc = run_cli(["generate", run, "--prompt", "alpha beta", *args], run.parent)
    assert proc.returncode == 0, show(proc)
    tok = AutoTokenizer.from_pretrained(run / "final")
    ids = tok("alpha beta", return_tensors="pt")["input_ids"]
    expected = generate(_adapter_model(run), tok, ids, max_new_tokens=12, temperature=1.0, seed=5)
    assert expected and proc.stdout == expected + "\n"  # stdout holds the generated text only
    # bitsandbytes, imported by peft, logged on CPUs with AVX512-BF16 that its 4-bit kernel needs `kernels`
    assert "Failed to load" not in proc.stderr and "pip install kernels" not in proc.stderr, show(proc)

    chat = _cli_with_stdin(
        ["generate", run, "--chat", "--max-new-tokens", "6", "--seed", "1"],
        json.dumps([{"role": "user", "content": "continue: gamma delta"}]), run.parent,
    )
    assert chat.returncode == 0, show(chat)
    assert chat.stdout.strip(), show(chat)


def test_export_merge_loads_without_peft_and_keeps_the_logits(lora_run, toy_data_dir):
    run, summary = lora_run
    out = run.parent / "merged"
    proc = run_cli(["export", run, "--merge", "--out", out], run.parent)
    assert proc.returncode == 0, show(proc)
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= names, names
    assert "adapter_config.json" not in names

    # a fresh interpreter where importing peft fails: the merged directory needs only transformers
    ids = torch.randint(0, 300, (2, 20), generator=torch.Generator().manual_seed(0))
    torch.save(ids, run.parent / "ids.pt")
    script = (
        "import sys, torch; sys.modules['peft'] = None\n"
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        f"m = AutoModelForCausalLM.from_pretrained({str(out)!r}, dtype=torch.float32).eval()\n"
        f"AutoTokenizer.from_pretrained({str(out)!r})\n"
        f"ids = torch.load({str(run.parent / 'ids.pt')!r})\n"
        "with torch.no_grad(): logits = m(input_ids=ids).logits\n"
        f"torch.save(logits, {str(run.parent / 'merged_logits.pt')!r})\n"
    )
    loaded = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=CLI_TIMEOUT_S)
    assert loaded.returncode == 0, loaded.stderr
    with torch.no_grad():
        reference = _adapter_model(run)(input_ids=ids).logits
    torch.testing.assert_close(torch.load(run.parent / "merged_logits.pt"), reference, atol=1e-5, rtol=1e-5)

    # a plain directory has no run config: given the run's data settings, eval gives the run's figure
    merged = _evaluate(out, toy_data_dir / "pc_eval.jsonl", ["data.max_length=64", "train.micro_batch_size=4", "train.precision=fp32"])
    assert merged["loss"] == pytest.approx(summary["eval_loss"], rel=1e-5)


# ---------------------------------------------------------------- the demo's run (the built-in default, shrunk)

DEMO_SHRINK = [
    "train.max_steps=2",
    "data.max_documents=12",
    "log.every_steps=1",
    "log.sample_tokens=4",
    "log.report=false",
    "model.init.hidden_size=32",
    "model.init.intermediate_size=64",
    "model.init.num_hidden_layers=1",
    "model.tokenizer_vocab_size=400",
]


def test_demo_run_generate_eval_export(tmp_path):
    from transformers import AutoModelForCausalLM

    eval_file = conftest.write_jsonl(tmp_path / "code.jsonl", [
        {"text": f"def f{i}(x):\n    return x * {i} + {i * i}\n"} for i in range(10)
    ])
    run = tmp_path / "demo"
    summary = _train(run, [a for o in [*DEMO_SHRINK, f"data.eval={eval_file}"] for a in ("--set", o)])

    result = _eval_json(run, eval_file)
    assert result["loss"] == pytest.approx(summary["eval_loss"], rel=1e-5, abs=1e-6)
    assert result["precision"] == summary["precision"] and result["format"] == "text"

    proc = run_cli(["generate", run, "--prompt", "def ", "--max-new-tokens", "8"], tmp_path)
    assert proc.returncode == 0, show(proc)
    assert proc.stdout.endswith("\n") and "model: run" in proc.stderr

    out = tmp_path / "exported"
    proc = run_cli(["export", run, "--merge", "--out", out], tmp_path)  # a full model: nothing to merge
    assert proc.returncode == 0, show(proc)
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    with torch.no_grad():
        a = AutoModelForCausalLM.from_pretrained(out).eval()(input_ids=ids).logits
        b = AutoModelForCausalLM.from_pretrained(run / "final").eval()(input_ids=ids).logits
    assert torch.equal(a, b)


def test_a_directory_that_is_no_model_exits_2_naming_it(tmp_path):
    (tmp_path / "notes").mkdir()
    (tmp_path / "data.jsonl").write_text('{"text": "hi"}\n')
    proc = run_cli(["eval", tmp_path / "notes", "--data", tmp_path / "data.jsonl"], tmp_path)
    assert proc.returncode == 2, show(proc)
    assert str(tmp_path / "notes") in proc.stderr and "config.json" in proc.stderr and "Traceback" not in proc.stderr, show(proc)
