"""Data as people have it, through the real CLI with ``precision: auto``: a Phi-3 chat template with
LoRA, ShareGPT rows, a one-file corpus with the default eval fraction, long text documents.

Each case checks the files the run wrote, and for chat data that ``summary.json`` counts exactly
the tokens of the assistant turns and their end markers as targets.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from integration_helpers import root_conftest, run_cli, show

conftest = root_conftest()
TEMPLATES = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates"
PHI3_SPECIALS = ["<|endoftext|>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]


def chats(n: int, start: int = 0) -> list[list[dict[str, str]]]:
    """Distinct conversations (numbered), with a system turn and two assistant turns each."""
    words = conftest.WORDS
    convos = []
    for i in range(start, start + n):
        a, b = words[i % len(words)], words[(i * 3 + 1) % len(words)]
        convos.append([
            {"role": "system", "content": "answer with the next words"},
            {"role": "user", "content": f"{i}: after {a}?"},
            {"role": "assistant", "content": f"{b} {a} {b}"},
            {"role": "user", "content": f"and after {b}?"},
            {"role": "assistant", "content": f"{a} {a}"},
        ])  # fmt: skip
    return convos


@pytest.fixture(scope="module")
def phi3_dir(tmp_path_factory) -> Path:
    """A tiny random Phi-3 saved with a tokenizer that carries Phi-3.5's real chat template."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, Phi3Config, PreTrainedTokenizerFast

    family = json.loads((TEMPLATES / "families.json").read_text())["phi3"]
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    texts = [m["content"] for c in chats(40) for m in c]
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=PHI3_SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    core.train_from_iterator(texts, trainer=trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    tok.chat_template = (TEMPLATES / family["file"]).read_text()
    config = Phi3Config(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=256, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        bos_token_id=tok.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("phi3")
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _config(tmp_path: Path, model: dict, data: dict) -> Path:
    cfg = {
        "model": model,
        "data": {"max_length": 128, "cache_dir": str(tmp_path / "cache"), **data},
        "train": {"max_steps": 3, "micro_batch_size": 4, "precision": "auto", "device": "cpu"},
        "optim": {"lr": 1.0e-3},
        "log": {"every_steps": 1, "report": False},
    }
    return conftest.write_config(tmp_path / "config.yaml", cfg)


def _train(tmp_path: Path, config: Path) -> dict:
    run = tmp_path / "run"
    proc = run_cli(["train", config, "--output", run], tmp_path)
    assert proc.returncode == 0, show(proc)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["eval_loss"] is not None and (run / "final").is_dir(), show(proc)
    return summary


def _target_tokens(tokenizer_dir: Path, turns: list[str]) -> int:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    return sum(len(tok(t, add_special_tokens=False)["input_ids"]) for t in turns)


def test_phi3_template_with_lora_learns_each_assistant_turn_and_its_end_marker(tmp_path, phi3_dir):
    convos = chats(40)
    train = conftest.write_jsonl(tmp_path / "train.jsonl", [{"messages": c} for c in convos])
    evals = conftest.write_jsonl(tmp_path / "eval.jsonl", [{"messages": c} for c in chats(4, start=1000)])
    config = _config(tmp_path, {"path": str(phi3_dir), "method": "lora"}, {"train": str(train), "eval": str(evals)})
    summary = _train(tmp_path, config)
    assert summary["data"]["format"] == "chat" and summary["data"]["eval_overlap_dropped"] == summary["data"]["truncated"] == 0
    # Phi-3 closes a turn with '<|end|>\n' and writes '<|endoftext|>' only after the last one: not learned
    turns = [m["content"] + "<|end|>\n" for c in convos for m in c if m["role"] == "assistant"]
    assert summary["data"]["train_target_tokens"] == _target_tokens(phi3_dir, turns)


def test_sharegpt_rows_are_detected_and_learn_only_the_gpt_turns(tmp_path, tiny_model_dir):
    roles = {"system": "system", "user": "human", "assistant": "gpt"}
    convos = [c[1:3] for c in chats(40)]  # one exchange: the tiny model's context is 128 positions
    rows = [{"id": f"identity_{i}", "conversations": [{"from": roles[m["role"]], "value": m["content"]} for m in c]} for i, c in enumerate(convos)]
    train = conftest.write_jsonl(tmp_path / "sharegpt.jsonl", rows)
    config = _config(tmp_path, {"path": str(tiny_model_dir), "method": "full"}, {"train": str(train), "eval": None})
    run = tmp_path / "run"
    proc = run_cli(["train", config, "--output", run, "--set", "train.eval_every=1"], tmp_path)
    assert proc.returncode == 0, show(proc)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["data"]["format"] == "chat" and summary["data"]["truncated"] == 0
    turns = [m["content"] + "<|im_end|>\n" for c in convos for m in c if m["role"] == "assistant"]  # trainforge's ChatML default
    assert summary["data"]["train_target_tokens"] == _target_tokens(tiny_model_dir, turns)


def test_one_text_file_with_defaults_holds_out_blocks_and_reports_eval_loss(tmp_path, tiny_tokenizer_dir):
    corpus = tmp_path / "input.txt"  # the shape of tiny Shakespeare: one file, one document
    corpus.write_text("\n\n".join(conftest.toy_documents(1500, seed=3)))
    model = {"init": dict(conftest.TINY_LLAMA_INIT), "tokenizer": str(tiny_tokenizer_dir)}
    summary = _train(tmp_path, _config(tmp_path, model, {"train": str(corpus)}))  # eval: 0.05 and too_long: defaults
    data = summary["data"]
    assert data["train_rows"] == 1 and data["too_long"] == "split" and data["eval_holdout"] == "blocks"
    assert data["eval_sequences"] > 0 and data["lost_tokens"] == 0


def test_long_text_documents_are_split_by_default_and_truncation_is_reported(tmp_path, tiny_tokenizer_dir):
    docs = [{"text": " ".join(conftest.toy_documents(60, seed=s))} for s in range(20)]  # ~1,500 tokens each
    train = conftest.write_jsonl(tmp_path / "docs.jsonl", docs)
    model = {"init": dict(conftest.TINY_LLAMA_INIT), "tokenizer": str(tiny_tokenizer_dir)}
    config = _config(tmp_path, model, {"train": str(train)})
    kept = run_cli(["prepare", config], tmp_path)
    assert kept.returncode == 0 and "discarded" not in kept.stdout + kept.stderr, show(kept)
    cut = run_cli(["prepare", config, "--set", "data.too_long=truncate"], tmp_path)
    assert cut.returncode == 0, show(cut)
    out = " ".join((cut.stdout + cut.stderr).split())  # the console wraps long lines
    assert "truncation at data.max_length=128 discarded" in out and "set data.too_long: split" in out, show(cut)
