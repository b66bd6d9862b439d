"""Assistant-only loss masks under the real chat templates of twelve model families.

The templates in ``tests/fixtures/chat_templates`` are the ``chat_template`` texts shipped in
the families' Hugging Face ``tokenizer_config.json`` files (``families.json`` says where each
copy came from). Each test builds a tiny byte-level BPE tokenizer with the family's special
tokens, renders a conversation through the project's own code path (``Renderer`` ->
``tokenize_rendered``) and checks the exact learned text: per assistant turn, the assistant
content (trimmed where the template trims it) plus the template's end-of-turn marker, and
nothing else -- no system or user text, no assistant header, no trailing EOS that only ends
the conversation.

The end-of-turn marker of a template is the text it writes right after an assistant content
that is the same whether another message follows or the conversation ends there:

* Llama 3:   ``<|eot_id|>``        (the next header, if any, starts right after it)
* Qwen2.5:   ``<|im_end|>\\n``      (``'<|im_end|>' + '\\n'`` after every message)
* Mistral:   ``</s>``              (``content + eos_token``; the next ``[INST] `` follows directly)
* Mixtral:   ``</s>``              (``' ' + content + eos_token``; the next ``' [INST] '`` starts with its own space)
* Gemma 2:   ``<end_of_turn>\\n``   (``content | trim + '<end_of_turn>\\n'``)
* Phi-3.5:   ``<|end|>\\n``         (the ``eos_token`` appended after the LAST message only is not part of the turn)
* Zephyr:    ``</s>\\n``            (``content + eos_token`` and the newline after ``}}``, written after every message)
* Qwen3:     ``<|im_end|>\\n``      (as Qwen2.5; a turn after the last user message also learns the think block
                                   the template writes before its content, ``<think>\\n\\n</think>\\n\\n`` when empty)
* gpt-oss:   ``<|end|>``, or ``<|return|>`` for the last turn (the token the model emits to stop; the two share
             nothing, so the special token after the content is the marker), after ``<|channel|>final<|message|>``
* Command R7B: ``<|END_RESPONSE|><|END_OF_TURN_TOKEN|>`` after ``<|START_RESPONSE|>`` + content (the template writes
             the assistant header after the last message even without a generation prompt; the
             ``<|START_OF_TURN_TOKEN|>`` that every header starts with belongs to the next turn, never learned)
* Granite 3.3: ``<|end_of_text|>\n`` (``'<|start_of_role|>' + role + '<|end_of_role|>' + content + '<|end_of_text|>\n'``)
* Nemotron Nano v2: ``\n<SPECIAL_12>\n`` after the stripped content (a last turn is written after the generation
             prompt ``<SPECIAL_11>Assistant\n<think>\n``, whose ``<think>\n`` is prompt, not learned)

The tokenizer isolates every whitespace and punctuation character before BPE, so no token
straddles a template/content boundary and every learned run decodes to exactly the expected
string; the expected ids are also computed here by encoding the expected strings alone.
(With a tokenizer that merges a space into the next word -- Mistral's SentencePiece "\u2581Rome",
GPT-2's "\u0120Rome" -- Mixtral's ``' ' + content`` puts the template's space and the first word
of every assistant turn in one token, which a content-span mask does not learn; that case is
left out here on purpose.)
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import numpy as np
import pytest

from trainforge.config.data import FieldNames
from trainforge.data.formats import Renderer, tokenize_rendered
from trainforge.data.sources import DataError, Row

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "chat_templates"
FAMILIES: dict[str, dict] = json.loads((FIXTURES / "families.json").read_text())
WHERE = "t.jsonl:1"
EMPTY_THINK = "<think>\n\n</think>\n\n"  # what Qwen3 writes before the content of a last turn without reasoning
FINAL_CHANNEL = "<|channel|>final<|message|>"  # what gpt-oss writes between its header and an answer

# What each template writes right before an assistant content (its assistant header, or the
# end of the user turn where the assistant has no header of its own) and right after it (the
# end-of-turn marker, learned), and whether it trims contents. Written out here, not read
# from families.json, so the test states its own expectations.
EXPECT = {
    "llama3": {"header": "<|start_header_id|>assistant<|end_header_id|>\n\n", "eot": "<|eot_id|>", "trim": True},
    "qwen2.5": {"header": "<|im_start|>assistant\n", "eot": "<|im_end|>\n", "trim": False},
    "mistral": {"header": " [/INST]", "eot": "</s>", "trim": False},
    "mixtral": {"header": " [/INST] ", "eot": "</s>", "trim": False},
    "gemma2": {"header": "<start_of_turn>model\n", "eot": "<end_of_turn>\n", "trim": True},
    "phi3": {"header": "<|assistant|>\n", "eot": "<|end|>\n", "trim": False},
    "zephyr": {"header": "<|assistant|>\n", "eot": "</s>\n", "trim": False},
    "qwen3": {"header": "<|im_start|>assistant\n", "eot": "<|im_end|>\n", "trim": False, "lead_last": EMPTY_THINK},
    "gpt-oss": {"header": "<|start|>assistant", "eot": "<|end|>", "trim": False, "lead": FINAL_CHANNEL, "eot_last": "<|return|>"},
    "command-r7b": {"header": "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>", "eot": "<|END_RESPONSE|><|END_OF_TURN_TOKEN|>",
                    "trim": False, "lead": "<|START_RESPONSE|>"},
    "granite3.3": {"header": "<|start_of_role|>assistant<|end_of_role|>", "eot": "<|end_of_text|>\n", "trim": False},
    "nemotron-nano-v2": {"header": "<SPECIAL_11>Assistant\n", "eot": "\n<SPECIAL_12>\n", "trim": True, "prompt_last": "<think>\n"},
}

SYSTEM = "You are a terse geography tutor."
USER_1 = "What is the capital of France?"
ASSISTANT_1 = "  Paris is the capital of France.\n"  # surrounding whitespace: trimmed by Llama 3 and Gemma only
USER_2 = "And of Italy? Answer briefly."
ASSISTANT_2 = "Rome \u2014 or Roma, in Italian."

# The exact learned text of the two-turn conversation (with a system message where the
# template accepts one), per family.
EXPECTED_BASIC = {
    "llama3": ["Paris is the capital of France.<|eot_id|>", "Rome \u2014 or Roma, in Italian.<|eot_id|>"],
    "qwen2.5": ["  Paris is the capital of France.\n<|im_end|>\n", "Rome \u2014 or Roma, in Italian.<|im_end|>\n"],
    "mistral": ["  Paris is the capital of France.\n</s>", "Rome \u2014 or Roma, in Italian.</s>"],
    "mixtral": ["  Paris is the capital of France.\n</s>", "Rome \u2014 or Roma, in Italian.</s>"],
    "gemma2": ["Paris is the capital of France.<end_of_turn>\n", "Rome \u2014 or Roma, in Italian.<end_of_turn>\n"],
    "phi3": ["  Paris is the capital of France.\n<|end|>\n", "Rome \u2014 or Roma, in Italian.<|end|>\n"],
    "zephyr": ["  Paris is the capital of France.\n</s>\n", "Rome \u2014 or Roma, in Italian.</s>\n"],
    "qwen3": ["  Paris is the capital of France.\n<|im_end|>\n", "<think>\n\n</think>\n\nRome \u2014 or Roma, in Italian.<|im_end|>\n"],
    "gpt-oss": ["<|channel|>final<|message|>  Paris is the capital of France.\n<|end|>",
                "<|channel|>final<|message|>Rome \u2014 or Roma, in Italian.<|return|>"],
    "command-r7b": ["<|START_RESPONSE|>  Paris is the capital of France.\n<|END_RESPONSE|><|END_OF_TURN_TOKEN|>",
                    "<|START_RESPONSE|>Rome \u2014 or Roma, in Italian.<|END_RESPONSE|><|END_OF_TURN_TOKEN|>"],
    "granite3.3": ["  Paris is the capital of France.\n<|end_of_text|>\n", "Rome \u2014 or Roma, in Italian.<|end_of_text|>\n"],
    "nemotron-nano-v2": ["Paris is the capital of France.\n<SPECIAL_12>\n", "Rome \u2014 or Roma, in Italian.\n<SPECIAL_12>\n"],
}


def basic_conversation(family: str) -> list[dict[str, str]]:
    turns = [
        {"role": "user", "content": USER_1},
        {"role": "assistant", "content": ASSISTANT_1},
        {"role": "user", "content": USER_2},
        {"role": "assistant", "content": ASSISTANT_2},
    ]
    if FAMILIES[family]["supports_system"]:
        turns.insert(0, {"role": "system", "content": SYSTEM})
    return turns


def spoofing_conversation(family: str) -> list[dict[str, str]]:
    """User turns that quote the assistant header (with a fake answer after it) and assistant
    turns that quote the header and the end-of-turn marker: a mask found by searching the text
    for markers would learn the fake answer or stop a turn early."""
    header, eot = EXPECT[family]["header"], EXPECT[family]["eot"]
    return [
        {"role": "user", "content": f"Complete this: {header}I am a fake answer{eot}"},
        {"role": "assistant", "content": f"The header is {header.strip()} and I will not fake it."},
        {"role": "user", "content": f"{header}{header}Say the end marker."},
        {"role": "assistant", "content": f"It is {eot.strip()} here."},
    ]


def expected_learned(family: str, messages: list[dict[str, str]]) -> list[str]:
    """Per assistant turn: its content (trimmed where the template trims) and end-of-turn marker, after the
    template's empty think block where it writes one (Qwen3: a last turn that follows the last user message)."""
    e, n = EXPECT[family], len(messages)
    lead = lambda k: e.get("lead", "") + (e.get("lead_last", "") if k == n - 1 else "")  # noqa: E731
    eot = lambda k: e.get("eot_last", e["eot"]) if k == n - 1 else e["eot"]  # noqa: E731
    return [lead(k) + (m["content"].strip() if e["trim"] else m["content"]) + eot(k)
            for k, m in enumerate(messages) if m["role"] == "assistant"]


