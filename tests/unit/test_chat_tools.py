"""Tool use in chat rows under real templates: tool definitions, call arguments, tool results, ShareGPT calls.

The templates of ``tool_families.json`` (Llama 3.1, Hermes 3's tool_use, Mistral v0.3) are verbatim fixtures in
``tests/fixtures/chat_templates``, beside those of ``families.json`` (Llama 3.2, Qwen2.5) that
``test_chat_templates`` checks; the tokenizers are built the same way (``tokenizer_from``), so every learned run
decodes to exactly the text the mask covers.
"""

from __future__ import annotations

import hashlib
import json

import pytest
from test_chat_templates import FIXTURES, WHERE, decode, runs, tokenizer_for, tokenizer_from

from trainforge.config.data import FieldNames
from trainforge.data.formats import Renderer, tokenize_rendered
from trainforge.data.sources import DataError, Row

TOOL_FAMILIES: dict[str, dict] = json.loads((FIXTURES / "tool_families.json").read_text())
_TOKENIZERS: dict[str, object] = {}

WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Get the weather",
                                                 "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
# a tool result with what JSON escapes: quotes, a newline, a backslash
RESULT = '{"temp": 21, "note": "dry\nwind C:\\\\x"}'


def tokenizer(family: str):
    """The tokenizer of a family of ``tool_families.json``, or of ``families.json`` (``tokenizer_for``)."""
    if family not in TOOL_FAMILIES:
        return tokenizer_for(family)
    if family not in _TOKENIZERS:
        text = (FIXTURES / TOOL_FAMILIES[family]["file"]).read_text()
        corpus = [text, json.dumps(WEATHER_TOOL), RESULT, "Weather in Paris? It is 21 degrees."] * 3
        _TOKENIZERS[family] = tokenizer_from(TOOL_FAMILIES[family], corpus)
    return _TOKENIZERS[family]


def learned(family: str, row: dict) -> tuple[str, list[str]]:
    """The rendered text and the learned runs of a chat row, through the project's own code path."""
    tok = tokenizer(family)
    rendered = Renderer("chat", FieldNames(), tok)(Row(row, WHERE))
    chunk = tokenize_rendered([rendered], tok, max_length=8192, too_long="truncate", special_tokens=False)
    return rendered.text, [decode(tok, chunk.ids[a:b]) for a, b in runs(chunk.learn)]


def call(arguments, call_id: str = "call00001") -> dict:
    return {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": arguments}}


def exchange(arguments, result: str = RESULT, call_id: str = "call00001") -> list[dict]:
    return [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call(arguments, call_id)]},
        {"role": "tool", "tool_call_id": call_id, "content": result},
        {"role": "assistant", "content": "It is 21 degrees."},
    ]


