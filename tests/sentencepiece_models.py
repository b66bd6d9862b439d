"""A SentencePiece-style tokenizer laid out as Llama 2 / Mistral checkpoints ship it, and a tiny Llama with it.

Built here, seeded, nothing downloaded. Real checkpoints carry a ``tokenizer.json`` that transformers
converted from the SentencePiece ``tokenizer.model``:

- ids 0-2 ``<unk>``, ``<s>``, ``</s>`` (special added tokens), ids 3-258 the 256 byte pieces ``<0x00>`` ..
  ``<0xFF>``, then the merged pieces in the order SentencePiece learned them (runs of ``▁`` first, as in
  Llama 2), then the single characters;
- a BPE model with ``byte_fallback`` (a character outside the vocabulary becomes its UTF-8 byte pieces) and
  ``fuse_unk``; spaces are ``▁``, written by a Metaspace pre-tokenizer that puts one ``▁`` before the text;
- the merges are every split of every merged piece into two vocabulary pieces, best piece first (what
  transformers' converter writes from a SentencePiece model, and how SentencePiece and llama.cpp merge);
- ``tokenizer_config.json`` names ``LlamaTokenizer``, adds ``<s>`` and no ``</s>``, ``legacy: false``.

The sentencepiece package is not needed (nor installed in the project's environment): the pieces are learned
with the tokenizers library's BPE trainer and then laid out as above. ``transformers`` 5 reads
``tokenizer.json`` only, so this is the form a run's tokenizer has.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

SPECIALS = ["<unk>", "<s>", "</s>"]
ROUND_TRIP_TEXTS = [  # what a GGUF's tokenizer must encode as the run's (chat-rendered turns are added by the tests)
    "héllo wörld, naïve café — 日本語 🙂 ∑",  # CJK, emoji and ∑ are outside the vocabulary: byte pieces only
    "def f(x):\n    return {'a': x ** 2}  # ok\n",
    "\tif a  and b:\n\t\tpass\n\n",
    "two  spaces\tand\n\nlines   ",
    "alpha beta gamma delta epsilon",
    "kalomine tarisu veanel orinat ouie atatin",  # the toy language's overlapping pieces: the merge order decides
    "[INST] a <unk> b </s> c [/INST]",
]
BYTES = [f"<0x{b:02X}>" for b in range(256)]
SPACE = "\u2581"
SPACE_RUNS = [SPACE * 2, SPACE * 4, SPACE * 3, SPACE * 8]  # Llama 2's first merged pieces: indentation in one piece


def _learned_pieces(texts: list[str], vocab_size: int) -> tuple[list[str], list[str]]:
    """(merged pieces in the order learned, single characters) of a BPE trained on ``▁``-spelled words."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    trainer_tok = Tokenizer(models.BPE())
    trainer_tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="always", split=True)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False, special_tokens=[])
    trainer_tok.train_from_iterator(texts, trainer)
    model = json.loads(trainer_tok.to_str())["model"]
    merged: list[str] = []
    for merge in model["merges"]:
        left, right = merge if isinstance(merge, list) else merge.split(" ")
        if left + right not in merged:
            merged.append(left + right)
    singles = sorted(t for t in model["vocab"] if len(t) == 1)
    return merged, singles


def _all_splits(vocab: dict[str, int], pieces: list[str]) -> list[list[str]]:
    """Every split of each piece into two vocabulary pieces, pieces in the given (best-first) order."""
    merges = []
    for piece in pieces:
        splits = [(piece[:k], piece[k:]) for k in range(1, len(piece)) if piece[:k] in vocab and piece[k:] in vocab]
        merges.extend([left, right] for left, right in sorted(splits, key=lambda s: (vocab[s[0]], vocab[s[1]])))
    return merges


def tokenizer_json(vocab: dict[str, int], merges: list[list[str]]) -> dict:
    """A Llama 2-style tokenizer.json (the layout transformers' converter writes, ``legacy=False``)."""
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
              "special": True} for i, t in enumerate(SPECIALS)]
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "Metaspace", "replacement": SPACE, "prepend_scheme": "first", "split": False},
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": "<s>", "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}},
        },
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": SPACE}, "content": " "}, {"type": "ByteFallback"},
            {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
        "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                  "vocab": vocab, "merges": merges},
    }