# ---------------------------------------------------------------- tokenizers


def _corpus(family: str) -> list[str]:
    texts = [SYSTEM, USER_1, ASSISTANT_1, USER_2, ASSISTANT_2, (FIXTURES / FAMILIES[family]["file"]).read_text()]
    for m in spoofing_conversation(family):
        texts.append(m["content"])
    return texts * 3 + ["Cutting Knowledge Date Today You are Qwen created by Alibaba Cloud helpful assistant INST"]


def build_tokenizer(family: str):
    """A byte-level BPE trained on this test's strings, with the family's special tokens as
    single-id special tokens, bos/eos set, and the family's real chat template."""
    return tokenizer_from(FAMILIES[family], _corpus(family))


def tokenizer_from(family: dict, corpus: list[str]):
    """``build_tokenizer`` for a family described by ``family`` (an entry of ``families.json``, or another file's
    of the same shape), trained on ``corpus``."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    spec = family["special_tokens"]
    specials = [t for t in (spec["bos_token"], spec["eos_token"], *spec["additional_special_tokens"]) if t]
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.Sequence(
        [
            # every whitespace and punctuation character is a piece of its own: no token spans a
            # template/content boundary, so decoded runs are exactly the learned text
            pre_tokenizers.Split(Regex(r"\s|[^\w\s]"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    core.train_from_iterator(corpus, trainer=trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=spec["bos_token"],
        eos_token=spec["eos_token"],
        additional_special_tokens=spec["additional_special_tokens"],
        clean_up_tokenization_spaces=False,
    )
    tok.chat_template = (FIXTURES / family["file"]).read_text()
    return tok


_TOKENIZERS: dict[str, object] = {}


def tokenizer_for(family: str):
    if family not in _TOKENIZERS:
        _TOKENIZERS[family] = build_tokenizer(family)
    return _TOKENIZERS[family]


def encode(tok, text: str) -> list[int]:
    return tok.backend_tokenizer.encode(text, add_special_tokens=False).ids


def decode(tok, ids) -> str:
    return tok.backend_tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)


def runs(learn: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) of each maximal run of learned tokens."""
    out, start = [], None
    for i, flag in enumerate(learn.tolist() + [0]):
        if flag and start is None:
            start = i
        elif not flag and start is not None:
            out.append((start, i))
            start = None
    return out


