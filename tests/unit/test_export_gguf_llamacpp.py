"""The exported GGUF in llama.cpp itself, through llama-cpp-python, where it is installed (the test extra does
not install it: it compiles llama.cpp, minutes on a small machine). Elsewhere these tests skip, and the
independent readers of tests/unit/test_export_gguf*.py are the check.

- SentencePiece-style (a Llama 2-layout tokenizer, tests/sentencepiece_models.py): llama.cpp's tokenizer gives
  SentencePiece's ids (the same vocabulary with the older Prepend/Replace normalizer, loaded as it is) on
  every text; the run's own ids on text that neither follows a special token nor starts with a space, and
  other ids on such text, as the export warns (docs/export.md, Tokenizers);
- byte-level BPE (trainforge's trained BPE): the run's ids on every text;
- both: BOS added as the file says, and the logits of the f16 file within 8 f16 epsilons of the largest
  logit of the fp32 model (the tolerance of tests/unit/test_export_gguf.py).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from rich.console import Console

pytest.importorskip("gguf")
llama_cpp = pytest.importorskip("llama_cpp")

from sentencepiece_models import ROUND_TRIP_TEXTS

from trainforge.data.formats import DEFAULT_CHAT_TEMPLATE
from trainforge.metrics.console import ConsoleReporter
from trainforge.model.tokenizer import load_tokenizer
from trainforge.tools.export_gguf import export_gguf

QUIET = ConsoleReporter(Console(quiet=True))
F16_EPS = 2.0**-10
TURNS = [{"role": "user", "content": "continue: alpha 日本"}, {"role": "assistant", "content": "beta gamma"},
         {"role": "user", "content": "and\tthen?\n"}]


def _llama(path: Path):
    return llama_cpp.Llama(str(path), n_ctx=64, logits_all=True, verbose=False, n_threads=1)


def _ids(llm, text: str, bos: bool = False) -> list[int]:
    return llm.tokenize(text.encode("utf-8"), add_bos=bos, special=True)


def _assert_logits(llm, model_dir: Path, vocab: int, seed: int) -> None:
    from transformers import AutoModelForCausalLM

    ids = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(seed))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        want = model(input_ids=ids).logits.float()
    got = []
    for row in ids.tolist():
        llm.reset()
        llm.eval(row)
        got.append(torch.tensor(llm.scores[: len(row)]))
    torch.testing.assert_close(torch.stack(got).float(), want, atol=8 * F16_EPS * want.abs().max().item(), rtol=0)


def _sentencepiece_rule(tmp_path: Path, model_dir: Path):
    """The same vocabulary and merges with SentencePiece's own space rule: the older Llama 2 tokenizer.json layout
    (a Prepend + Replace normalizer, no pre-tokenizer) loaded as it is."""
    out = tmp_path / "spm-rule"
    out.mkdir()
    data = json.loads((model_dir / "tokenizer.json").read_text())
    data["normalizer"] = {"type": "Sequence", "normalizers": [
        {"type": "Prepend", "prepend": "\u2581"}, {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]}
    data["pre_tokenizer"] = None
    (out / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False))
    declared = json.loads((model_dir / "tokenizer_config.json").read_text()) | {"tokenizer_class": "PreTrainedTokenizerFast"}
    (out / "tokenizer_config.json").write_text(json.dumps(declared))
    shutil.copy(model_dir / "special_tokens_map.json", out / "special_tokens_map.json")
    return load_tokenizer(out)


def test_llama_cpp_reads_the_sentencepiece_export_as_sentencepiece_does(tmp_path, sp_llama_dir):
    out = tmp_path / "sp.gguf"
    export_gguf(sp_llama_dir, out, "f16", None, QUIET)
    llm, tok = _llama(out), load_tokenizer(sp_llama_dir)
    rule = _sentencepiece_rule(tmp_path, sp_llama_dir)
    chat = tok.apply_chat_template(TURNS, tokenize=False)
    for text in [*ROUND_TRIP_TEXTS, chat, " alpha", "<s>alpha"]:
        assert _ids(llm, text) == rule(text, add_special_tokens=False)["input_ids"], text
        assert _ids(llm, text, bos=True) == [tok.bos_token_id, *_ids(llm, text)]
    for text in ROUND_TRIP_TEXTS[:-1]:  # no special token inside, no leading space: the run's ids
        assert _ids(llm, text) == tok(text, add_special_tokens=False)["input_ids"], text
    for text in (chat, " alpha", "<s>alpha"):  # where the export warns: other ids than the run's
        assert _ids(llm, text) != tok(text, add_special_tokens=False)["input_ids"], text
    _assert_logits(llm, sp_llama_dir, len(tok), 3)
    llm.close()


def test_llama_cpp_reads_the_byte_level_export_as_the_run(tmp_path, tiny_tokenizer_dir, tiny_model_dir):
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    tok = load_tokenizer(model_dir)
    tok.chat_template = DEFAULT_CHAT_TEMPLATE
    tok.save_pretrained(model_dir)
    out = tmp_path / "bpe.gguf"
    export_gguf(model_dir, out, "f16", None, QUIET)
    llm = _llama(out)
    for text in [*ROUND_TRIP_TEXTS, " alpha", tok.apply_chat_template(TURNS, tokenize=False)]:
        assert _ids(llm, text) == tok(text, add_special_tokens=False)["input_ids"], text
    _assert_logits(llm, model_dir, len(tok), 4)
    llm.close()
