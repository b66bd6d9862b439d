"""Shared fixtures: a tiny tokenizer, a tiny pretrained-style Llama directory and toy data.

Everything is built here, seeded; nothing is downloaded.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

TINY_LLAMA_INIT = {
    "architecture": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 128,
}
"""The tiny from-scratch model of the tests, as a ``model.init`` block."""

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau".split()


def toy_documents(n: int, seed: int = 0) -> list[str]:
    """Learnable text: counting runs and repeated word cycles of varying lengths."""
    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        start = rng.randrange(len(WORDS))
        length = rng.randrange(5, 40)
        docs.append(" ".join(WORDS[(start + i) % len(WORDS)] for i in range(length)) + ".")
    return docs


def toy_prompt_completions(n: int, seed: int = 0) -> list[dict[str, str]]:
    """Prompt: a few words; completion: the next words of the cycle (learnable, varied lengths)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        start = rng.randrange(len(WORDS))
        k, m = rng.randrange(2, 8), rng.randrange(1, 6)
        prompt = "continue: " + " ".join(WORDS[(start + i) % len(WORDS)] for i in range(k))
        completion = " " + " ".join(WORDS[(start + k + i) % len(WORDS)] for i in range(m))
        rows.append({"prompt": prompt, "completion": completion})
    return rows


def toy_preference_pairs(n: int, seed: int = 0) -> list[dict[str, str]]:
    """A known preference in the toy vocabulary: after a few words of the cycle, ``chosen`` goes on with the
    next words, ``rejected`` gives the same words backwards (TRL's {prompt, chosen, rejected} layout)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        start = rng.randrange(len(WORDS))
        k, m = rng.randrange(2, 8), rng.randrange(2, 6)
        nxt = [WORDS[(start + k + i) % len(WORDS)] for i in range(m)]
        prompt = "continue: " + " ".join(WORDS[(start + i) % len(WORDS)] for i in range(k))
        rows.append({"prompt": prompt, "chosen": " " + " ".join(nxt), "rejected": " " + " ".join(reversed(nxt))})
    return rows


def toy_kto_rows(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """The same known preference unpaired (KTO, TRL's {prompt, completion, label} layout): every other row's
    completion goes on with the cycle (label true), the others' give those words backwards (label false)."""
    rows = []
    for k, pair in enumerate(toy_preference_pairs(n, seed)):
        good = k % 2 == 0
        rows.append({"prompt": pair["prompt"], "completion": pair["chosen" if good else "rejected"], "label": good})
    return rows


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def make_store(path: Path, sequences: list[tuple[list[int], list[bool]]], vocab_size: int = 1000):
    """A token store holding these (ids, learned) sequences, as one source."""
    import numpy as np

    from trainforge.data.store import StoreWriter, TokenStore

    writer = StoreWriter(path, vocab_size)
    writer.start_source()
    writer.append(
        np.concatenate([np.asarray(i, np.int64) for i, _ in sequences]),
        np.concatenate([np.asarray(m, np.uint8) for _, m in sequences]),
        np.asarray([len(i) for i, _ in sequences]),
    )
    writer.close({})
    return TokenStore(path)


def write_config(path: Path, config: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    """torch on one CPU thread in this process, as in the CLI subprocesses (integration_helpers): the
    tests' tiny shapes run fastest on one core, and two threads sharing a busy 2-core machine wait on
    each other at every op (measured 10x slower steps; selftest runs on one thread for the same reason).
    In-process and CLI runs that a test compares bitwise then run alike."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True, scope="session")
def _token_cache(tmp_path_factory):
    """Keep the token cache of every test run (and its CLI subprocesses) out of the home directory."""
    import os

    old = os.environ.get("TRAINFORGE_CACHE")
    os.environ["TRAINFORGE_CACHE"] = str(tmp_path_factory.mktemp("token-cache"))
    yield
    if old is None:
        os.environ.pop("TRAINFORGE_CACHE", None)
    else:
        os.environ["TRAINFORGE_CACHE"] = old


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory) -> Path:
    from trainforge.model.tokenizer import train_bpe_tokenizer

    texts = toy_documents(300) + [r["prompt"] + r["completion"] for r in toy_prompt_completions(300)]
    tok = train_bpe_tokenizer(texts, vocab_size=320)
    path = tmp_path_factory.mktemp("tokenizer")
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    """A 'pretrained' Llama directory: config, safetensors weights and tokenizer, like a hub download."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from trainforge.model.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny_tokenizer_dir)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=128,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(config)
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def sp_llama_dir(tmp_path_factory) -> Path:
    """A tiny Llama with a Llama 2-style SentencePiece tokenizer (byte fallback, ``▁``, ``<s>``/``</s>``/``<unk>``;
    ``tests/sentencepiece_models.py``) and Mistral Instruct v0.2's chat template."""
    from sentencepiece_models import (
        MISTRAL_TEMPLATE,
        piece_texts,
        write_sentencepiece_llama,
    )

    texts = piece_texts(toy_documents(300) + [r["prompt"] + r["completion"] for r in toy_prompt_completions(300)])
    return write_sentencepiece_llama(tmp_path_factory.mktemp("sp-llama"), texts, MISTRAL_TEMPLATE.read_text())


@pytest.fixture(scope="session")
def toy_data_dir(tmp_path_factory) -> Path:
    """text_train/text_eval and pc_train/pc_eval JSONL files."""
    d = tmp_path_factory.mktemp("data")
    write_jsonl(d / "text_train.jsonl", [{"text": t} for t in toy_documents(400, seed=1)])
    write_jsonl(d / "text_eval.jsonl", [{"text": t} for t in toy_documents(40, seed=2)])
    write_jsonl(d / "pc_train.jsonl", toy_prompt_completions(400, seed=3))
    write_jsonl(d / "pc_eval.jsonl", toy_prompt_completions(40, seed=4))
    write_jsonl(d / "pref_train.jsonl", toy_preference_pairs(400, seed=5))
    write_jsonl(d / "pref_eval.jsonl", toy_preference_pairs(60, seed=6))
    write_jsonl(d / "kto_train.jsonl", toy_kto_rows(400, seed=7))
    write_jsonl(d / "kto_eval.jsonl", toy_kto_rows(60, seed=8))
    return d


def finetune_settings(model_dir: Path, data_dir: Path) -> dict[str, Any]:
    """A small, fast fine-tuning config on the tiny model (fp32, CPU, a few steps); ``finetune_config``
    as a function, for module-scoped fixtures that train once and share the run.

    ``log.report: false``: drawing report.html costs more than the tiny run itself; the tests of the
    report (``test_cli_report.py``, ``test_report.py``) switch it on or leave the default."""
    return {
        "model": {"path": str(model_dir), "method": "full"},
        "data": {
            "train": str(data_dir / "pc_train.jsonl"),
            "eval": str(data_dir / "pc_eval.jsonl"),
            "max_length": 64,
        },
        "train": {"max_steps": 8, "micro_batch_size": 4, "grad_accum": 2, "precision": "fp32", "device": "cpu"},
        "optim": {"lr": 1.0e-3, "warmup_steps": 2},
        "log": {"every_steps": 2, "report": False},
    }


@pytest.fixture
def finetune_config(tiny_model_dir, toy_data_dir) -> dict[str, Any]:
    """``finetune_settings`` of the session's tiny model and toy data (a fresh dict per test)."""
    return finetune_settings(tiny_model_dir, toy_data_dir)