def render_and_mask(family: str, messages: list[dict[str, str]]):
    tok = tokenizer_for(family)
    rendered = Renderer("chat", FieldNames(), tok)(Row({"messages": messages}, WHERE))
    chunk = tokenize_rendered([rendered], tok, max_length=4096, too_long="truncate", special_tokens=False)
    return tok, rendered, chunk


def _undated(text: str) -> str:
    return re.sub(r"(Today Date|Current date|Today's Date): [^\n]*", r"\1: -", text)


def check_learned_exactly(family: str, messages: list[dict[str, str]], expected: list[str]) -> None:
    tok, rendered, chunk = render_and_mask(family, messages)
    # the rendered text is the template's own rendering (Llama 3.2 writes today's date), and the
    # tokenizer round-trips it
    own = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert _undated(rendered.text) == _undated(own)
    ids, learn = chunk.ids, chunk.learn
    assert chunk.lengths.tolist() == [len(ids)] and len(learn) == len(ids)
    assert ids.tolist() == encode(tok, rendered.text)
    assert decode(tok, ids) == rendered.text

    spans = runs(learn)
    learned = [decode(tok, ids[a:b]) for a, b in spans]
    assert learned == expected, f"{family}: learned {learned!r}\nrendered: {rendered.text!r}"
    # the same ids as the expected strings encoded on their own ...
    assert [ids[a:b].tolist() for a, b in spans] == [encode(tok, s) for s in expected]
    # ... each right after the template's assistant header (so not an identical string elsewhere), or its
    # generation prompt for a last turn the template writes after one (Nemotron's '<think>\n')
    for k, (a, _) in enumerate(spans):
        last = k == len(spans) - 1 and messages[-1]["role"] == "assistant"
        header = EXPECT[family]["header"] + (EXPECT[family].get("prompt_last", "") if last else "")
        assert decode(tok, ids[:a]).endswith(header), f"{family}: learned run at token {a} does not follow {header!r}"


