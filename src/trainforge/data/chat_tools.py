"""Tool definitions and tool calls of chat rows, in the layout Hugging Face chat templates read.

A row's ``tools`` (OpenAI's list of ``{"type": "function", "function": {...}}``, or LLaMA-Factory's JSON string
of a list of bare functions) are the definitions the template writes (Qwen2.5's ``<tools>``, Llama 3.1's function
list); a call's ``arguments`` are a JSON object (OpenAI's layout stores a string holding one, which templates
would encode a second time); ShareGPT's ``function_call`` turns (LLaMA-Factory) are assistant turns that call
tools. ``chat_messages`` and ``chat.ChatLocator`` use these.
"""

from __future__ import annotations

import json
from typing import Any

from .sources import DataError, Row

TOOLS_FIELD = "tools"


def row_tools(row: Row) -> list[dict[str, Any]] | None:
    """The row's tool definitions for the chat template (``tools=``); None when it has none.

    A JSON string is parsed (LLaMA-Factory stores the list so); a bare function ``{"name", ...}`` is wrapped as
    ``{"type": "function", "function": ...}``, the layout templates read (Mistral's writes ``tool.function``)."""
    raw = row.data.get(TOOLS_FIELD) if isinstance(row.data, dict) else None
    if isinstance(raw, str):
        if not raw.strip():
            return None
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as e:
            raise DataError(f"{row.where}: field {TOOLS_FIELD!r} is a string but not JSON ({e}); write it as a list of "
                            '{"type": "function", "function": {"name", "description", "parameters"}} objects') from None
    if raw is None or raw == []:
        return None
    if isinstance(raw, dict):
        raw = [raw]
    if not isinstance(raw, list) or not all(isinstance(t, dict) for t in raw):
        raise DataError(f"{row.where}: field {TOOLS_FIELD!r} must be a list of tool objects "
                        f'({{"type": "function", "function": {{"name", "description", "parameters"}}}}), got {_kind(raw)}')
    tools = []
    for k, tool in enumerate(raw):
        if "function" not in tool and "name" in tool:
            tool = {"type": "function", "function": tool}
        function = tool.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise DataError(f"{row.where}: {TOOLS_FIELD}[{k}] has no function name: expected "
                            '{"type": "function", "function": {"name": ..., "parameters": {...}}}')
        tools.append(tool)
    return tools


def parsed_calls(calls: Any, where: str) -> Any:
    """``tool_calls`` with each call's ``arguments`` a JSON object: a string holding one (OpenAI's layout) is
    parsed, an empty string is ``{}``; a string that holds no JSON object is a DataError. Copies what it changes."""
    if not isinstance(calls, list):
        return calls
    out = []
    for k, call in enumerate(calls):
        if isinstance(call, dict):
            inner = "function" if isinstance(call.get("function"), dict) else None  # else HF's fields at the top
            fields = call[inner] if inner else call
            args = fields.get("arguments")
            if isinstance(args, str):
                fields = {**fields, "arguments": _arguments(args, f"{where}.tool_calls[{k}]")}
                call = {**call, inner: fields} if inner else fields
        out.append(call)
    return out


def _arguments(text: str, where: str) -> dict[str, Any]:
    if not text.strip():
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        value, err = None, f"not JSON ({e})"
    else:
        err = f"a JSON {_kind(value)}"
    if not isinstance(value, dict):
        raise DataError(f"{where}: the call's arguments are {err}, not a JSON object; chat templates write arguments "
                        'as a JSON object, e.g. "arguments": {"city": "Paris"} (or the string "{\\"city\\": \\"Paris\\"}")')
    return value


def function_call_turn(value: str, where: str) -> dict[str, Any] | None:
    """A ShareGPT ``function_call`` value (LLaMA-Factory: JSON ``{"name", "arguments"}``, or a list of them) as an
    assistant message that calls those tools, which the template writes in the model's own tool-call format;
    None when the value is not such JSON (the turn is then learned as its text)."""
    try:
        value = json.loads(value)
    except (TypeError, json.JSONDecodeError):
        return None
    calls = value if isinstance(value, list) else [value]
    if not calls or not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in calls):
        return None
    functions = [{"name": c["name"], "arguments": c.get("arguments", {})} for c in calls]
    tool_calls = parsed_calls([{"type": "function", "function": f} for f in functions], where)
    return {"role": "assistant", "content": "", "tool_calls": tool_calls}


def _kind(value: Any) -> str:
    return {dict: "object", list: "array", str: "string"}.get(type(value), type(value).__name__)
