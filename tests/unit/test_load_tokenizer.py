"""A tokenizer saved beside a model's config loads back as the pipeline it was saved with.

transformers 5's AutoTokenizer picks the class registered for config.json's model_type when the
tokenizer names a generic one: beside a qwen2 config, a tokenizer trained from scratch (BPE or char)
came back as Qwen2Tokenizer, rebuilt from the vocabulary with Qwen's pre-tokenizer, and split text
unlike in training (digits one by one; a word-level vocabulary encoded to nothing).
"""

from __future__ import annotations

import json

import pytest

from trainforge.model.tokenizer import build_char_tokenizer, load_tokenizer, train_bpe_tokenizer

TEXTS = ["Hello world, it's 2026!  Numbers 12345 and\n\nnewlines   spaces. CamelCase don't"] * 50
PROBES = ["Say 12345 things,\n\n  it's ok", "1 22 333 4444", "   CamelCase\tdon't!"]


def save_beside(tok, directory, model_type: str):
    from transformers import AutoConfig

    tok.save_pretrained(directory)
    AutoConfig.for_model(model_type, vocab_size=len(tok)).save_pretrained(directory)
    return directory


@pytest.mark.parametrize("model_type", ["qwen2", "llama", "mistral", "gemma"])
@pytest.mark.parametrize("kind", ["bpe", "char"])
def test_a_trained_tokenizer_splits_text_as_it_did_in_training(tmp_path, model_type, kind):
    tok = train_bpe_tokenizer(TEXTS, 400) if kind == "bpe" else build_char_tokenizer(TEXTS)
    loaded = load_tokenizer(save_beside(tok, tmp_path, model_type))
    for text in PROBES:
        assert loaded(text)["input_ids"] == tok(text)["input_ids"], text
    assert (loaded.eos_token_id, loaded.pad_token_id) == (tok.eos_token_id, tok.pad_token_id)


def test_a_tokenizer_that_names_its_own_class_still_gets_it(tmp_path):
    """A hub directory's specific class (Qwen2Tokenizer here) is transformers' to build, as before."""
    directory = save_beside(train_bpe_tokenizer(TEXTS, 400), tmp_path, "qwen2")
    config = directory / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "tokenizer_class": "Qwen2Tokenizer"}))
    assert type(load_tokenizer(directory)).__name__ == "Qwen2Tokenizer"


def test_a_tokenizer_that_does_not_load_or_has_no_eos_is_a_located_error(tmp_path, tiny_tokenizer_dir):
    """Both ended in a traceback (exit 1): transformers' ValueError for a directory with a tokenizer_config.json
    but no tokenizer files, and trainforge's own bare ValueError for a tokenizer without an EOS token."""
    import shutil

    from trainforge.errors import EXIT_BAD_INPUT
    from trainforge.model.tokenizer import TokenizerError

    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "tokenizer_config.json").write_text("{}")
    with pytest.raises(TokenizerError, match=rf"^the tokenizer in {partial} cannot be loaded: .* It needs tokenizer.json") as e:
        load_tokenizer(partial)
    assert e.value.exit_code == EXIT_BAD_INPUT
    no_eos = shutil.copytree(tiny_tokenizer_dir, tmp_path / "no-eos")
    declared = json.loads((no_eos / "tokenizer_config.json").read_text())
    for key in ("eos_token", "pad_token"):
        declared.pop(key, None)
    (no_eos / "tokenizer_config.json").write_text(json.dumps(declared))
    with pytest.raises(TokenizerError, match=rf"^the tokenizer in {no_eos} has no EOS token.*set eos_token in its tokenizer_config.json"):
        load_tokenizer(no_eos)