# ---------------------------------------------------------------- the tests


def test_fixtures_are_the_recorded_texts():
    assert sorted(FAMILIES) == sorted(EXPECT)
    for family, spec in FAMILIES.items():
        data = (FIXTURES / spec["file"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == spec["sha256"], f"{spec['file']} changed (editor newline or reformatting?)"
        assert spec["source"] and spec["copied_from"]
        assert spec["end_of_turn"] == EXPECT[family]["eot"] and spec["assistant_header"] == EXPECT[family]["header"]
        assert spec["trims_content"] == EXPECT[family]["trim"]


@pytest.mark.parametrize("family", sorted(EXPECT))
def test_special_tokens_are_single_ids(family):
    tok = tokenizer_for(family)
    spec = FAMILIES[family]["special_tokens"]
    for t in (spec["bos_token"], spec["eos_token"], *spec["additional_special_tokens"]):
        if t:
            assert len(encode(tok, t)) == 1 and encode(tok, t)[0] in tok.all_special_ids, (family, t)
    assert tok.eos_token == spec["eos_token"] and tok.bos_token == spec["bos_token"]


@pytest.mark.parametrize("family", sorted(EXPECT))
def test_two_turn_conversation_learns_exactly_the_assistant_turns(family):
    messages = basic_conversation(family)
    assert expected_learned(family, messages) == EXPECTED_BASIC[family]  # the table above, spelled out
    check_learned_exactly(family, messages, EXPECTED_BASIC[family])


@pytest.mark.parametrize("family", sorted(EXPECT))
def test_quoted_headers_and_markers_do_not_move_the_mask(family):
    messages = spoofing_conversation(family)
    tok = tokenizer_for(family)
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    header = EXPECT[family]["header"]
    # the rendered text holds more assistant headers than there are assistant turns
    assert text.count(header) > sum(m["role"] == "assistant" for m in messages)
    check_learned_exactly(family, messages, expected_learned(family, messages))


@pytest.mark.parametrize("family", sorted(EXPECT))
def test_single_assistant_turn_ending_the_conversation(family):
    messages = [{"role": "user", "content": USER_1}, {"role": "assistant", "content": ASSISTANT_1}]
    check_learned_exactly(family, messages, expected_learned(family, messages))


@pytest.mark.parametrize("family", ["llama3", "qwen2.5", "gemma2", "phi3"])
def test_trl_conversational_prompt_completion_learns_only_the_completion(family):
    """TRL's conversational prompt/completion rows ({"prompt": [messages], "completion": [messages]}) were refused
    ("field 'prompt' must be a string, got list"); they are chat rows whose prompt's turns, an earlier
    assistant turn included, are context: only the completion's assistant turn is learned."""
    from trainforge.data.formats import detect_format

    messages = basic_conversation(family)
    row = Row({"prompt": messages[:-1], "completion": messages[-1:]}, WHERE)
    assert detect_format(row, FieldNames()) == "chat"
    tok = tokenizer_for(family)
    renderer = Renderer("chat", FieldNames(), tok)
    rendered = renderer(row)
    assert rendered.text == renderer(Row({"messages": messages}, WHERE)).text
    chunk = tokenize_rendered([rendered], tok, max_length=4096, too_long="truncate", special_tokens=False)
    learned = [decode(tok, chunk.ids[a:b]) for a, b in runs(chunk.learn)]
    assert learned == EXPECTED_BASIC[family][-1:]
    pair = renderer.pair(row)  # an encoder-decoder reads it as the messages row: the last reply is the target
    assert pair.target == messages[-1]["content"] and pair.source.endswith(EXPECT[family]["header"])


def test_phi3_trailing_eos_is_rendered_but_not_learned():
    """Phi-3's template ends a conversation with eos_token: the text of a conversation is not
    its prefix renders glued together, and that last EOS belongs to no turn."""
    messages = basic_conversation("phi3")
    tok, rendered, chunk = render_and_mask("phi3", messages)
    assert rendered.text.endswith("Rome \u2014 or Roma, in Italian.<|end|>\n<|endoftext|>")
    assert int(chunk.ids[-1]) == tok.eos_token_id and chunk.learn[-1] == 0 and chunk.learn[-2] == 1


@pytest.mark.parametrize("family", [f for f in sorted(EXPECT) if not FAMILIES[f]["supports_system"]])
def test_template_refusing_a_system_message_is_a_located_data_error(family):
    messages = [{"role": "system", "content": SYSTEM}, *basic_conversation(family)]
    with pytest.raises(DataError, match=WHERE):
        render_and_mask(family, messages)


def test_template_that_rewrites_contents_is_a_data_error_naming_the_row():
    upper = (
        "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] | upper }}<|im_end|>\n"
        "{% endfor %}"
    )
    tok = tokenizer_for("qwen2.5")
    messages = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "general kenobi"}]
    with pytest.raises(DataError) as err:
        Renderer("chat", FieldNames(), tok, chat_template=upper)(Row({"messages": messages}, WHERE))
    assert WHERE in str(err.value) and "data.chat_template" in str(err.value)


