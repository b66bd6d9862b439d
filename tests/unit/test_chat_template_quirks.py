"""Chat templates with quirks the assistant-only loss mask must survive, with their real texts.

Each template here is a verbatim fixture in ``tests/fixtures/chat_templates`` (``families.json`` says where
it came from); the tokenizers and helpers are those of ``test_chat_templates``. A quirk either locates
exactly (what the model writes after the turn's header, and nothing of the next turn), or, where the
template gives no correct answer, the row is refused with a message naming what the template does.
"""

from __future__ import annotations

import pytest
from test_chat_templates import WEATHER_CALL, WHERE, decode, runs, tokenizer_for, tool_conversation

from trainforge.config import FieldNames
from trainforge.data.formats import Renderer, tokenize_rendered
from trainforge.data.sources import DataError, Row


def learned(family: str, messages: list[dict]) -> tuple[str, list[str]]:
    """The rendered text and the learned runs of a chat row, through the project's own code path."""
    tok = tokenizer_for(family)
    rendered = Renderer("chat", FieldNames(), tok)(Row({"messages": messages}, WHERE))
    chunk = tokenize_rendered([rendered], tok, max_length=8192, too_long="truncate", special_tokens=False)
    return rendered.text, [decode(tok, chunk.ids[a:b]) for a, b in runs(chunk.learn)]


# ---------------------------------------------------------------- Command R7B: the next header is always written

R7B_CALL = (
    '<|START_THINKING|><|END_THINKING|><|START_ACTION|>[\n    {"tool_call_id": "0", "tool_name": "weather", '
    '"parameters": {"city": "Paris"}}\n]<|END_ACTION|><|END_OF_TURN_TOKEN|>'
)


@pytest.mark.parametrize("content", [None, ""], ids=["null", "empty"])
def test_command_r7b_turns_end_with_their_own_end_of_turn_not_the_next_header(content):
    """Command R7B's template writes the assistant header <|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|> after the last
    message whether or not a generation prompt is asked for, so every turn is followed by a header that starts with
    <|START_OF_TURN_TOKEN|>, and that token was learned after each assistant turn (the end of a turn was what the
    two continuations compared share). A turn now ends with its own <|END_OF_TURN_TOKEN|>: the token that starts
    every turn of the template is never part of one. Tool-call turns (which the template writes from
    ``tool_calls``, with the plan from ``tool_plan``) end the same way."""
    text, runs_ = learned("command-r7b", tool_conversation(content))
    assert text.endswith("<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>")
    assert runs_ == [R7B_CALL, "<|START_RESPONSE|>It is sunny.<|END_RESPONSE|><|END_OF_TURN_TOKEN|>"]
    assert all("<|START_OF_TURN_TOKEN|>" not in r for r in runs_)


def test_command_r7b_a_row_ending_with_a_tool_call_learns_the_call_and_its_end():
    messages = [{"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": None, "tool_calls": [WEATHER_CALL]}]
    assert learned("command-r7b", messages)[1] == [R7B_CALL]


# ---------------------------------------------------------------- Granite 3.3: tool_calls are not written at all

LAST_CALL = [{"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": None, "tool_calls": [WEATHER_CALL]}]


@pytest.mark.parametrize("messages", [tool_conversation(None), tool_conversation("Checking."), LAST_CALL],
                         ids=["call-only", "content-and-call", "call-ending-the-row"])
def test_granite_writes_no_tool_calls_so_such_a_turn_is_refused(messages):
    """Granite 3.3's template writes '<|start_of_role|>ROLE<|end_of_role|>CONTENT<|end_of_text|>' for every message
    and never reads ``tool_calls``: a turn that only calls a tool was learned as an empty reply (just
    <|end_of_text|>, teaching the model to answer a request for a tool with nothing), and one with content learned
    the content without its call. The row is refused, naming the message, what the template does and the way out."""
    tok = tokenizer_for("granite3.3")
    text = tok.apply_chat_template([{**m, "content": m["content"] or ""} for m in messages], tokenize=False)
    assert "Paris\"" not in text and "weather" not in text  # the call is nowhere in the text
    with pytest.raises(DataError) as err:
        learned("granite3.3", messages)
    message = str(err.value)
    assert WHERE in message and "message 1 (assistant)" in message and "does not write them" in message
    assert "data.chat_template" in message and "content" in message


def test_granite_tool_call_written_in_the_content_is_learned():
    """The way out the refusal names: the call in the model's own format, in the content, is learned as any reply."""
    call = '<|tool_call|>[{"name": "weather", "arguments": {"city": "Paris"}}]'
    messages = [{"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": call}]
    assert learned("granite3.3", messages)[1] == [call + "<|end_of_text|>\n"]


def test_the_default_template_writes_no_tool_calls_either():
    """trainforge's ChatML default (a tokenizer without a template) writes only contents: refused the same way."""
    from trainforge.data.formats import DEFAULT_CHAT_TEMPLATE

    renderer = Renderer("chat", FieldNames(), tokenizer_for("qwen2.5"), chat_template=DEFAULT_CHAT_TEMPLATE)
    with pytest.raises(DataError, match=r"message 1 \(assistant\) has tool_calls, but the chat template does not write them"):
        renderer(Row({"messages": LAST_CALL}, WHERE))
