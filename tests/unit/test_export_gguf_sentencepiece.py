"""``trainforge export --format gguf`` of a SentencePiece-style tokenizer (Llama 2 / Mistral layout: ``▁`` for
spaces, byte fallback, ``<unk>``/``<s>``/``</s>``), read back by transformers' GGUF reader and gguf-py's
``GGUFReader``: the file is llama.cpp's ``llama`` vocabulary (types, scores that carry the merge order, no
merges), the tokenizer read back encodes as the run's; what llama.cpp would read differently is refused or
warned about; the Ollama Modelfile of [INST]-style templates (Mistral Instruct, Llama 2 chat)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from rich.console import Console

pytest.importorskip("gguf")

from sentencepiece_models import (
    MISTRAL_TEMPLATE,
    ROUND_TRIP_TEXTS,
    write_other_tokenizer,
)

from trainforge.metrics.console import ConsoleReporter
from trainforge.model.tokenizer import load_tokenizer
from trainforge.tools.export_gguf import export_gguf
from trainforge.tools.gguf_model import GGUFExportError

QUIET = ConsoleReporter(Console(quiet=True))
TURNS = [{"role": "user", "content": "continue: alpha beta"}, {"role": "assistant", "content": "gamma delta"},
         {"role": "user", "content": "and then? 日本"}]
TEXTS = ROUND_TRIP_TEXTS


def _back_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def _fields(path: Path) -> dict:
    from gguf import GGUFReader

    return {name: field.contents() for name, field in GGUFReader(path).fields.items()}


def _texts(tok) -> list[str]:
    chats = [tok.apply_chat_template(TURNS, tokenize=False), tok.apply_chat_template(TURNS[:2], tokenize=False),
             tok.apply_chat_template(TURNS[:1], tokenize=False, add_generation_prompt=True)]
    return [*TEXTS, *chats]


def _differing(tok, back) -> list[str]:
    return [text for text in _texts(tok) for special in (False, True)
            if back(text, add_special_tokens=special)["input_ids"] != tok(text, add_special_tokens=special)["input_ids"]]


def test_the_tokenizer_read_back_encodes_as_the_runs(tmp_path, sp_llama_dir):
    out = tmp_path / "sp.gguf"
    export_gguf(sp_llama_dir, out, "f16", None, QUIET)
    tok, back = load_tokenizer(sp_llama_dir), _back_tokenizer(out)
    assert _differing(tok, back) == []
    ids = tok(TEXTS[0], add_special_tokens=False)["input_ids"]
    assert {"<0xE6>", "<0xF0>", "<0xE2>"} <= set(tok.convert_ids_to_tokens(ids))  # 日, 🙂, ∑ by byte fallback
    assert back.decode(ids) == tok.decode(ids) == TEXTS[0]
    assert back.chat_template == tok.chat_template == MISTRAL_TEMPLATE.read_text()
    assert (back.bos_token_id, back.eos_token_id, back.unk_token_id) == (1, 2, 0)


def test_the_file_is_llama_cpps_sentencepiece_vocabulary(tmp_path, sp_llama_dir):
    out = tmp_path / "sp.gguf"
    export_gguf(sp_llama_dir, out, "f16", None, QUIET)
    meta = _fields(out)
    backend = json.loads((sp_llama_dir / "tokenizer.json").read_text())["model"]
    vocab = backend["vocab"]
    assert meta["tokenizer.ggml.model"] == "llama" and meta["tokenizer.ggml.pre"] == "default"
    assert "tokenizer.ggml.merges" not in meta  # llama.cpp merges by score; transformers' reader rebuilds them from it
    assert meta["tokenizer.ggml.tokens"] == sorted(vocab, key=vocab.get)
    types = meta["tokenizer.ggml.token_type"]
    assert types[:3] == [2, 3, 3] and set(types[3:259]) == {6} and set(types[259:]) == {1}  # unknown, control, byte, normal
    assert (meta["tokenizer.ggml.unknown_token_id"], meta["tokenizer.ggml.bos_token_id"], meta["tokenizer.ggml.eos_token_id"]) == (0, 1, 2)
    assert meta["tokenizer.ggml.add_bos_token"] is True and meta["tokenizer.ggml.add_eos_token"] is False
    assert meta["tokenizer.ggml.add_space_prefix"] is True
    assert meta["tokenizer.chat_template"] == MISTRAL_TEMPLATE.read_text()
    # the scores carry the merge order: each merged piece scores minus the rank of its first merge, every other
    # token below all of them
    scores = dict(zip(meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.scores"]))
    first: dict[str, int] = {}
    for rank, (left, right) in enumerate(backend["merges"]):
        first.setdefault(left + right, rank)
    assert {piece: scores[piece] for piece in first} == {piece: -float(rank) for piece, rank in first.items()}
    assert max(s for t, s in scores.items() if t not in first) < -len(backend["merges"]) + 1


def test_the_round_trip_fails_when_the_scores_lose_the_merge_order(tmp_path, sp_llama_dir, monkeypatch):
    """The texts above tell scores apart: flat scores (what llama.cpp's tokenizer.json-only converter writes)
    make transformers' reader, as llama.cpp, merge in another order."""
    from trainforge.tools import gguf_vocab

    monkeypatch.setattr(gguf_vocab, "spm_scores", lambda tokens, types, merges: ([-1000.0] * len(tokens), 0))
    out = tmp_path / "flat.gguf"
    export_gguf(sp_llama_dir, out, "f16", None, QUIET)
    assert _differing(load_tokenizer(sp_llama_dir), _back_tokenizer(out))


def test_scores_and_the_splits_llama_cpp_would_join_otherwise():
    from trainforge.tools.gguf_spm import spm_scores

    tokens, types = ["<unk>", "a", "b", "c", "ab", "bc", "abc"], [2, 1, 1, 1, 1, 1, 1]
    complete = [("a", "b"), ("b", "c"), ("a", "bc"), ("ab", "c")]  # every split of every piece, grouped by piece
    scores, unmatched = spm_scores(tokens, types, complete)
    assert scores == [-4.0, -5.0, -6.0, -7.0, 0.0, -1.0, -2.0] and unmatched == 0
    # a BPE trainer's merges: "abc" only as "ab" + "c"; llama.cpp may join "a" + "bc"
    assert spm_scores(tokens, types, [("b", "c"), ("a", "b"), ("ab", "c")])[1] == 1
    assert spm_scores(tokens, types, [("a", "b"), ("a", "bc"), ("b", "c"), ("ab", "c")])[1] == 1  # "abc" split by "bc"


def _variant(tmp_path: Path, sp_dir: Path, name: str, config: dict, tokenizer_json=None) -> Path:
    out = tmp_path / name
    out.mkdir()
    for file in ("tokenizer.json", "special_tokens_map.json"):
        shutil.copy(sp_dir / file, out / file)
    declared = json.loads((sp_dir / "tokenizer_config.json").read_text()) | config
    (out / "tokenizer_config.json").write_text(json.dumps(declared))
    if tokenizer_json is not None:
        data = json.loads((sp_dir / "tokenizer.json").read_text())
        tokenizer_json(data)
        (out / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False))
    return out


