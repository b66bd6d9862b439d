"""Chat templates with quirks the assistant-only loss mask must survive, with their real texts.

Each template here is a verbatim fixture in ``tests/fixtures/chat_templates`` (``families.json`` says where
it came from); the tokenizers and helpers are those of ``test_chat_templates``. A quirk either locates
exactly (what the model writes after the turn's header, and nothing of the next turn), or, where the
template gives no correct answer, the row is refused with a message naming what the template does.
"""

from __future__ import annotations

import pytest
from test_chat_templates import WEATHER_CALL, WHERE, decode, runs, tokenizer_for, tool_conversation

from trainforge.config.data import FieldNames
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


@pytest.mark.parametrize("family", ["mistral", "mixtral", "gemma2", "phi3", "zephyr"])
def test_other_templates_that_write_no_tool_calls_are_refused_the_same_way(family):
    """The fixtures' older templates write only contents: a tool-call row learned an empty reply under them; it
    is refused the same way."""
    tok = tokenizer_for(family)
    with pytest.raises(DataError, match=r"message 1 \(assistant\) has tool_calls, but the chat template does not write them"):
        Renderer("chat", FieldNames(), tok)(Row({"messages": LAST_CALL}, WHERE))


# ---------------------------------------------------------------- trainforge's ChatML default writes tool calls

OLD_DEFAULT = (  # the default before it wrote tool calls: rows without calls must render byte for byte as under it
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def default_learned(messages: list[dict], template: str | None = None) -> tuple[str, list[str]]:
    from trainforge.data.formats import DEFAULT_CHAT_TEMPLATE

    tok = tokenizer_for("qwen2.5")
    rendered = Renderer("chat", FieldNames(), tok, chat_template=template or DEFAULT_CHAT_TEMPLATE)(Row({"messages": messages}, WHERE))
    chunk = tokenize_rendered([rendered], tok, max_length=8192, too_long="truncate", special_tokens=False)
    return rendered.text, [decode(tok, chunk.ids[a:b]) for a, b in runs(chunk.learn)]


def test_the_default_template_writes_tool_calls_hermes_style_and_learns_them():
    """A tokenizer without a template trains on trainforge's ChatML default, which wrote only contents: a tool-call
    row was refused (before that, learned an empty reply). It writes each call as Hermes and Qwen2.5 do,
    '<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>', after the content; both call layouts (OpenAI's,
    with the arguments as a JSON string, and HF's, a dict) write the same text, and the call turn is learned whole."""
    call = '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    text, runs_ = default_learned(tool_conversation(None))
    assert "<|im_start|>assistant\n" + call + "<|im_end|>\n<|im_start|>tool\n" in text
    assert runs_ == [call + "<|im_end|>\n", "It is sunny.<|im_end|>\n"]
    hf_layout = [LAST_CALL[0], {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}]}]
    assert default_learned(hf_layout)[1] == [call + "<|im_end|>\n"]
    with_content = default_learned(tool_conversation("Checking."))[1]
    assert with_content[0] == "Checking.\n" + call + "<|im_end|>\n"


def test_the_default_template_renders_rows_without_calls_as_before():
    """Writing calls changed nothing else: existing chat data renders, and is learned, exactly as before."""
    rows = [
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
         {"role": "user", "content": "And 3+3?"}, {"role": "assistant", "content": "6"}],
    ]
    for messages in rows:
        assert default_learned(messages) == default_learned(messages, OLD_DEFAULT)


# ---------------------------------------------------------------- Nemotron Nano v2: a last message is written apart

NEMOTRON_CALL = '<TOOLCALL>[{"name": "weather", "arguments": {"city": "Paris"}}]</TOOLCALL>'
NEMOTRON_FINAL = "It is sunny.\n<SPECIAL_12>\n"


@pytest.mark.parametrize("content,call_turn", [
    (None, NEMOTRON_CALL + "\n<SPECIAL_12>\n"),
    ("Checking.", "Checking.\n" + NEMOTRON_CALL + "\n<SPECIAL_12>\n"),
], ids=["call-only", "content-and-call"])
def test_nemotron_a_tool_call_before_the_last_message_learns_the_call_and_the_end_of_turn(content, call_turn):
    """Nemotron writes an assistant turn that is not the last as 'CONTENT\\n<TOOLCALL>[...]</TOOLCALL>\\n<SPECIAL_12>\\n',
    but the same message ending the conversation after the loop, in another form ('<think>\\n' before the content,
    the calls as a turn of their own). The end of a turn was found by comparing with the conversation ended right
    after it, which here writes the turn differently: a call-only turn learned nothing and one with content learned
    'Checking.\\n' alone, the call and <SPECIAL_12> not. A turn the ended conversation writes differently is now
    compared with the one continued by a user turn instead (up to the token that starts that turn)."""
    text, runs_ = learned("nemotron-nano-v2", tool_conversation(content))
    assert call_turn in text
    assert runs_ == [call_turn, NEMOTRON_FINAL]


