"""End to end: a tiny T5 and a tiny BART fine-tuned through ``python -m trainforge train``, full and
LoRA, on source -> target data in public layouts; ``final/`` loads with ``AutoModelForSeq2SeqLM`` /
``AutoPeftModelForSeq2SeqLM``, and greedy generation of the toy mapping (reverse a word list) is
clearly better after training than before."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from integration_helpers import root_conftest, run_cli, show
from seq2seq_models import as_layout, build_bart, build_t5, generation_scores, reverse_rows

write_config = root_conftest().write_config
write_jsonl = root_conftest().write_jsonl
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "seq2seq-lora.yaml"


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("seq2seq-models")
    return {"t5": build_t5(root / "t5"), "bart": build_bart(root / "bart")}


# steps and peak lr per (model, method): T5 (pre-norm, relative positions) learns the mapping in half
# the steps BART (post-norm, learned positions) needs, and post-norm BART wants a lower lr
SCHEDULE = {("t5", "full"): (150, 3.0e-3), ("t5", "lora"): (150, 1.0e-2), ("bart", "full"): (300, 1.0e-3), ("bart", "lora"): (300, 3.0e-3)}


def train_config(model: Path, data: Path, method: str, layout: str, kind: str = "t5") -> dict:
    steps, lr = SCHEDULE[kind, method]
    return {
        "model": {"path": str(model), "method": method, **({"lora": {"r": 16, "alpha": 32}} if method == "lora" else {})},
        "data": {"train": str(data / f"{layout}_train.jsonl"), "eval": str(data / f"{layout}_eval.jsonl"),
                 "max_length": 48, "max_target_length": 12},
        "train": {"max_steps": steps, "micro_batch_size": 16, "precision": "fp32", "device": "cpu"},
        "optim": {"lr": lr, "warmup_steps": 10, "weight_decay": 0.0},
        "log": {"every_steps": 50},
    }


# (model, method, data layout): every model and method, and each public layout once (the long
# chat and alpaca sources on T5, which learns faster)
CASES = [
    ("t5", "full", "messages"),
    ("t5", "lora", "alpaca"),
    ("bart", "full", "source_target"),
    ("bart", "lora", "input_output"),
]


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch):
    """Tiny models gain nothing from a second thread, and lose much to one on a busy machine."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


@pytest.mark.parametrize("kind, method, layout", CASES)
def test_train_from_a_local_directory_and_generation_improves(models, tmp_path, kind, method, layout):
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    train_rows, eval_rows = reverse_rows(400, seed=1), reverse_rows(48, seed=2)
    write_jsonl(tmp_path / f"{layout}_train.jsonl", [as_layout(r, layout) for r in train_rows])
    write_jsonl(tmp_path / f"{layout}_eval.jsonl", [as_layout(r, layout) for r in eval_rows])
    config = write_config(tmp_path / "run.yaml", train_config(models[kind], tmp_path, method, layout, kind))
    proc = run_cli(["train", config, "--output", tmp_path / "run"], tmp_path, timeout=600)
    assert proc.returncode == 0, show(proc)
    assert "source -> target rows" in proc.stdout and "precision fp32" in proc.stdout

    final = tmp_path / "run" / "final"
    tokenizer = AutoTokenizer.from_pretrained(final)
    if method == "lora":
        from peft import AutoPeftModelForSeq2SeqLM

        assert (final / "adapter_config.json").is_file() and not (final / "model.safetensors").exists()
        assert json.loads((final / "adapter_config.json").read_text())["task_type"] == "SEQ_2_SEQ_LM"
        trained = AutoPeftModelForSeq2SeqLM.from_pretrained(final)
    else:
        trained = AutoModelForSeq2SeqLM.from_pretrained(final)
    before = AutoModelForSeq2SeqLM.from_pretrained(models[kind])
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["eval_loss"] < 0.5 * summary["eval_loss_before"], summary
    assert summary["data"]["encoder_decoder"] and summary["data"]["format"] in ("source_target", "chat", "alpaca")

    layout_rows = [as_layout(r, layout) for r in eval_rows]
    exact_before, acc_before = generation_scores(before, tokenizer, layout_rows, eval_rows, layout)
    exact_after, acc_after = generation_scores(trained, tokenizer, layout_rows, eval_rows, layout)
    print(f"{kind} {method} {layout}: word accuracy {acc_before:.2f} -> {acc_after:.2f}, exact {exact_before:.2f} -> {exact_after:.2f}")
    # before: a random model emits no word of the target in place; after: a clear share of them
    assert acc_after >= acc_before + 0.1 and exact_after >= exact_before, (acc_before, acc_after, exact_before, exact_after)