def _legacy_normalizer(data: dict) -> None:
    """The older layout of Llama 2 / Mistral v0.1 tokenizer.json: a Prepend + Replace normalizer, no pre-tokenizer."""
    data["normalizer"] = {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "\u2581"},
                                                              {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]}
    data["pre_tokenizer"] = None


def test_the_space_prefix_and_where_llama_cpp_puts_it_otherwise(tmp_path, sp_llama_dir):
    """llama.cpp (as SentencePiece) writes a ``▁`` before every text after a special token and before text that
    starts with a space. transformers' Llama tokenizer does neither with legacy=False (the GGUF reader's own
    rule, so the round trip above holds) and only the first with legacy=True; the legacy normalizer layout
    loaded as it is does both; a tokenizer without the prefix writes add_space_prefix false."""
    from trainforge.tools.gguf_spm import space_prefix

    modern = space_prefix(load_tokenizer(sp_llama_dir))
    assert modern[0] is True and [d.split(" (")[0] for d in modern[1]] == [
        "text right after a special token", "text that starts with a space"]
    legacy = space_prefix(load_tokenizer(_variant(tmp_path, sp_llama_dir, "legacy", {"legacy": True})))
    assert legacy[0] is True and [d.split(" (")[0] for d in legacy[1]] == ["text that starts with a space"]
    as_is = _variant(tmp_path, sp_llama_dir, "as-is", {"tokenizer_class": "PreTrainedTokenizerFast"}, _legacy_normalizer)
    assert space_prefix(load_tokenizer(as_is)) == (True, [])
    bare = _variant(tmp_path, sp_llama_dir, "bare", {"add_prefix_space": False})
    assert space_prefix(load_tokenizer(bare)) == (False, [])


