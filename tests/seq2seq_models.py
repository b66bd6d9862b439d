"""Tiny encoder-decoder model directories (T5 and BART layouts) and a learnable toy mapping.

Built here, seeded, nothing downloaded: a T5-style Unigram tokenizer with a Metaspace pre-tokenizer
(``<pad>`` 0, ``</s>`` 1, ``<unk>`` 2, inputs end with ``</s>``, as T5's sentencepiece tokenizer)
and a BART-style byte-level BPE (``<s>`` 0, ``<pad>`` 1, ``</s>`` 2, ``<unk>`` 3, inputs wrapped in
``<s> ... </s>``), each trained on the toy data and saved with ``save_pretrained`` beside a
randomly initialized model, as a hub snapshot would lie on disk.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

WORDS = "alpha beta gamma delta epsilon zeta".split()
ALPACA_INSTRUCTION = "Reverse the order of these words."

T5_CONFIG = {"d_model": 64, "d_kv": 16, "d_ff": 128, "num_layers": 2, "num_decoder_layers": 2, "num_heads": 4,
             "dropout_rate": 0.0, "feed_forward_proj": "gated-gelu"}
BART_CONFIG = {"d_model": 64, "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 4,
               "decoder_attention_heads": 4, "encoder_ffn_dim": 128, "decoder_ffn_dim": 128,
               "max_position_embeddings": 64, "dropout": 0.0}


@pytest.fixture(scope="module")
def t5_dir(tmp_path_factory) -> Path:
    """A tiny T5 directory per test module (import the fixture: ``from seq2seq_models import t5_dir``)."""
    return build_t5(tmp_path_factory.mktemp("t5"))


@pytest.fixture(scope="module")
def bart_dir(tmp_path_factory) -> Path:
    """A tiny BART directory per test module."""
    return build_bart(tmp_path_factory.mktemp("bart"))


def reverse_rows(n: int, seed: int = 0) -> list[dict[str, str]]:
    """The toy mapping: ``reverse: a b c`` -> ``c b a`` over 2-3 words (learnable by a tiny model in a
    hundred steps or so; T5 learns it faster than BART)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randrange(2, 4))]
        rows.append({"source": "reverse: " + " ".join(words), "target": " ".join(reversed(words))})
    return rows


def _texts() -> list[str]:
    """Tokenizer training text: the toy rows, and the frames trainforge renders around them (a chat
    template's markers, alpaca's headers) so that those are a few tokens each, as in real vocabularies."""
    rows = reverse_rows(500, seed=99)
    frames = ["<|im_start|>user\n", "<|im_end|>\n", "<|im_start|>assistant\n", "<|im_start|>system\n",
              "### Instruction:\n", "\n\n### Input:\n", "\n\n### Response:\n", ALPACA_INSTRUCTION]
    return [r["source"] for r in rows] + [r["target"] for r in rows] + frames * 50


def t5_tokenizer():
    """Unigram + Metaspace (T5's sentencepiece layout): pad 0, EOS 1, UNK 2; ``</s>`` appended to inputs,
    newlines read as spaces.
    Pieces: ``▁word`` for the toy vocabulary, then single characters (any text still encodes)."""
    import string

    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = sorted({w for t in _texts() for w in t.replace(":", " ").split()})
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)] + [(f"\u2581{w}", -2.0) for w in words]
    pieces += [(c, -8.0) for c in "\u2581" + string.ascii_letters + string.digits + string.punctuation]
    core = Tokenizer(models.Unigram(pieces, unk_id=2, byte_fallback=False))
    core.normalizer = normalizers.Replace("\n", " ")  # T5's sentencepiece normalization turns newlines into spaces
    core.pre_tokenizer = pre_tokenizers.Metaspace()
    core.decoder = decoders.Metaspace()
    core.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token="</s>", pad_token="<pad>", unk_token="<unk>")


