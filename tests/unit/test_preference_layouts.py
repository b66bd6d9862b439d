"""LLaMA-Factory's preference layouts (its ``dpo_en_demo.json`` and ``kto_en_demo.json`` shapes): detected like the
others and tokenized exactly as the same rows converted by hand to the message-list layouts; a pair with a side
missing says which."""

from __future__ import annotations

import numpy as np
import pytest
from test_chat_templates import tokenizer_for

from trainforge.config.data import FieldNames
from trainforge.data.formats import Renderer, detect_format, tokenize_rendered
from trainforge.data.preference import PreferenceRenderer, preference_kind, tokenize_pairs
from trainforge.data.sources import DataError, Row

WHERE = "dpo_en_demo.json:3"


def sharegpt(role: str, text: str) -> dict:
    return {"from": {"user": "human", "assistant": "gpt"}.get(role, role), "value": text}


def openai(role: str, text: str) -> dict:
    return {"role": role, "content": text}


# (prompt turns, top-level system or None, chosen reply, rejected reply): single-turn, a system turn, history
CASES = [
    ([("user", "Capital of France?")], None, "Paris.", "Rome."),
    ([("system", "Answer in one word."), ("user", "Capital of Italy?")], None, "Rome.", "Milan, I think."),
    ([("user", "2+2?"), ("assistant", "4"), ("user", "And 3+3?")], None, "6", "7"),
    ([("user", "Name a colour.")], "You are terse.", "Red.", "I like many colours, such as red."),
]


def llama_factory_row(case, style=sharegpt, turns="conversations") -> dict:
    prompt, system, chosen, rejected = case
    row = {turns: [style(r, t) for r, t in prompt], "chosen": style("assistant", chosen), "rejected": style("assistant", rejected)}
    return row | ({"system": system} if system else {})


def converted_by_hand(case) -> dict:
    """The row in TRL's conversational layout, which trainforge read already: the prompt's messages, one reply each."""
    prompt, system, chosen, rejected = case
    messages = ([openai("system", system)] if system else []) + [openai(r, t) for r, t in prompt]
    return {"prompt": messages, "chosen": [openai("assistant", chosen)], "rejected": [openai("assistant", rejected)]}


