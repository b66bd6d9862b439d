"""Tokenizers: a local Hugging Face tokenizer, a byte-level BPE trained on the data, or a
character vocabulary built from the data."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from ..errors import TrainforgeError
from ..hf_dir import TOKENIZER_CONFIG, refuse_custom_code

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
UNK_TOKEN = "<|unk|>"


GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")  # "exactly the pipeline in tokenizer.json"


class TokenizerError(TrainforgeError, ValueError):
    """A tokenizer directory that does not load, or a tokenizer trainforge cannot train with (no EOS token)."""


def load_tokenizer(path: str | Path):
    """A tokenizer from a local directory, with a pad token guaranteed (EOS reused when missing)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    refuse_custom_code(path)  # never run the directory's code; trust_remote_code=False below besides
    try:
        if declares_generic_tokenizer(path):
            # transformers 5's AutoTokenizer picks the class registered for config.json's model_type (qwen2:
            # Qwen2Tokenizer), which rebuilds the pipeline from the vocabulary with its own pre-tokenizer: a
            # tokenizer trained for a model from scratch would then split text unlike in training
            tok = PreTrainedTokenizerFast.from_pretrained(str(path))
        else:
            tok = AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
    except (OSError, ValueError, ImportError) as e:  # missing or partial files, a slow tokenizer's missing package
        reason = " ".join(str(e).split()).rstrip(".")
        raise TokenizerError(
            f"the tokenizer in {path} cannot be loaded: {reason[:400]}. It needs tokenizer.json, or the files its "
            "tokenizer_config.json's class reads (tokenizer.model needs `pip install sentencepiece`)"
        ) from None
    if tok.eos_token_id is None:
        raise TokenizerError(
            f"the tokenizer in {path} has no EOS token, which trainforge needs to end documents; set eos_token in its "
            f"{TOKENIZER_CONFIG}, or use another tokenizer (model.tokenizer)"
        )
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token  # pads carry no loss and no attention, so reusing EOS is safe
    return tok


def declares_generic_tokenizer(path: str | Path) -> bool:
    """Whether ``path``'s tokenizer_config.json names a generic class over its tokenizer.json (what
    ``PreTrainedTokenizerFast(tokenizer_object=...).save_pretrained`` writes), with no custom code."""
    directory = Path(path)
    try:
        declared = json.loads((directory / TOKENIZER_CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return (
        isinstance(declared, dict)
        and declared.get("tokenizer_class") in GENERIC_CLASSES
        and "auto_map" not in declared
        and (directory / "tokenizer.json").is_file()
    )


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int):
    """Train a byte-level BPE tokenizer (GPT-2 style: any text encodes, nothing is unknown)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN)


def bpe_tokenizer_from_json(text: str):
    """A tokenizer ``train_bpe_tokenizer`` built, from its ``backend_tokenizer.to_str()`` (the cached copy)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(text), eos_token=EOS_TOKEN, pad_token=PAD_TOKEN)


def build_char_tokenizer(texts: Iterable[str]):
    """A character-level tokenizer (nanoGPT's shakespeare_char): one token per character.

    The vocabulary is the sorted set of characters in ``texts`` (ids 0..n-1, as nanoGPT numbers
    them), then EOS, PAD and UNK; a character not seen in ``texts`` encodes to UNK. Deterministic:
    the same text gives the same ids. A BPE model with this vocabulary and no merges splits text
    into characters without a pre-tokenizer, so every token's offsets span exactly its character,
    and ``decoders.Fuse`` joins the characters back without inserted spaces.
    """
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars: set[str] = set()
    for text in texts:
        chars.update(text)
    if not chars:
        raise ValueError("no training text to build a character vocabulary from")
    specials = [EOS_TOKEN, PAD_TOKEN, UNK_TOKEN]
    vocab = {c: i for i, c in enumerate(sorted(chars))}
    for token in specials:
        vocab.setdefault(token, len(vocab))  # multi-character strings: never a character of the data
    core = Tokenizer(models.BPE(vocab, [], unk_token=UNK_TOKEN, fuse_unk=False))
    core.decoder = decoders.Fuse()
    core.add_special_tokens(specials)  # matched whole in the input, skipped by skip_special_tokens
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        clean_up_tokenization_spaces=False,  # " ." stays " .": decoding gives the text back exactly
    )