def test_tool_fixtures_are_the_recorded_texts():
    for spec in TOOL_FAMILIES.values():
        data = (FIXTURES / spec["file"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == spec["sha256"], f"{spec['file']} changed (editor newline or reformatting?)"


# ---------------------------------------------------------------- 1. tool results written as JSON (Llama 3.1+)


@pytest.mark.parametrize("family", ["llama3.1", "llama3"])
@pytest.mark.parametrize("result", [RESULT, "sunny", 'say "hi"\\n'], ids=["json", "plain", "quoted"])
def test_llama_tool_results_written_as_json_strings_are_located(family, result):
    """Llama 3.1's and 3.2's templates write a tool result as ``content | tojson``: quotes, newlines and backslashes
    escaped, the whole in quotes. The walk compared the text with the content as given, so every row whose result
    had one of these was refused ("the chat template changes message 2 (tool)"); only a plain word passed. The
    escaped form is a form a content may be written in: the row trains, and the result is not learned."""
    text, runs_ = learned(family, {"messages": exchange({"city": "Paris"}, result)})
    assert "<|start_header_id|>ipython<|end_header_id|>\n\n" + json.dumps(result) + "<|eot_id|>" in text
    assert runs_ == ['{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>', "It is 21 degrees.<|eot_id|>"]


# ---------------------------------------------------------------- 2. the row's tools reach the template


def test_qwen_writes_the_rows_tools_and_does_not_learn_them():
    """A row's ``tools`` were never passed to the template: the model learned to call functions it was never shown.
    Qwen2.5 writes them in its system turn, as context."""
    text, runs_ = learned("qwen2.5", {"messages": exchange({"city": "Paris"}), "tools": [WEATHER_TOOL]})
    assert "<tools>\n" + json.dumps(WEATHER_TOOL) + "\n</tools>" in text
    assert runs_ == ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n',
                     "It is 21 degrees.<|im_end|>\n"]


def test_llama31_writes_the_tools_into_the_first_user_message():
    text, runs_ = learned("llama3.1", {"messages": exchange({"city": "Paris"}), "tools": [WEATHER_TOOL]})
    assert "Environment: ipython\n" in text and json.dumps(WEATHER_TOOL, indent=4) + "\n\nWeather in Paris?<|eot_id|>" in text
    assert runs_ == ['{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>', "It is 21 degrees.<|eot_id|>"]


def test_hermes3_tool_use_renders_with_the_rows_tools():
    """Hermes 3's tool_use template iterates the tools: without them every row failed ("'NoneType' object is not
    iterable"); a row without tools is still refused, with a hint at the field."""
    text, runs_ = learned("hermes3", {"messages": exchange({"city": "Paris"}), "tools": [WEATHER_TOOL]})
    assert "<tools> " in text and '"name": "get_weather"' in text
    assert runs_ == ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n',
                     "It is 21 degrees.<|im_end|>\n"]
    with pytest.raises(DataError, match="'tools' field"):
        learned("hermes3", {"messages": exchange({"city": "Paris"})})


def test_llama_factory_tools_string_of_bare_functions_is_read():
    """LLaMA-Factory's ShareGPT layout stores the tools as a JSON string of bare functions: parsed, and wrapped as
    ``{"type": "function", "function": ...}`` as templates read them."""
    row = {"messages": exchange({"city": "Paris"}), "tools": json.dumps([WEATHER_TOOL["function"]])}
    assert learned("qwen2.5", row) == learned("qwen2.5", {**row, "tools": [WEATHER_TOOL]})


@pytest.mark.parametrize("tools,error", [("[{not json", "not JSON"), (42, "must be a list"), ([{"type": "function"}], "no function name")])
def test_malformed_tools_are_refused_naming_the_row(tools, error):
    with pytest.raises(DataError, match=f"{WHERE}: .*{error}"):
        learned("qwen2.5", {"messages": exchange({"city": "Paris"}), "tools": tools})


def test_mistral_v3_tool_rows_with_tools_and_later_turns_are_located():
    """Mistral v0.3 writes [AVAILABLE_TOOLS] before the last user message, so a prefix of the conversation has them
    elsewhere than the whole: a call before a later user turn was refused ("changes message 1 (assistant)"). The
    turn's start is found where the prefix and the whole write the same from the user's content on."""
    messages = [*exchange({"city": "Paris"}, '{"temp": 21}', "abc123def"),
                {"role": "user", "content": "Thanks!"}, {"role": "assistant", "content": "You are welcome."}]
    text, runs_ = learned("mistral-v3", {"messages": messages, "tools": [WEATHER_TOOL]})
    assert "[AVAILABLE_TOOLS]" in text and text.index("[AVAILABLE_TOOLS]") > text.index("[TOOL_RESULTS]")
    assert runs_ == ['[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "abc123def"}]</s>',
                     "It is 21 degrees.</s>", "You are welcome.</s>"]


# ---------------------------------------------------------------- 3. OpenAI's string arguments


