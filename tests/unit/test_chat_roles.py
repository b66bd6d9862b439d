"""Roles, messages a template leaves out, and OpenAI's per-message ``weight``, under real templates.

Tokenizers and helpers are those of ``test_chat_templates`` and ``test_chat_tools`` (Mistral v0.3's template is in
``tool_families.json``).
"""

from __future__ import annotations

import pytest
from test_chat_templates import WHERE, tool_conversation
from test_chat_tools import learned, tokenizer

from trainforge.config.data import FieldNames
from trainforge.data.formats import DEFAULT_CHAT_TEMPLATE, Renderer
from trainforge.data.sources import DataError, Row


def chat(*turns: tuple[str, str], **extra) -> list[dict]:
    return [{"role": role, "content": content, **extra} for role, content in turns]


# ---------------------------------------------------------------- roles


def test_oasst_prompter_is_the_user():
    """OASST's ``prompter`` was passed on as a role: Qwen2.5's template writes no such turn, so the user's question
    vanished from the text and the reply was learned without it."""
    text, runs_ = learned("qwen2.5", {"messages": chat(("prompter", "Who are you?"), ("assistant", "An assistant."))})
    assert "<|im_start|>user\nWho are you?<|im_end|>\n" in text
    assert runs_ == ["An assistant.<|im_end|>\n"]


@pytest.mark.parametrize("template", [None, DEFAULT_CHAT_TEMPLATE], ids=["qwen2.5", "default"])
def test_a_role_neither_known_nor_the_templates_is_refused_naming_it(template):
    """A role like ``bot`` was dropped by Qwen2.5's template (the row then had "nothing to learn", counted without a
    line) or written as ``<|im_start|>bot`` by ChatML (never learned). It is refused, naming the row, the role and
    what is read."""
    tok = tokenizer("qwen2.5")
    row = Row({"messages": chat(("user", "Hi"), ("bot", "Hello!"))}, WHERE)
    with pytest.raises(DataError, match=rf"{WHERE}: message 1 has role 'bot'.*user, assistant, system.*prompter"):
        Renderer("chat", FieldNames(), tok, chat_template=template)(row)


def test_a_role_the_template_names_is_accepted():
    """gpt-oss's template has a ``developer`` role of its own: rendered, not refused."""
    text, runs_ = learned("gpt-oss", {"messages": chat(("developer", "Answer in French."), ("user", "Hi"), ("assistant", "Salut !"))})
    assert "Answer in French." in text and runs_ == ["<|channel|>final<|message|>Salut !<|return|>"]


# ---------------------------------------------------------------- messages the template leaves out


def test_mistral_v3_drops_the_system_message_of_training_rows_and_the_row_is_refused():
    """Mistral v0.3 writes the system message only into the conversation's last message when it is a user's, so
    never in a row that ends with the assistant's reply: the row trained as if it had none. Refused, saying where
    to put the text; a row without a system message trains."""
    messages = chat(("system", "Be terse."), ("user", "Hi"), ("assistant", "Hello!"))
    with pytest.raises(DataError, match=rf"{WHERE}: message 0 \(system\) has a content that the chat template leaves out.*first user message"):
        learned("mistral-v3", {"messages": messages})
    with pytest.raises(DataError, match="message 0 \\(system\\)"):  # learning every token loses it as well
        Renderer("chat", FieldNames(), tokenizer("mistral-v3"), train_on_prompt=True)(Row({"messages": messages}, WHERE))
    assert learned("mistral-v3", {"messages": messages[1:]})[1] == ["Hello!</s>"]


def test_a_content_llama3_does_not_write_beside_a_call_is_refused():
    """Llama 3 writes only the call of a turn with ``tool_calls``: its content was silently not learned."""
    with pytest.raises(DataError, match=r"message 1 \(assistant\) has a content .*leave the turn's content empty"):
        learned("llama3", {"messages": tool_conversation("Let me check.")})


# ---------------------------------------------------------------- OpenAI's per-message weight


def weighted(first, second=None) -> list[dict]:
    turns = chat(("system", "Be terse."), ("user", "Capital of France?"), ("assistant", "Paris, obviously."),
                 ("user", "Nicely?"), ("assistant", "Paris."))
    for m, w in ((turns[2], first), (turns[4], second)):
        if w is not None:
            m["weight"] = w
    return turns


@pytest.mark.parametrize("family,second", [("qwen2.5", "Paris.<|im_end|>\n"), ("llama3", "Paris.<|eot_id|>")])
def test_weight_zero_turns_are_context_and_the_weight_is_not_rendered(family, second):
    """OpenAI's fine-tuning layout (and Axolotl) read ``"weight": 0`` on an assistant message as: not learned. It was
    ignored, and passed to the template with the message. A turn of weight 0 is context; 1 is learned, as without."""
    plain_text, _ = learned(family, {"messages": weighted(None)})
    text, runs_ = learned(family, {"messages": weighted(0, 1)})
    assert runs_ == [second]
    assert text.replace("26 Jul 2024", "") == plain_text.replace("26 Jul 2024", "")
    assert learned(family, {"messages": weighted(1, 1)})[1] == learned(family, {"messages": weighted(None)})[1]


@pytest.mark.parametrize("weight", [0.5, 2, True, "0"])
def test_other_weights_are_refused(weight):
    with pytest.raises(DataError, match=rf"{WHERE}: messages\[2\]\.weight is .*must be 0 .* or 1"):
        learned("qwen2.5", {"messages": weighted(weight)})


def test_a_seq2seq_target_is_the_last_learned_turn():
    pair = Renderer("chat", FieldNames(), tokenizer("qwen2.5")).pair(Row({"messages": weighted(1, 0)}, WHERE))
    assert pair.target == "Paris, obviously." and pair.source.endswith("<|im_start|>assistant\n")


# ---------------------------------------------------------------- the error for templates that write no calls


def test_the_no_tool_calls_error_no_longer_says_the_default_writes_only_contents():
    with pytest.raises(DataError) as e:
        learned("granite3.3", {"messages": tool_conversation(None)})
    assert "does not write them" in str(e.value) and "default" not in str(e.value)


def test_a_row_learned_whole_is_refused_where_the_template_writes_no_call():
    """With data.train_on_prompt the locate step (which refuses such rows) is skipped: Granite 3.3's template wrote the
    assistant turn without its call and the row trained an empty turn where the call was."""
    row = Row({"messages": tool_conversation(None)}, WHERE)
    with pytest.raises(DataError, match="does not write them"):
        Renderer("chat", FieldNames(), tokenizer("granite3.3"), train_on_prompt=True)(row)
    Renderer("chat", FieldNames(), tokenizer("qwen2.5"), train_on_prompt=True)(row)  # Qwen writes calls: learned whole