def test_example_config_runs_on_a_tiny_flan_t5_style_directory(models, tmp_path):
    """examples/seq2seq-lora.yaml with model.path pointed at a local T5 directory (short)."""
    overrides = [
        f"model.path={models['t5']}", "data.max_documents=48", "data.max_length=64", "data.max_target_length=32",
        "train.max_steps=3", "train.epochs=null", "train.micro_batch_size=4", "train.grad_accum=1",
        "train.eval_every=null", "checkpoint.every_steps=null", "train.precision=fp32", "train.device=cpu",
    ]
    args = ["train", EXAMPLE, "--output", tmp_path / "run"]
    for item in overrides:
        args += ["--set", item]
    proc = run_cli(args, tmp_path)
    assert proc.returncode == 0, show(proc)
    from peft import AutoPeftModelForSeq2SeqLM

    model = AutoPeftModelForSeq2SeqLM.from_pretrained(tmp_path / "run" / "final")
    assert model.peft_config["default"].task_type == "SEQ_2_SEQ_LM"


def test_packing_true_is_refused_with_the_key_named(models, tmp_path):
    write_jsonl(tmp_path / "source_target_train.jsonl", reverse_rows(8))
    write_jsonl(tmp_path / "source_target_eval.jsonl", reverse_rows(4, seed=3))
    cfg = train_config(models["bart"], tmp_path, "full", "source_target", "bart")
    cfg["data"]["packing"] = True
    proc = run_cli(["train", write_config(tmp_path / "c.yaml", cfg), "--output", tmp_path / "run"], tmp_path)
    assert proc.returncode == 2, show(proc)
    assert "data.packing: the model (bart) is an encoder-decoder" in proc.stderr + proc.stdout


def test_two_processes_train_like_one(models, tmp_path):
    """DDP over 2 gloo processes (micro-batch 4 each) == one process with micro-batch 8: same global batch."""
    write_jsonl(tmp_path / "source_target_train.jsonl", reverse_rows(64, seed=1))
    write_jsonl(tmp_path / "source_target_eval.jsonl", reverse_rows(8, seed=2))
    runs = {}
    for nproc, mbs in ((0, 8), (2, 4)):
        cfg = train_config(models["t5"], tmp_path, "full", "source_target")
        cfg["train"].update(max_steps=4, micro_batch_size=mbs, eval_every=None)
        cfg["log"]["every_steps"] = 1
        config = write_config(tmp_path / f"ddp{nproc}.yaml", cfg)
        out = tmp_path / f"run{nproc}"
        proc = run_cli(["train", config, "--output", out, *(["--nproc", nproc] if nproc else [])], tmp_path)
        assert proc.returncode == 0, show(proc)
        runs[nproc] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    from safetensors.torch import load_file

    one, two = ([r for r in runs[n] if "loss" in r] for n in (0, 2))
    assert [r["step"] for r in one] == [r["step"] for r in two] == [1, 2, 3, 4]
    for a, b in zip(one, two):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-5) and b["tokens"] == a["tokens"]
    w1, w2 = (load_file(tmp_path / f"run{n}" / "final" / "model.safetensors") for n in (0, 2))
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], rtol=0, atol=1e-5, msg=k)
