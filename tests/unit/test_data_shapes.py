"""Data as people have it: ShareGPT rows, text-part contents, one-file corpora, per-format too-long defaults."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import WORDS, write_jsonl
from trainforge.config.data import DataSettings, FieldNames
from trainforge.data.formats import Renderer, tokenize_rendered
from trainforge.data.holdout import held_out_blocks
from trainforge.data.prepare import prepare_data
from trainforge.data.sources import DataError, Row
from trainforge.data.store import TokenStore
from trainforge.data.plan import lost_tokens_warning
from trainforge.model.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tok(tiny_tokenizer_dir):
    return load_tokenizer(tiny_tokenizer_dir)


def prepare(tmp_path, tok, **data):
    cfg = DataSettings(cache_dir=tmp_path / "cache", num_workers=1, **data)
    return prepare_data(cfg, tok, seed=0, log=lambda *_: None)


def learned_text(tok, row: dict, **kw) -> str:
    r = Renderer("chat", FieldNames(), tok, **kw)(Row(row, "x.jsonl:1"))
    chunk = tokenize_rendered([r], tok, 512, "truncate", special_tokens=False)
    return tok.decode(chunk.ids[chunk.learn.astype(bool)].tolist())


OPENAI = {
    "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "alpha beta"},
        {"role": "assistant", "content": "gamma"},
        {"role": "user", "content": "delta"},
        {"role": "assistant", "content": "epsilon zeta"},
    ]
}
SHAREGPT = {
    "id": "identity_0",
    "conversations": [
        {"from": "system", "value": "be brief"},
        {"from": "human", "value": "alpha beta"},
        {"from": "gpt", "value": "gamma"},
        {"from": "human", "value": "delta"},
        {"from": "gpt", "value": "epsilon zeta"},
    ],
}


def test_sharegpt_rows_render_and_mask_like_openai_messages(tok):
    as_openai = Renderer("chat", FieldNames(), tok)(Row(OPENAI, "x:1"))
    as_sharegpt = Renderer("chat", FieldNames(), tok)(Row(SHAREGPT, "x:1"))
    assert as_sharegpt.text == as_openai.text and as_sharegpt.spans == as_openai.spans
    assert learned_text(tok, SHAREGPT) == "gamma<|im_end|>\nepsilon zeta<|im_end|>\n"


def test_a_top_level_system_field_is_the_system_turn(tok):
    """LLaMA-Factory's ShareGPT layout puts the system prompt beside the turns: it renders as OpenAI's system message."""
    beside = {"system": "be brief", "conversations": SHAREGPT["conversations"][1:]}
    as_openai = Renderer("chat", FieldNames(), tok)(Row(OPENAI, "x:1"))
    assert Renderer("chat", FieldNames(), tok)(Row(beside, "x:1")).text == as_openai.text


def test_sharegpt_is_detected_and_counts_exactly_the_assistant_tokens(tmp_path, tok):
    path = write_jsonl(tmp_path / "sharegpt.jsonl", [SHAREGPT] * 3)
    data = prepare(tmp_path, tok, train=str(path), eval=None)
    assert data.format == "chat"
    turns = ["gamma<|im_end|>\n", "epsilon zeta<|im_end|>\n"]
    per_row = sum(len(tok(t, add_special_tokens=False)["input_ids"]) for t in turns)
    assert data.stats["train_target_tokens"] == 3 * per_row


@pytest.mark.parametrize(
    "source, role",
    [("human", "user"), ("user", "user"), ("gpt", "assistant"), ("model", "assistant"), ("chatgpt", "assistant"),
     ("system", "system"), ("observation", "tool"), ("function_call", "assistant"), ("tool", "tool")],
)
def test_sharegpt_roles_map_to_template_roles(tok, source, role):
    row = {"conversations": [{"from": source, "value": "x"}]}
    r = Renderer("chat", FieldNames(), tok, train_on_prompt=True)(Row(row, "x:1"))
    assert r.text.startswith(f"<|im_start|>{role}\n")


def test_tool_results_use_the_templates_tool_role_or_user():
    from trainforge.data.chat_messages import tool_role_of

    assert tool_role_of("{% if message['role'] == 'tool' %}", default_template=False) == "tool"
    assert tool_role_of('{% elif message.role == "ipython" %}', default_template=False) == "ipython"
    assert tool_role_of("{{ '[INST] ' + message['content'] }}", default_template=False) == "user"


def test_text_parts_are_joined_and_other_parts_are_refused(tok):
    parts = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "alpha "}, {"type": "text", "text": "beta"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "gamma"}]},
        ]
    }
    plain = {"messages": [{"role": "user", "content": "alpha beta"}, {"role": "assistant", "content": "gamma"}]}
    assert Renderer("chat", FieldNames(), tok)(Row(parts, "x:1")).text == Renderer("chat", FieldNames(), tok)(Row(plain, "x:1")).text
    image = {"messages": [{"role": "user", "content": [{"type": "image", "url": "a.png"}, {"type": "text", "text": "what?"}]}]}
    with pytest.raises(DataError, match=r"x\.jsonl:7: messages\[0\]\.content\[0\] is a 'image' part"):
        Renderer("chat", FieldNames(), tok)(Row(image, "x.jsonl:7"))


def test_a_user_turn_quoting_the_assistant_content_does_not_move_the_mask(tok):
    row = {"messages": [{"role": "user", "content": "say gamma"}, {"role": "assistant", "content": "gamma"}]}
    r = Renderer("chat", FieldNames(), tok)(Row(row, "x:1"))
    (a, b), = r.spans
    assert r.text[a:b] == "gamma<|im_end|>\n" and r.text.index("gamma") < a


def test_a_template_that_appends_eos_only_at_the_end_still_masks_each_turn(tok):
    # the Phi-3 shape: '<|end|>' closes each turn, eos_token only when the conversation ends
    template = (
        "{% for message in messages %}{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"
    )
    text = learned_text(tok, OPENAI, chat_template=template)
    assert text == "gamma<|end|>\nepsilon zeta<|end|>\n"


def test_a_template_that_rewrites_content_names_the_row(tok):
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] | upper }}\n{% endfor %}"
    with pytest.raises(DataError, match=r"x\.jsonl:1: the chat template changes message 0 \(user\).*data\.chat_template"):
        learned_text(tok, {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}, chat_template=template)


def test_a_template_that_refuses_a_conversation_names_the_row(tok):
    template = "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(DataError, match=r"x\.jsonl:1: the chat template cannot render this conversation: System role not supported"):
        learned_text(tok, OPENAI, chat_template=template)


# ---------------------------------------------------------------- too-long defaults


def _long_docs(n: int, words: int) -> list[dict[str, str]]:
    return [{"text": " ".join(WORDS[(d + i) % len(WORDS)] for i in range(words))} for d in range(n)]


def test_text_splits_long_documents_by_default_and_keeps_every_token(tmp_path, tok):
    path = write_jsonl(tmp_path / "long.jsonl", _long_docs(6, 300))
    split = prepare(tmp_path, tok, train=str(path), eval=None, max_length=64)
    assert split.stats["too_long"] == "split" and split.stats["lost_tokens"] == 0 and split.stats["split"] == 6
    cut = prepare(tmp_path, tok, train=str(path), eval=None, max_length=64, too_long="truncate")
    full = sum(len(tok(r["text"])["input_ids"]) + 1 for r in _long_docs(6, 300))  # + EOS each
    assert cut.stats["lost_tokens"] == full - 6 * 65  # each document keeps max_length + 1 tokens
    assert cut.stats["lost_token_share"] == pytest.approx(cut.stats["lost_tokens"] / full)
    warning = lost_tokens_warning(cut.stats, 64)
    assert f"discarded {cut.stats['lost_tokens']:,} tokens" in warning and "data.too_long: split" in warning
    assert lost_tokens_warning(split.stats, 64) is None


def test_prompt_completion_still_truncates_by_default(tmp_path, tok):
    rows = [{"prompt": "continue:", "completion": " " + " ".join(WORDS * 4)}] * 2
    data = prepare(tmp_path, tok, train=str(write_jsonl(tmp_path / "pc.jsonl", rows)), eval=None, max_length=32)
    assert data.stats["too_long"] == "truncate" and data.stats["truncated"] == 2
    inputs = [len(data.train.sequence(i)[0]) - 1 for i in range(len(data.train))]  # cut to the row: 32 inputs each
    assert data.stats["train_token_squares"] == sum(n * n for n in inputs) == 2 * 32**2
    warning = lost_tokens_warning(data.stats, 32)
    assert "raise data.max_length" in warning


# ---------------------------------------------------------------- one-file corpora


def test_a_one_file_corpus_holds_its_eval_fraction_out_of_the_blocks(tmp_path, tok):
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(i % 13 + 3)) for i in range(900)))
    data = prepare(tmp_path, tok, train=str(path), max_length=32)  # defaults: eval 0.05, text -> split
    s = data.stats
    assert s["train_rows"] == 1 and s["eval_holdout"] == "blocks"
    whole = prepare(tmp_path, tok, train=str(path), eval=None, max_length=32)
    n = len(whole.train)
    assert len(data.eval) == s["eval_sequences"] == round(0.05 * n) and len(data.train) == n - len(data.eval)

    def blocks(store: TokenStore) -> list[tuple[int, ...]]:
        return [tuple(store.sequence(i)[0].tolist()) for i in range(len(store))]

    train, held = blocks(data.train), blocks(data.eval)
    assert not set(train) & set(held)  # training and eval never share a block
    assert sorted(train + held) == sorted(blocks(whole.train))  # and together they are the corpus
    # order kept on each side; a continuation flag survives only where its predecessor stayed alongside
    order = {b: i for i, b in enumerate(blocks(whole.train))}
    assert [order[b] for b in train] == sorted(order[b] for b in train)
    for i, b in enumerate(train):
        expected = i > 0 and order[train[i - 1]] == order[b] - 1 and bool(whole.train.continues[order[b]])
        assert bool(data.train.continues[i]) == expected
    assert s["train_tokens"] == sum(len(b) - 1 for b in train)
    assert s["train_token_squares"] == sum((len(b) - 1) ** 2 for b in train)
    assert s["train_target_tokens"] == sum(int(data.train.sequence(i)[1][1:].sum()) for i in range(len(data.train)))


def test_held_out_blocks_are_seeded_by_content(tmp_path, tok):
    from conftest import make_store

    seqs = [([i, i + 1, i + 2], [True] * 3) for i in range(40)] + [([5, 6, 7], [True] * 3)] * 3
    store = make_store(tmp_path / "s", seqs)
    mask = held_out_blocks(store, 0.25, seed=0)
    assert mask.sum() >= 10 and np.array_equal(mask, held_out_blocks(store, 0.25, seed=0))
    dupes = [i for i, (ids, _) in enumerate(seqs) if ids == [5, 6, 7]]
    assert len({bool(mask[i]) for i in dupes}) == 1  # identical blocks: one side
    assert not np.array_equal(mask, held_out_blocks(store, 0.25, seed=1))
    with pytest.raises(DataError, match="at least 2 blocks"):
        held_out_blocks(make_store(tmp_path / "one", seqs[:1]), 0.05, seed=0)


def test_row_holdout_still_holds_out_rows_and_streams_them(tmp_path, tok):
    rows = [{"prompt": f"continue: {w}", "completion": f" {w} {w}"} for w in WORDS] * 5
    rows = [dict(r, prompt=r["prompt"] + f" {i}") for i, r in enumerate(rows)]
    data = prepare(tmp_path, tok, train=str(write_jsonl(tmp_path / "pc.jsonl", rows)), eval=0.2)
    s = data.stats
    assert s["eval_holdout"] == "rows" and s["eval_rows"] == round(0.2 * len(rows)) and s["train_rows"] + s["eval_rows"] == len(rows)
    assert not list(data.cache_path.rglob("held_out.jsonl"))  # the spill file is gone
    assert json.loads((data.cache_path / "stats.json").read_text())["eval_sequences"] == s["eval_rows"]


def test_block_holdout_keeps_each_sources_blocks_in_its_own_range(tmp_path, tok):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text(" ".join(WORDS * 40))
    b.write_text(" ".join(reversed(WORDS * 60)))
    data = prepare(tmp_path, tok, train=[str(a), {"path": str(b), "weight": 2.0}], max_length=16, eval=0.1)
    whole = prepare(tmp_path, tok, train=[str(a), str(b)], max_length=16, eval=None)
    assert data.train.n_sources == 2
    for k in range(2):
        mine = {tuple(data.train.sequence(i)[0].tolist()) for i in data.train.source_of(k)}
        theirs = {tuple(whole.train.sequence(i)[0].tolist()) for i in whole.train.source_of(k)}
        assert mine and mine <= theirs
    assert len(data.train) + len(data.eval) == len(whole.train)


def test_a_reply_whose_first_token_carries_the_templates_space_learns_that_token():
    """Mixtral-style '[/INST] ' + reply: a byte-level BPE merges the space and 'Rome' into 'ĠRome'."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["</s>", "<s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    core.train_from_iterator(["[INST] Hi [/INST] Rome is nice."] * 50, trainer=trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="</s>", bos_token="<s>")
    assert "ĠRome" in tok.get_vocab()
    template = (
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + ' [/INST]' }}"
        "{% else %}{{ ' ' + m['content'] + eos_token }}{% endif %}{% endfor %}"
    )
    row = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Rome is nice."}]}
    r = Renderer("chat", FieldNames(), tok, chat_template=template)(Row(row, "x:1"))
    chunk = tokenize_rendered([r], tok, 64, "truncate", special_tokens=False)
    learned = chunk.ids[chunk.learn.astype(bool)].tolist()
    assert learned == tok(" Rome is nice.</s>", add_special_tokens=False)["input_ids"]
    assert tok.convert_ids_to_tokens(learned[0]) == "ĠRome"