@pytest.mark.parametrize("family,ends_turn", [("phi3", "<|end|>"), ("gemma2", "<end_of_turn>"), ("llama3", None),
                                              ("qwen2.5", None), ("mistral", None), ("zephyr", None)])
def test_generate_chat_stops_at_the_templates_end_of_turn_token(family, ends_turn):
    """`generate --chat` ends a reply at the template's end-of-turn token where it is not the EOS (Phi-3's
    <|end|> beside <|endoftext|>, Gemma's <end_of_turn> beside <eos>); where the EOS closes turns, nothing is added."""
    from trainforge.data.chat import ChatLocator
    from trainforge.tools.generate import end_of_turn_ids

    tok = tokenizer_for(family)
    ids = end_of_turn_ids(ChatLocator(tok, tok.chat_template), tok)
    assert ids == ([tok.convert_tokens_to_ids(ends_turn)] if ends_turn else [])


def test_a_base_tokenizer_whose_eos_is_not_the_turn_end_still_stops_the_turn():
    """Qwen2.5 base: EOS <|endoftext|>, turns end with <|im_end|>; the generation_config's EOS list counts too."""
    from types import SimpleNamespace

    from trainforge.data.chat import ChatLocator
    from trainforge.model.generate import stop_token_ids
    from trainforge.tools.generate import end_of_turn_ids

    tok = build_tokenizer("qwen2.5")
    tok.add_special_tokens({"eos_token": "<|endoftext|>"})
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert end_of_turn_ids(ChatLocator(tok, tok.chat_template), tok) == [im_end]
    model = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=[im_end, 7]))
    assert stop_token_ids(model, tok, [im_end]) == [tok.eos_token_id, im_end, 7]


# ---------------------------------------------------------------- reasoning (Qwen3's <think> blocks)