@pytest.mark.parametrize("family,written", [
    ("qwen2.5", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'),
    ("llama3.1", '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>'),
])
def test_openai_string_arguments_are_written_as_a_json_object(family, written):
    """OpenAI's layout stores a call's arguments as a JSON string; templates ``tojson`` them, so the model learned a
    string holding JSON ("{\\"city\\": ...}"). They are parsed into the object templates expect."""
    assert learned(family, {"messages": exchange('{"city": "Paris"}')})[1][0] == written
    assert learned(family, {"messages": exchange("")})[1][0] == written.replace('{"city": "Paris"}', "{}")


@pytest.mark.parametrize("arguments", ['{"city": "Par', '["Paris"]'])
def test_arguments_that_are_no_json_object_are_refused(arguments):
    with pytest.raises(DataError, match=rf"{WHERE}: messages\[1\]\.tool_calls\[0\]: the call's arguments are .*JSON object"):
        learned("qwen2.5", {"messages": exchange(arguments)})


# ---------------------------------------------------------------- 4. ShareGPT function_call turns


def sharegpt(value: str) -> dict:
    return {"conversations": [{"from": "human", "value": "Weather in Paris?"}, {"from": "function_call", "value": value},
                              {"from": "observation", "value": '{"temp": 21}'}, {"from": "gpt", "value": "It is 21 degrees."}],
            "tools": json.dumps([WEATHER_TOOL["function"]])}


@pytest.mark.parametrize("value", ['{"name": "get_weather", "arguments": {"city": "Paris"}}',
                                   '[{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}]'], ids=["object", "list"])
def test_sharegpt_function_call_is_a_tool_call_in_the_models_format(value):
    """LLaMA-Factory's ``function_call`` turn was learned as bare assistant JSON; it is the model's tool call, written
    by the template in the model's own format (Qwen's <tool_call>)."""
    text, runs_ = learned("qwen2.5", sharegpt(value))
    assert runs_ == ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n',
                     "It is 21 degrees.<|im_end|>\n"]
    assert "<tool_response>\n" in text


def test_sharegpt_function_call_that_is_not_json_stays_text():
    assert learned("qwen2.5", sharegpt("get_weather(city='Paris')"))[1][0] == "get_weather(city='Paris')<|im_end|>\n"


def test_preference_pairs_render_the_rows_tools():
    """A pair of tool-calling replies (TRL's conversational layout with a ``tools`` column): each side is rendered
    with the definitions, as SFT renders a row; only the judged reply is learned."""
    from trainforge.data.preference import PreferenceRenderer

    tok = tokenizer("qwen2.5")
    prompt = [{"role": "user", "content": "Weather in Paris?"}]
    row = Row({"prompt": prompt, "tools": json.dumps([WEATHER_TOOL]),
               "chosen": [{"role": "assistant", "content": None, "tool_calls": [call('{"city": "Paris"}')]}],
               "rejected": [{"role": "assistant", "content": "I cannot know."}]}, WHERE)
    chosen, rejected = PreferenceRenderer(Renderer("preference", FieldNames(), tok)).pair(row)
    for side in (chosen, rejected):
        assert "<tools>\n" + json.dumps(WEATHER_TOOL) + "\n</tools>" in side.text
    chunk = tokenize_rendered([chosen], tok, max_length=8192, too_long="truncate", special_tokens=False)
    assert [decode(tok, chunk.ids[a:b]) for a, b in runs(chunk.learn)] == [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n']


@pytest.mark.parametrize("system", [True, False], ids=["with-system", "without"])
def test_the_default_template_writes_the_rows_tools_in_the_system_turn(system):
    """A tokenizer without a template renders with trainforge's default: a row's tools go into its system turn (after
    the system content, or in a system turn of their own), one JSON object per line, never learned; a row without
    tools renders as before."""
    from trainforge.model.tokenizer import build_char_tokenizer

    msgs = ([{"role": "system", "content": "Be brief."}] if system else []) + exchange('{"city": "Paris"}')
    tok = build_char_tokenizer([json.dumps([msgs, WEATHER_TOOL]) + "<|im_start|>system user assistant tool\n</>"])
    render = Renderer("chat", FieldNames(), tok)
    with_tools = render(Row({"messages": msgs, "tools": [WEATHER_TOOL]}, WHERE))
    head = "<|im_start|>system\n" + ("Be brief.\n\n" if system else "") + "<tools>\n" + json.dumps(WEATHER_TOOL) + "\n</tools><|im_end|>\n"
    assert with_tools.text.startswith(head + "<|im_start|>user\nWeather in Paris?<|im_end|>\n")
    assert [with_tools.text[a:b] for a, b in with_tools.spans] == [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n', "It is 21 degrees.<|im_end|>\n"]
    plain = render(Row({"messages": msgs}, WHERE))
    assert "<tools>" not in plain.text and plain.text.endswith(with_tools.text[len(head):])