def test_data_whose_every_row_is_bad_names_the_first_bad_row(tmp_path, tok):
    path = tmp_path / "broken.jsonl"
    path.write_text("{not json\n[1, 2]\n")
    with pytest.raises(DataError, match=r"no rows found; every row is bad, first: .*broken\.jsonl:1: malformed JSON"):
        prepare(tmp_path, tok, train=str(path), eval=None)


@pytest.mark.parametrize("row,setting", [
    # databricks-dolly-15k
    ({"instruction": "When did it start?", "context": "It began in 2000.", "response": "In 2000.", "category": "closed_qa"},
     "Dolly-style instruction data: set data.fields: {output: response, input: context}"),
    ({"instruction": "Name a color.", "response": "Blue.", "category": "brainstorming"},
     "Dolly-style instruction data: set data.fields: {output: response}"),
    # lvwerra/stack-exchange-paired
    ({"qid": 1, "question": "Why?", "date": "2010", "metadata": [], "response_j": "Because.", "response_k": "No."},
     "StackExchange-paired preference pairs: set data.fields: {prompt: question, chosen: response_j, rejected: response_k}"),
    ({"id": 3, "question": "2+2?", "answer": "4"}, "question/answer data: set data.fields: {prompt: question, completion: answer}"),
    # summarization sets for encoder-decoders (docs/data.md names the CNN/DailyMail rename; the error did not)
    ({"article": "A long story.", "highlights": "Short.", "id": "0a1b"},
     "CNN/DailyMail-style summarization data: set data.fields: {prompt: article, completion: highlights}"),
    ({"document": "A long story.", "summary": "Short.", "id": "1"},
     "XSum-style summarization data: set data.fields: {prompt: document, completion: summary}"),
    ({"id": "13818513", "dialogue": "Amanda: I baked cookies.", "summary": "Amanda baked cookies."},
     "SAMSum-style summarization data: set data.fields: {prompt: dialogue, completion: summary}"),
])
def test_an_unknown_layout_of_a_public_dataset_gets_the_data_fields_that_read_it(tmp_path, tok, row, setting):
    """Rows no format matches used to get the list of formats only; columns of well-known public layouts now get the
    data.fields setting that reads them, and with it the same file trains (is prepared) as that format."""
    from trainforge.data.formats import detect_format

    with pytest.raises(DataError, match="cannot tell the data format") as e:
        detect_format(Row(row, "x.jsonl:1"), FieldNames())
    assert f"they look like {setting}." in str(e.value)
    fields = dict(kv.split(": ") for kv in setting.split("{")[1].rstrip("}").split(", "))
    write_jsonl(tmp_path / "rows.jsonl", [row] * 4)
    prepared = prepare(tmp_path, tok, train=str(tmp_path / "rows.jsonl"), eval=None, fields=fields)
    assert prepared.format in ("alpaca", "prompt_completion", "preference") and len(prepared.train) > 0