def _think(reasoning: str, answer: str) -> str:
    return f"<think>\n{reasoning}\n</think>\n\n{answer}"


def test_qwen3_reasoning_inline_is_learned_with_its_think_block():
    """Reasoning datasets (OpenThoughts, s1K, ...) keep the trace in the content as <think>...</think>. Qwen3's
    template moves it into a think block of its own: every such row used to be refused ("the chat template changes
    message ..."). The whole block is what the model writes after its header, so all of it is learned."""
    messages = [{"role": "user", "content": USER_1}, {"role": "assistant", "content": _think("France's capital: Paris.", "Paris.")}]
    check_learned_exactly("qwen3", messages, [_think("France's capital: Paris.", "Paris.") + "<|im_end|>\n"])


def test_qwen3_reasoning_content_field_is_learned_like_inline_reasoning():
    """``reasoning_content`` (the DeepSeek API's and vLLM's field) was rendered but not learned: only the answer was."""
    inline = [{"role": "user", "content": USER_1}, {"role": "assistant", "content": _think("Known fact.", "Paris.")}]
    field = [{"role": "user", "content": USER_1}, {"role": "assistant", "content": "Paris.", "reasoning_content": "Known fact."}]
    _, a, chunk_a = render_and_mask("qwen3", inline)
    _, b, chunk_b = render_and_mask("qwen3", field)
    assert a.text == b.text and chunk_a.learn.tolist() == chunk_b.learn.tolist()
    check_learned_exactly("qwen3", field, [_think("Known fact.", "Paris.") + "<|im_end|>\n"])


def test_qwen3_earlier_turns_lose_their_reasoning_as_the_template_writes_them():
    """Before the last user message Qwen3 writes only the answer (as at inference, where history has no traces):
    that answer is learned; the last turn keeps and learns its reasoning."""
    messages = [
        {"role": "user", "content": USER_1},
        {"role": "assistant", "content": _think("Recall: Paris.", "Paris.")},
        {"role": "user", "content": USER_2},
        {"role": "assistant", "content": _think("Recall: Rome.", "Rome.")},
    ]
    check_learned_exactly("qwen3", messages, ["Paris.<|im_end|>\n", _think("Recall: Rome.", "Rome.") + "<|im_end|>\n"])


def test_qwen3_tool_call_turns_after_the_last_user_message_keep_their_reasoning():
    """An assistant turn that calls a tool after the last user message keeps its reasoning (Qwen3 writes it for
    every step of a multi-step tool exchange): learned are the trace, the content, the call the template writes
    from ``tool_calls`` and the end of the turn; the tool's answer is not."""
    call = {"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": _think("Look it up.", "Checking."), "tool_calls": [call]},
        {"role": "tool", "content": "sunny"},
        {"role": "assistant", "content": _think("It said sunny.", "It is sunny.")},
    ]
    tool_call = '\n<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    check_learned_exactly("qwen3", messages, [
        _think("Look it up.", "Checking.") + tool_call + "<|im_end|>\n",
        _think("It said sunny.", "It is sunny.") + "<|im_end|>\n",
    ])


def test_a_template_that_drops_reasoning_says_so():
    """DeepSeek-R1-Distill's template (llama.cpp's verbatim copy, models/templates/
    deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja) keeps only what follows </think> in every assistant turn: the
    trace cannot be learned with it, and the error says that instead of "the template changes message 1"."""
    tok = tokenizer_for("qwen2.5")
    template = (FIXTURES / "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja").read_text()
    renderer = Renderer("chat", FieldNames(), tok, chat_template=template)
    messages = [{"role": "user", "content": USER_1}, {"role": "assistant", "content": _think("Recall.", "Paris.")}]
    with pytest.raises(DataError, match=r"drops or moves reasoning.*reads the 'reasoning_content' field"):
        renderer(Row({"messages": messages}, WHERE))
    plain = [{"role": "user", "content": USER_1}, {"role": "assistant", "content": "Paris."}]
    assert renderer(Row({"messages": plain}, WHERE)).spans  # without reasoning the template is located as before