def tokenizer_config(chat_template: str | None) -> dict:
    """A Llama 2-style tokenizer_config.json."""
    decoder = {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                        "special": True} for i, t in enumerate(SPECIALS)}
    config = {"add_bos_token": True, "add_eos_token": False, "added_tokens_decoder": decoder, "bos_token": "<s>",
              "clean_up_tokenization_spaces": False, "eos_token": "</s>", "legacy": False,
              "model_max_length": 1000000000000000019884624838656, "pad_token": None, "padding_side": "right",
              "sp_model_kwargs": {}, "tokenizer_class": "LlamaTokenizer", "unk_token": "<unk>",
              "use_default_system_prompt": False}
    if chat_template is not None:
        config["chat_template"] = chat_template
    return config


def write_sentencepiece_tokenizer(path: Path, texts: list[str], vocab_size: int = 300,
                                  chat_template: str | None = None) -> Path:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json of a Llama 2-style tokenizer
    whose merged pieces are learned from ``texts`` (``vocab_size``: the trainer's own vocabulary size)."""
    merged, singles = _learned_pieces(texts, vocab_size)
    merged = [*SPACE_RUNS, *(p for p in merged if p not in SPACE_RUNS)]
    order = [*SPECIALS, *BYTES, *merged, *(c for c in singles if c not in merged)]
    vocab = {piece: i for i, piece in enumerate(order)}
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer.json").write_text(json.dumps(tokenizer_json(vocab, _all_splits(vocab, merged)), ensure_ascii=False))
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(chat_template), indent=2, ensure_ascii=False))
    specials = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    (path / "special_tokens_map.json").write_text(json.dumps(specials, indent=2))
    return path


def write_sentencepiece_llama(path: Path, texts: list[str], chat_template: str | None = None, seed: int = 5) -> Path:
    """A tiny seed-fixed Llama directory (config, safetensors, the tokenizer above), as a hub snapshot lies."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    write_sentencepiece_tokenizer(path, texts, chat_template=chat_template)
    vocab = len(json.loads((path / "tokenizer.json").read_text())["model"]["vocab"])
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=128, bos_token_id=1, eos_token_id=2,
                         pad_token_id=None, rms_norm_eps=1e-5)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # norms away from 1, so a misplaced one shows in the logits
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(path)
    return path


MISTRAL_TEMPLATE = Path(__file__).parent / "fixtures" / "chat_templates" / "mistralai-Mistral-7B-Instruct-v0.2.jinja"


def piece_texts(documents: list[str], seed: int = 7) -> list[str]:
    """What the pieces are learned from: the documents, words of a toy language built from overlapping syllables
    (so pieces overlap and the merge order decides how a word splits, as in a real vocabulary), code with
    spaces, tabs and newlines, accented words and [INST] turns (CJK and emoji left out, so they reach the model
    only as byte pieces)."""
    rng = random.Random(seed)
    syllables = ["ka", "lo", "mi", "ne", "ta", "ri", "su", "ve", "an", "el", "or", "in", "at", "ou", "ie"]
    words = [" ".join("".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(12)) for _ in range(200)]
    code = ["def f(x):\n    return x ** 2  # ok\n", "\tif a  and b:\n\t\tpass\n", "for i in range(3):\n    print(i)\n"]
    turns = ["[INST] continue: alpha beta [/INST]gamma delta", "[INST] and then? [/INST]epsilon"]
    return documents + words + (code + turns + ["café naïve héllo wörld — ok"]) * 20


def write_other_tokenizer(path: Path, kind: str, texts: list[str]) -> Path:
    """A ``Unigram`` (SentencePiece unigram, as T5's) or ``WordPiece`` (BERT's) tokenizer with an EOS, saved as a
    generic fast tokenizer: kinds GGUF export does not write."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "</s>"]
    if kind == "Unigram":
        core = Tokenizer(models.Unigram())
        core.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="always")
        trainer = trainers.UnigramTrainer(vocab_size=120, special_tokens=specials, unk_token="<unk>", show_progress=False)
    else:
        core = Tokenizer(models.WordPiece(unk_token="<unk>"))
        core.pre_tokenizer = pre_tokenizers.Whitespace()
        trainer = trainers.WordPieceTrainer(vocab_size=120, special_tokens=specials, show_progress=False)
    core.train_from_iterator(texts, trainer)
    PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", eos_token="</s>").save_pretrained(path)
    return path