def test_nemotron_a_tool_call_ending_the_row_learns_the_call_written_as_the_last_turn():
    """A row ending with a call (user -> call, the usual function-calling row) is written
    '<SPECIAL_11>Assistant\\n<TOOLCALL>[...]</TOOLCALL><SPECIAL_12>\\n\\n': not after the generation prompt
    '<SPECIAL_11>Assistant\\n<think>\\n', so it was refused as a template that changes the message. The turn starts
    after the header the template writes before any assistant content and runs to the end of the text (the two
    newlines the template writes after <SPECIAL_12>, the EOS, come with it, as the newline after every other turn's)."""
    text, runs_ = learned("nemotron-nano-v2", LAST_CALL)
    assert text.endswith("<SPECIAL_11>User\nWeather in Paris?\n<SPECIAL_11>Assistant\n" + NEMOTRON_CALL + "<SPECIAL_12>\n\n")
    assert runs_ == [NEMOTRON_CALL + "<SPECIAL_12>\n\n"]


def test_nemotron_content_and_call_ending_the_row_are_two_turns_and_refused():
    """The last message with a content and calls is written as two assistant turns: the content closed by <SPECIAL_12>,
    then the calls under a header of their own. Learning that teaches the model to stop before calling (it writes one
    turn per reply), and the second header is not the model's to write: no span is right, so the row is refused with
    the way to write it (the call before the tool's result is one turn)."""
    tok = tokenizer_for("nemotron-nano-v2")
    messages = [LAST_CALL[0], {**LAST_CALL[1], "content": "Checking."}]
    text = tok.apply_chat_template(messages, tokenize=False)
    assert text.endswith("Checking.\n<SPECIAL_12>\n<SPECIAL_11>Assistant\n" + NEMOTRON_CALL + "<SPECIAL_12>\n\n")
    with pytest.raises(DataError) as err:
        learned("nemotron-nano-v2", messages)
    message = str(err.value)
    assert WHERE in message and "message 1 (assistant)" in message and "tool_calls" in message
    assert "tool's result" in message and "data.chat_template" in message


# ---------------------------------------------------------------- gpt-oss: a call ending the row is one reply

GPT_OSS_CALL = ' to=functions.weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>'


def test_gpt_oss_a_tool_call_ending_the_row_is_learned():
    """Refused before ("the chat template changes message 1"): compared with the conversation continued by a user turn,
    gpt-oss writes the call the same way; its turn ends with <|call|>, the token the model stops on to call."""
    assert learned("gpt-oss", LAST_CALL)[1] == [GPT_OSS_CALL]


def test_gpt_oss_analysis_then_call_ending_the_row_is_learned_whole():
    """gpt-oss writes a last message's content and call as an analysis message, then the call under a header of its
    own, '<|end|><|start|>assistant to=...'. Unlike Nemotron's two turns, that is one reply: the model writes it in
    one go and stops only at <|call|> (its EOS is <|return|>, not <|end|>). Only the analysis message was learned,
    never the call; now all of it is, the way the thinking test learns analysis and final message together."""
    messages = [LAST_CALL[0], {**LAST_CALL[1], "content": "Checking."}]
    assert learned("gpt-oss", messages)[1] == ["<|channel|>analysis<|message|>Checking.<|end|><|start|>assistant" + GPT_OSS_CALL]


# ---------------------------------------------------------------- templates that write today's date

@pytest.mark.parametrize("family,written", [("llama3", "Today Date: 26 Jul 2024\n"), ("gpt-oss", "Current date: 2024-07-26\n")])
def test_templates_that_write_todays_date_write_a_fixed_one(family, written):
    """Llama 3.1+ and gpt-oss write the day's date (transformers' strftime_now) into every row's system text: tokens
    made on another day (a cache rebuilt on another node, a resume) differed from the checkpoint's. The rows are
    written at one fixed date, Llama 3.1's own fallback; the template a run saves in final/ is the model's, unchanged."""
    from datetime import datetime

    text, runs_ = learned(family, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}])
    assert written in text and datetime.now().strftime("%Y-%m-%d") not in text
    assert runs_ and "Hello!" in runs_[-1]
    assert "macro strftime_now" not in tokenizer_for(family).chat_template


def test_a_system_turn_gemma_refuses_says_what_to_do():
    """Gemma 2's template raises 'System role not supported': the refusal says where to put the system text."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    with pytest.raises(DataError) as err:
        learned("gemma2", messages)
    message = str(err.value)
    assert WHERE in message and "System role not supported" in message
    assert "first user message" in message and "data.chat_template" in message
