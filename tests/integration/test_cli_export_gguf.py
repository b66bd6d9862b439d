"""``trainforge export --format gguf`` through the real CLI: the built-in default's run (shrunk), a chat LoRA
run on a tiny Llama and one on a tiny Llama with a Llama 2-style SentencePiece tokenizer and Mistral Instruct's
[INST] template, each read back by transformers' GGUF loader with the tokens, chat template and logits of the
exported model (tolerances: tests/unit/test_export_gguf.py); bad input exits 2 and writes nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from integration_helpers import root_conftest, run_cli, show
from sentencepiece_models import (
    MISTRAL_TEMPLATE,
    ROUND_TRIP_TEXTS,
    write_other_tokenizer,
)

pytest.importorskip("gguf")
conftest = root_conftest()
F16_EPS = 2.0**-10
TEXTS = ["héllo wörld — 日本語 🙂", "def f(x):\n    return x ** 2  # ok\n"]
DEMO_SHRINK = ["train.max_steps=2", "data.max_documents=12", "log.every_steps=1", "log.sample_tokens=4", "log.report=false",
               "model.init.hidden_size=32", "model.init.intermediate_size=64", "model.init.num_hidden_layers=1",
               "model.tokenizer_vocab_size=400"]


def _read_back(path: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def _assert_same_model(gguf_model, reference, ids):
    want = _logits(reference, ids)
    torch.testing.assert_close(_logits(gguf_model, ids), want, atol=8 * F16_EPS * want.abs().max().item(), rtol=0)


def test_the_built_in_default_exports_with_its_trained_bpe(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run = tmp_path / "demo"
    proc = run_cli(["train", *[a for o in DEMO_SHRINK for a in ("--set", o)], "--output", run], tmp_path)
    assert proc.returncode == 0, show(proc)
    out = tmp_path / "gguf" / "demo.gguf"
    proc = run_cli(["export", run, "--format", "gguf", "--out", out, "--ollama", tmp_path / "ollama"], tmp_path)
    assert proc.returncode == 0, show(proc)
    back, back_tok = _read_back(out)
    tok = AutoTokenizer.from_pretrained(run / "final")
    for text in TEXTS:
        assert back_tok(text, add_special_tokens=False)["input_ids"] == tok(text, add_special_tokens=False)["input_ids"], text
    ids = torch.randint(0, len(tok), (2, 16), generator=torch.Generator().manual_seed(0))
    _assert_same_model(back, AutoModelForCausalLM.from_pretrained(run / "final", dtype=torch.float32).eval(), ids)
    # a text model: no chat template, so the Modelfile has none and says why
    assert (tmp_path / "ollama" / "Modelfile").read_text() == "FROM ../gguf/demo.gguf\n"
    assert "no chat template" in proc.stderr, show(proc)


def test_a_chat_lora_run_exports_merged_with_its_template_and_modelfile(tmp_path, tiny_model_dir, toy_data_dir):
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoTokenizer

    run = _lora_chat_run(tmp_path, tiny_model_dir)
    out = tmp_path / "lora.gguf"
    proc = run_cli(["export", run, "--format", "gguf", "--quant", "f16", "--out", out, "--ollama", tmp_path / "ollama"], tmp_path)
    assert proc.returncode == 0, show(proc)

    back, back_tok = _read_back(out)
    tok = AutoTokenizer.from_pretrained(run / "final")
    assert tok.chat_template and back_tok.chat_template == tok.chat_template
    turns = [{"role": "user", "content": "continue: alpha"}, {"role": "assistant", "content": "beta gamma"}]
    chat = tok.apply_chat_template(turns, tokenize=False)
    for text in [*TEXTS, chat]:
        assert back_tok(text, add_special_tokens=False)["input_ids"] == tok(text, add_special_tokens=False)["input_ids"], text
    ids = torch.randint(0, len(tok), (2, 16), generator=torch.Generator().manual_seed(1))
    _assert_same_model(back, AutoPeftModelForCausalLM.from_pretrained(run / "final", dtype=torch.float32).eval(), ids)
    modelfile = (tmp_path / "ollama" / "Modelfile").read_text()
    assert modelfile.startswith("FROM ../lora.gguf\nTEMPLATE \"\"\"{{ range .Messages }}"), modelfile
    assert '{{ else if eq .Role "user" }}<|im_start|>user\n{{ .Content }}<|im_end|>\n' in modelfile
    assert modelfile.endswith('PARAMETER stop "<|im_end|>"\n'), modelfile

    # bad input: exit 2, a message saying what to do, nothing written
    before = sorted(p.name for p in tmp_path.iterdir())
    for args, said in [(["--quant", "q4_k"], "--quant 'q4_k'"), ([], "already exists")]:
        proc = run_cli(["export", run, "--format", "gguf", "--out", out if not args else tmp_path / "x.gguf", *args], tmp_path)
        assert proc.returncode == 2 and said in proc.stderr and "Traceback" not in proc.stderr, show(proc)
    (tmp_path / "unfinished").mkdir()
    (tmp_path / "unfinished" / "config.yaml").write_text("model: {}\n")
    proc = run_cli(["export", tmp_path / "unfinished", "--format", "gguf", "--out", tmp_path / "y.gguf"], tmp_path)
    assert proc.returncode == 2 and "without final/" in proc.stderr, show(proc)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*before, "unfinished"])


def _lora_chat_run(tmp_path: Path, model_dir: Path) -> Path:
    chats = [{"messages": [{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r["completion"]}]}
             for r in conftest.toy_prompt_completions(40)]
    config = conftest.write_config(tmp_path / "lora.yaml", {
        "model": {"path": str(model_dir), "method": "lora", "lora": {"r": 4, "alpha": 16}},
        "data": {"train": str(conftest.write_jsonl(tmp_path / "chats.jsonl", chats)), "eval": None, "max_length": 64},
        "train": {"max_steps": 3, "micro_batch_size": 4, "precision": "fp32", "device": "cpu"},
        "optim": {"lr": 3.0e-3, "warmup_steps": 1},
        "log": {"every_steps": 1, "report": False},
    })
    run = tmp_path / "run"
    proc = run_cli(["train", config, "--output", run], tmp_path)
    assert proc.returncode == 0, show(proc)
    return run


def test_a_sentencepiece_llama_lora_run_exports_with_its_tokenizer_template_and_modelfile(tmp_path, sp_llama_dir):
    """Llama 2 / Mistral layout: ``▁``, byte fallback, <unk>/<s>/</s>, BOS added, an [INST] template."""
    import shutil

    from peft import AutoPeftModelForCausalLM

    from trainforge.model.tokenizer import load_tokenizer

    run = _lora_chat_run(tmp_path, sp_llama_dir)
    out = tmp_path / "gguf" / "sp.gguf"
    proc = run_cli(["export", run, "--format", "gguf", "--out", out, "--ollama", tmp_path / "ollama"], tmp_path)
    assert proc.returncode == 0, show(proc)
    assert "not yet round-trip tested" not in proc.stderr
    # what llama.cpp itself does otherwise is said: it writes a space after special tokens (SentencePiece's rule)
    assert "right after a special token" in " ".join(proc.stderr.split()), show(proc)

    back, back_tok = _read_back(out)
    tok = load_tokenizer(run / "final")
    assert back_tok.chat_template == tok.chat_template == MISTRAL_TEMPLATE.read_text()
    turns = [{"role": "user", "content": "continue: alpha 日本"}, {"role": "assistant", "content": "beta gamma"},
             {"role": "user", "content": "and\tthen?\n"}]
    chats = [tok.apply_chat_template(turns, tokenize=False), tok.apply_chat_template(turns[:1], tokenize=False, add_generation_prompt=True)]
    for text in [*ROUND_TRIP_TEXTS, *chats]:
        for special in (False, True):  # with special tokens: the BOS the run adds, llama.cpp adds too (add_bos)
            assert back_tok(text, add_special_tokens=special)["input_ids"] == tok(text, add_special_tokens=special)["input_ids"], text
    ids = torch.randint(0, len(tok), (2, 16), generator=torch.Generator().manual_seed(2))
    _assert_same_model(back, AutoPeftModelForCausalLM.from_pretrained(run / "final", dtype=torch.float32).eval(), ids)

    # the Modelfile: the template's [INST] turns, its BOS left to llama.cpp, the stop at the end of a reply (EOS)
    assert (tmp_path / "ollama" / "Modelfile").read_text() == (
        'FROM ../gguf/sp.gguf\nTEMPLATE """{{ range .Messages }}{{ if eq .Role "user" }}[INST] {{ .Content }} [/INST]'
        '{{ else if eq .Role "assistant" }}{{ .Content }}</s>{{ end }}{{ end }}"""\nPARAMETER stop "</s>"\n')
    assert "refuses a system message" in " ".join(proc.stderr.split()), show(proc)

    # a tokenizer of another kind: refused before any work, naming it
    unigram = tmp_path / "unigram-llama"
    write_other_tokenizer(unigram, "Unigram", conftest.toy_documents(60))
    for file in ("config.json", "model.safetensors"):
        shutil.copy(sp_llama_dir / file, unigram / file)
    proc = run_cli(["export", unigram, "--format", "gguf", "--out", tmp_path / "unigram.gguf"], tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, show(proc)
    assert "a Unigram model" in " ".join(proc.stderr.split()), show(proc)
    assert not (tmp_path / "unigram.gguf").exists()