def test_what_llama_cpp_joins_otherwise_is_written_with_a_warning(tmp_path, sp_llama_dir):
    """A Metaspace that splits at spaces (llama.cpp joins '▁▁' pieces across them) and merges that are not every
    split of every piece (a BPE trainer's: llama.cpp may join a piece from another split) are written, warned."""
    from trainforge.tools.gguf_vocab import read_vocab

    def split_at_spaces(data):
        data["pre_tokenizer"]["split"] = True

    def trainer_merges(data):  # one split per piece, as the tokenizers library's BPE trainer learns them
        kept, seen = [], set()
        for left, right in data["model"]["merges"]:
            if left + right not in seen:
                seen.add(left + right)
                kept.append([left, right])
        data["model"]["merges"] = kept

    generic = {"tokenizer_class": "PreTrainedTokenizerFast"}  # tokenizer.json as it is
    as_is = load_tokenizer(_variant(tmp_path, sp_llama_dir, "as-is", generic, lambda data: None))
    assert [w for w in read_vocab(as_is, len(as_is)).warnings if "split" in w or "merges" in w] == []
    split = load_tokenizer(_variant(tmp_path, sp_llama_dir, "split", generic, split_at_spaces))
    spanning = min((p for p in split.get_vocab() if "\u2581" in p[1:]), key=split.get_vocab().__getitem__)
    assert any("(split: true)" in w and f"pieces across a space ({spanning!r}" in w for w in read_vocab(split, len(split)).warnings)
    trained = load_tokenizer(_variant(tmp_path, sp_llama_dir, "trained", generic, trainer_merges))
    assert any("merges are not SentencePiece's" in w for w in read_vocab(trained, len(trained)).warnings)


def test_tokenizers_llama_cpp_cannot_read_alike_are_refused_naming_the_kind(tmp_path, sp_llama_dir):
    from conftest import toy_documents

    def model_with(name: str, tokenizer_dir: Path) -> Path:
        for file in ("config.json", "model.safetensors"):
            shutil.copy(sp_llama_dir / file, tokenizer_dir / file)
        return tokenizer_dir

    def no_byte_fallback(data):
        data["model"]["byte_fallback"] = False

    def nfkc(data):
        data["normalizer"] = {"type": "NFKC"}

    def whitespace_bpe(data):  # neither byte-level nor ▁: a BPE over whitespace-split words
        data["pre_tokenizer"], data["decoder"] = {"type": "Whitespace"}, None
        vocab = data["model"]["vocab"]
        data["model"]["vocab"] = {t.replace("\u2581", "_"): i for t, i in vocab.items()}
        data["model"]["merges"] = [[a.replace("\u2581", "_"), b.replace("\u2581", "_")] for a, b in data["model"]["merges"]]

    generic = {"tokenizer_class": "PreTrainedTokenizerFast"}  # tokenizer.json as it is, not rebuilt by LlamaTokenizer
    cases = {
        "Unigram": (write_other_tokenizer(tmp_path / "unigram", "Unigram", toy_documents(60)), "a Unigram model"),
        "WordPiece": (write_other_tokenizer(tmp_path / "wordpiece", "WordPiece", toy_documents(60)), "a WordPiece model"),
        "no-bytes": (_variant(tmp_path, sp_llama_dir, "no-bytes", generic, no_byte_fallback), "without byte fallback"),
        "nfkc": (_variant(tmp_path, sp_llama_dir, "nfkc", generic, nfkc), "normalizer NFKC"),
        "whitespace": (_variant(tmp_path, sp_llama_dir, "whitespace", generic, whitespace_bpe), "neither byte-level"),
    }
    for name, (directory, said) in cases.items():
        with pytest.raises(GGUFExportError, match=said) as refused:
            export_gguf(model_with(name, directory), tmp_path / f"{name}.gguf", "f16", None, QUIET)
        assert refused.value.exit_code == 2 and "--format hf" in str(refused.value), name
    assert not list(tmp_path.glob("*.gguf"))