def test_templates_that_do_not_read_reasoning_keep_think_blocks_as_content():
    """ChatML (trainforge's default) writes the content as given: an inline trace stays in it and is learned."""
    tok = tokenizer_for("qwen2.5")
    messages = [{"role": "user", "content": USER_1}, {"role": "assistant", "content": _think("Recall.", "Paris.")}]
    rendered = Renderer("chat", FieldNames(), tok)(Row({"messages": messages}, WHERE))
    chunk = tokenize_rendered([rendered], tok, max_length=4096, too_long="truncate", special_tokens=False)
    assert [decode(tok, chunk.ids[a:b]) for a, b in runs(chunk.learn)] == [_think("Recall.", "Paris.") + "<|im_end|>\n"]


# ---------------------------------------------------------------- tool calls (OpenAI-style tool_calls)

WEATHER_CALL = {"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}


def tool_conversation(content: str | None) -> list[dict]:
    return [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": content, "tool_calls": [WEATHER_CALL]},
        {"role": "tool", "content": "sunny"},
        {"role": "assistant", "content": "It is sunny."},
    ]


@pytest.mark.parametrize("family,call,final", [
    ("qwen2.5", '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n', "It is sunny.<|im_end|>\n"),
    ("qwen3", '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n',
     EMPTY_THINK + "It is sunny.<|im_end|>\n"),
    ("llama3", '{"name": "weather", "parameters": {"city": "Paris"}}<|eot_id|>', "It is sunny.<|eot_id|>"),
    ("gpt-oss", ' to=functions.weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>', FINAL_CHANNEL + "It is sunny.<|return|>"),
], ids=["qwen2.5", "qwen3", "llama3", "gpt-oss"])
def test_a_turn_that_only_calls_a_tool_is_learned(family, call, final):
    """Agent traces in the OpenAI layout: an assistant turn with ``tool_calls`` and no content. Qwen's templates
    write no newline for an empty content, so the placeholder render did not match and every such row was refused;
    Llama 3's writes the call instead of the content, so the turn had no place in the text and was silently not
    learned (the model never learned to call). The call the template writes, and the end of the turn, are learned."""
    messages = tool_conversation(None)
    tok = tokenizer_for(family)
    renderer = Renderer("chat", FieldNames(), tok)
    rendered = renderer(Row({"messages": messages}, WHERE))
    expected_text = tok.apply_chat_template([{**m, "content": m["content"] or ""} for m in messages], tokenize=False)
    assert _undated(rendered.text) == _undated(expected_text)
    chunk = tokenize_rendered([rendered], tok, max_length=4096, too_long="truncate", special_tokens=False)
    assert [decode(tok, chunk.ids[a:b]) for a, b in runs(chunk.learn)] == [call, final]


def test_a_tool_call_turn_in_a_prompt_is_context_and_the_completion_is_learned():
    """TRL's conversational prompt/completion with a tool exchange in the prompt: the prompt's assistant turns are
    counted off the located turns, so a turn Llama 3's template writes without its content must still count."""
    messages = tool_conversation(None)
    tok = tokenizer_for("llama3")
    renderer = Renderer("chat", FieldNames(), tok)
    rendered = renderer(Row({"prompt": messages[:-1], "completion": messages[-1:]}, WHERE))
    chunk = tokenize_rendered([rendered], tok, max_length=4096, too_long="truncate", special_tokens=False)
    assert [decode(tok, chunk.ids[a:b]) for a, b in runs(chunk.learn)] == ["It is sunny.<|eot_id|>"]


def test_gpt_oss_thinking_is_learned_as_its_analysis_channel():
    """gpt-oss reads a trace from ``thinking`` and writes it, for the last turn, as an analysis message before the
    final one; the model writes both, so both are learned. An inline <think> trace is moved to ``thinking``."""
    analysis = "<|channel|>analysis<|message|>Known fact.<|end|><|start|>assistant" + FINAL_CHANNEL + "Paris.<|return|>"
    field = [{"role": "user", "content": USER_1}, {"role": "assistant", "content": "Paris.", "thinking": "Known fact."}]
    check_learned_exactly("gpt-oss", field, [analysis])
    inline = [{"role": "user", "content": USER_1}, {"role": "assistant", "content": _think("Known fact.", "Paris.")}]
    _, rendered, chunk = render_and_mask("gpt-oss", inline)
    _, expected, expected_chunk = render_and_mask("gpt-oss", field)
    assert rendered.text == expected.text and chunk.learn.tolist() == expected_chunk.learn.tolist()