def bart_tokenizer():
    """Byte-level BPE (BART's GPT-2 layout): BOS 0, pad 1, EOS 2, UNK 3; inputs wrapped in ``<s> ... </s>``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    # a word reads alike at the start of a text and after a space (RoBERTa/BART's add_prefix_space=True)
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<s>", "<pad>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    core.train_from_iterator(_texts(), trainer=trainer)
    core.post_processor = processors.TemplateProcessing(single="<s> $A </s>", special_tokens=[("<s>", 0), ("</s>", 2)])
    return PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )


def build_t5(path: Path, seed: int = 1234, **overrides: Any) -> Path:
    """A tiny T5 directory (config, safetensors, generation config, tokenizer)."""
    from transformers import AutoModelForSeq2SeqLM, T5Config

    tok = t5_tokenizer()
    config = T5Config(vocab_size=len(tok), pad_token_id=0, eos_token_id=1, decoder_start_token_id=0, **{**T5_CONFIG, **overrides})
    torch.manual_seed(seed)
    AutoModelForSeq2SeqLM.from_config(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def build_bart(path: Path, seed: int = 1234, **overrides: Any) -> Path:
    """A tiny BART directory (config, safetensors, generation config, tokenizer)."""
    from transformers import AutoModelForSeq2SeqLM, BartConfig

    tok = bart_tokenizer()
    config = BartConfig(vocab_size=len(tok), bos_token_id=0, pad_token_id=1, eos_token_id=2, decoder_start_token_id=2,
                        forced_eos_token_id=2, **{**BART_CONFIG, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForSeq2SeqLM.from_config(config)
    with torch.no_grad():  # token and position vectors of a trained model's size (init's 0.02 caps the tied head's logits)
        for module in (model.model.shared, model.model.encoder.embed_positions, model.model.decoder.embed_positions):
            module.weight.normal_(0.0, 0.5)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def as_layout(row: dict[str, str], layout: str) -> dict:
    """A toy row in a public dataset layout: source_target, input_output, alpaca or (OpenAI) messages."""
    words = row["source"].removeprefix("reverse: ")
    return {
        "source_target": row,
        "input_output": {"input": row["source"], "output": row["target"]},
        "alpaca": {"instruction": ALPACA_INSTRUCTION, "input": words, "output": row["target"]},
        "messages": {"messages": [{"role": "user", "content": row["source"]}, {"role": "assistant", "content": row["target"]}]},
    }[layout]


def training_sources(tokenizer, layout_rows: list[dict], max_length: int = 48) -> list[list[int]]:
    """The encoder's input of each row exactly as trainforge trains on it (its renderer and tokenizer)."""
    from trainforge.data.formats import FieldNames, Renderer, detect_format
    from trainforge.data.seq2seq import tokenize_pairs
    from trainforge.data.sources import Row

    names = FieldNames()
    rows = [Row(r, f"row {i}") for i, r in enumerate(layout_rows)]
    renderer = Renderer(detect_format(rows[0], names), names, tokenizer)
    chunk = tokenize_pairs([renderer.pair(r) for r in rows], tokenizer, max_length, 10_000, "truncate")
    ends = chunk.lengths.cumsum()
    return [chunk.ids[e - n : e][chunk.learn[e - n : e] == 0].tolist() for e, n in zip(ends, chunk.lengths)]


@torch.no_grad()
def generation_scores(model, tokenizer, layout_rows: list[dict], rows: list[dict[str, str]], layout: str = "") -> tuple[float, float]:
    """(exact-match rate, word accuracy) of greedy ``generate`` on the rows' sources against their targets."""
    model.eval()
    sources = training_sources(tokenizer, layout_rows)
    width = max(len(s) for s in sources)
    ids = torch.full((len(sources), width), tokenizer.pad_token_id)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(sources):
        ids[i, : len(s)], mask[i, : len(s)] = torch.tensor(s), 1
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=16, do_sample=False, num_beams=1)
    texts = tokenizer.batch_decode(out, skip_special_tokens=True)
    exact = hits = total = 0
    for text, row in zip(texts, rows):
        got, want = text.split(), row["target"].split()
        exact += got == want
        hits += sum(g == w for g, w in zip(got, want))
        total += len(want)
    return exact / len(rows), hits / total