LLAMA2_TEMPLATE = (  # meta-llama/Llama-2-7b-chat-hf's tokenizer_config.json chat_template
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% set system_message = messages[0]"
    "['content'] %}{% else %}{% set loop_messages = messages %}{% set system_message = false %}{% endif %}{% for message "
    "in loop_messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation "
    "roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if loop.index0 == 0 and system_message != "
    "false %}{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}{% else %}{% set "
    "content = message['content'] %}{% endif %}{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + "
    "content.strip() + ' [/INST]' }}{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + "
    "eos_token }}{% endif %}{% endfor %}"
)


def _render(tok, template: str):
    return lambda messages, gen: tok.apply_chat_template(messages, chat_template=template, tokenize=False,
                                                         add_generation_prompt=gen)


def test_modelfile_for_mistral_instruct_has_no_system_branch_and_stops_at_eos(tmp_path, sp_llama_dir):
    from trainforge.tools.export_ollama import ollama_files

    tok = load_tokenizer(sp_llama_dir)
    render = _render(tok, MISTRAL_TEMPLATE.read_text())
    text, warnings = ollama_files(tmp_path / "m.gguf", tmp_path, render, "<s>", True)
    assert text == (
        'FROM ./m.gguf\nTEMPLATE """{{ range .Messages }}{{ if eq .Role "user" }}[INST] {{ .Content }} [/INST]'
        '{{ else if eq .Role "assistant" }}{{ .Content }}</s>{{ end }}{{ end }}"""\nPARAMETER stop "</s>"\n'
    )  # the <s> the template writes first is llama.cpp's own BOS (add_bos), so left out
    assert len(warnings) == 1 and "refuses a system message" in warnings[0]
    kept, _ = ollama_files(tmp_path / "m.gguf", tmp_path, render, "<s>", False)
    assert 'TEMPLATE """<s>{{ range .Messages }}' in kept


def test_modelfile_for_llama2_chat_merges_the_system_prompt_and_opens_later_turns_with_bos(tmp_path, sp_llama_dir):
    from trainforge.tools.export_ollama import chat_shape, ollama_files

    tok = load_tokenizer(sp_llama_dir)
    render = _render(tok, LLAMA2_TEMPLATE)
    text, warnings = ollama_files(tmp_path / "m.gguf", tmp_path, render, "<s>", True)
    system = '{{ if and (eq $i 1) (eq (index $.Messages 0).Role "system") }}<<SYS>>\n{{ (index $.Messages 0).Content }}\n<</SYS>>\n\n{{ end }}'
    assert text == (
        'FROM ./m.gguf\nTEMPLATE """{{ $first := true }}{{ range $i, $_ := .Messages }}{{ if eq .Role "user" }}'
        f'{{{{ if not $first }}}}<s>{{{{ end }}}}[INST] {system}{{{{ .Content }}}} [/INST]{{{{ $first = false }}}}'
        '{{ else if eq .Role "assistant" }} {{ .Content }} </s>{{ $first = false }}{{ end }}{{ end }}"""\n'
        'PARAMETER stop "</s>"\n'
    )
    assert warnings == []
    shape = chat_shape(render, "<s>")  # what the Go template writes is what the Jinja template writes
    turns = [{"role": "system", "content": "Be brief."}, *TURNS, {"role": "assistant", "content": "zeta"}]
    assert shape.system == "merged" and shape.render(turns, False) == render(turns, False)
    assert shape.render(turns, False).count("<s>[INST]") == 2
    without_bos, _ = ollama_files(tmp_path / "m.gguf", tmp_path, render, "<s>", False)
    assert "$first" not in without_bos and '{{ if eq .Role "user" }}<s>[INST] ' in without_bos