def pair_tokens(family: str, rows: list[dict]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    tok = tokenizer_for(family)
    r = PreferenceRenderer(Renderer("preference", FieldNames(), tok))
    chunk = tokenize_pairs([r.pair(Row(row, f"rows.jsonl:{i + 1}")) for i, row in enumerate(rows)], tok, 4096)
    return chunk.ids, chunk.learn, chunk.lengths


@pytest.mark.parametrize("family", ["qwen2.5", "llama3", "phi3"])
@pytest.mark.parametrize("style,turns", [(sharegpt, "conversations"), (openai, "messages")])
def test_llama_factory_pairs_tokenize_as_the_rows_converted_by_hand(family, style, turns):
    """Was: "'chosen' and 'rejected' must both be strings or both be message lists, got dict and dict" for every row."""
    rows = [llama_factory_row(case, style, turns) for case in CASES]
    assert all(detect_format(Row(row, WHERE), FieldNames()) == "preference" for row in rows)
    assert all(preference_kind(Row(row, WHERE)) == "pairs" for row in rows)
    got, want = pair_tokens(family, rows), pair_tokens(family, [converted_by_hand(case) for case in CASES])
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    assert len(got[2]) == 2 * len(CASES) and got[1].any()


def test_llama_factory_pairs_learn_only_the_reply():
    tok = tokenizer_for("qwen2.5")
    r = PreferenceRenderer(Renderer("preference", FieldNames(), tok))
    chosen, rejected = r.pair(Row(llama_factory_row(CASES[2]), WHERE))
    learned = [tok.decode(tokenize_rendered([side], tok, 4096, "truncate").ids[side_mask(tok, side)]) for side in (chosen, rejected)]
    assert learned == ["6<|im_end|>\n", "7<|im_end|>\n"]  # the history's assistant turn "4" is context


def side_mask(tok, side) -> np.ndarray:
    return tokenize_rendered([side], tok, 4096, "truncate").learn.astype(bool)


def test_llama_factory_pairs_under_renamed_fields_and_without_turns():
    tok = tokenizer_for("qwen2.5")
    names = FieldNames(messages="dialog", chosen="better", rejected="worse")
    row = {"dialog": [sharegpt("user", "Hi?")], "better": sharegpt("assistant", "Hello!"), "worse": sharegpt("assistant", "Go away.")}
    assert detect_format(Row(row, WHERE), names) == "preference"
    chosen, _ = PreferenceRenderer(Renderer("preference", names, tok)).pair(Row(row, WHERE))
    assert chosen.text.endswith("<|im_start|>user\nHi?<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n")
    with pytest.raises(DataError, match=rf"^{WHERE}: no prompt: 'chosen' and 'rejected' are single messages, and the row "
                       r"has no 'messages' or 'conversations' turns \(fields: \['chosen', 'rejected'\]\)"):
        PreferenceRenderer(Renderer("preference", FieldNames(), tok)).pair(
            Row({"chosen": openai("assistant", "a"), "rejected": openai("assistant", "b")}, WHERE))


@pytest.mark.parametrize("system", [None, "You are terse."])
def test_llama_factory_kto_rows_in_sharegpt_layout_read_as_its_messages_layout(system):
    """``{"conversations": [...], "label": bool}`` was chat data (under data.format: unpaired, a bad row)."""
    tok = tokenizer_for("qwen2.5")
    turns = [("user", "2+2?"), ("assistant", "5"), ("user", "Sure?"), ("assistant", "Yes, 5.")]
    shared = {"conversations": [sharegpt(r, t) for r, t in turns], "label": False} | ({"system": system} if system else {})
    by_hand = {"messages": ([openai("system", system)] if system else []) + [openai(r, t) for r, t in turns], "label": False}
    assert detect_format(Row(shared, WHERE), FieldNames()) == "unpaired" and preference_kind(Row(shared, WHERE)) == "unpaired"
    r = PreferenceRenderer(Renderer("unpaired", FieldNames(), tok))
    (got, good), (want, _) = r.examples(Row(shared, WHERE))[0], r.examples(Row(by_hand, WHERE))[0]
    assert good is False and (got.text, got.spans) == (want.text, want.spans)


@pytest.mark.parametrize(
    "row, said",
    [
        ({"prompt": "q", "chosen": " a"}, "the 'rejected' field is missing (fields: ['chosen', 'prompt'])"),
        ({"prompt": "q", "chosen": None, "rejected": " b"}, "the 'chosen' field is null (fields: ['chosen', 'prompt', 'rejected'])"),
    ],
)
def test_a_pair_missing_a_side_says_which_and_what_is_expected(row, said):
    """Was: "'chosen' and 'rejected' must both be strings or both be message lists, got str and NoneType"."""
    tok = tokenizer_for("qwen2.5")
    with pytest.raises(DataError) as e:
        PreferenceRenderer(Renderer("preference", FieldNames(), tok)).pair(Row(row, WHERE))
    message = str(e.value)
    assert message.startswith(f"{WHERE}: {said}: a preference pair needs 'chosen' and 'rejected', both strings, both "
                              "message lists, or both single messages"), message
    assert "NoneType" not in message


def test_a_tokenizer_built_from_llama_factory_rows_sees_their_texts(tmp_path):
    """``model.tokenizer: char`` (or a BPE trained on the data) reads the turns, a top-level system and both replies."""
    import json

    from trainforge.config.data import DataSettings
    from trainforge.data.prepare import training_texts

    pairs = tmp_path / "dpo.json"
    pairs.write_text(json.dumps([llama_factory_row(case) for case in CASES]))
    texts = set(training_texts(DataSettings(train=str(pairs), eval=None), "preference"))
    assert {"Answer in one word.", "And 3+3?", "You are terse.", "Paris.", "Rome.", "Milan, I think."} <= texts
    kto = tmp_path / "kto.jsonl"
    kto.write_text(json.dumps({"conversations": [sharegpt("user", "2+2?"), sharegpt("assistant", "5")], "label": False}) + "\n")
    assert set(training_texts(DataSettings(train=str(kto), eval=None), "unpaired")) == {"2+2?", "5"}
