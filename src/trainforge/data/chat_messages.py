"""Chat rows -> normalized messages: role names, content parts, inline reasoning.

OpenAI-style ``{"role", "content"}`` and ShareGPT-style ``{"from", "value"}`` messages become
``{"role", "content", ...}`` dicts with the roles chat templates know; a content may be a list of text parts.
Tool calls get their arguments as JSON objects and ShareGPT's ``function_call`` turns become assistant turns
that call tools (``chat_tools``); OpenAI's per-message ``weight`` (0: a turn not learned) is checked and kept
for ``learned_turns`` (the locator leaves it out of the render).
An assistant content that holds its reasoning inline (``<think>...</think>``) is split into the field a
template writes reasoning from, where it reads one. ``chat.ChatLocator`` renders and locates the result.
"""

from __future__ import annotations

import json
import re
from typing import Any

from .chat_tools import function_call_turn, parsed_calls
from .sources import DataError, Row

# ShareGPT / FastChat / Axolotl / LLaMA-Factory role names -> the roles chat templates know
ROLE_ALIASES = {
    "human": "user",
    "user": "user",
    "prompter": "user",  # OpenAssistant (OASST)
    "gpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "function_call": "assistant",  # the model's own tool call (LLaMA-Factory): an assistant turn with tool_calls
    "system": "system",
}
TOOL_ROLES = ("tool", "observation", "function", "ipython")  # tool results: mapped to the template's tool role
SHAREGPT_FIELD = "conversations"
WEIGHT = "weight"  # OpenAI fine-tuning's per-message weight: 0, an assistant turn that is context, not learned


def tool_role_of(template: str, default_template: bool) -> str:
    """The role a template renders tool results under: ``tool``, Llama 3.1's ``ipython``, else ``user``."""
    if default_template or re.search(r"""["']tool["']""", template):
        return "tool"
    if re.search(r"""["']ipython["']""", template):
        return "ipython"
    return "user"


def conversation(row: Row, field: str, tool_role: str) -> list[dict[str, Any]]:
    """The row's messages as ``{"role", "content", ...}`` dicts with roles normalized; DataError when malformed."""
    key = field if field in row.data else SHAREGPT_FIELD if SHAREGPT_FIELD in row.data else field
    raw = row.data.get(key)
    if isinstance(raw, str) and raw.lstrip().startswith("["):  # a CSV cell (or string column) holding the list as JSON
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as e:
            raise DataError(f"{row.where}: field {key!r} holds text that starts like a JSON list but does not parse: {e}") from None
    if not isinstance(raw, list) or not raw:
        raise DataError(f"{row.where}: field {key!r} must be a non-empty list of {{role, content}} (or ShareGPT {{from, value}}) objects")
    messages = []
    for i, m in enumerate(raw):
        role = m.get("role", m.get("from")) if isinstance(m, dict) else None
        content = m.get("content", m.get("value")) if isinstance(m, dict) else None
        if content is None and isinstance(m, dict) and m.get("tool_calls"):
            content = ""  # an assistant turn that only calls tools: the template renders the calls
        if not isinstance(role, str) or content is None:
            raise DataError(f"{row.where}: {key}[{i}] must be an object with string 'role' and 'content' (or ShareGPT 'from' and 'value')")
        name = f"{key}[{i}]"
        call = function_call_turn(content, f"{row.where}: {name}") if role.lower() == "function_call" else None
        role = ROLE_ALIASES.get(role.lower(), tool_role if role.lower() in TOOL_ROLES else role)
        out = {k: v for k, v in m.items() if k not in ("from", "value")}
        out["role"], out["content"] = role, _text_of(content, row.where, name)
        if call is not None:  # a JSON call: written by the template as the model writes calls, not as text
            out.update(call)
        if "tool_calls" in out:
            out["tool_calls"] = parsed_calls(out["tool_calls"], f"{row.where}: {name}")
        if WEIGHT in out:
            out[WEIGHT] = _weight(out[WEIGHT], row.where, name)
        messages.append(out)
    system = row.data.get("system")  # LLaMA-Factory's ShareGPT layout keeps the system prompt beside the turns
    if isinstance(system, str) and system.strip() and not any(m["role"] == "system" for m in messages):
        messages.insert(0, {"role": "system", "content": system})
    return messages


def _weight(value: Any, where: str, name: str) -> int:
    """A message's ``weight``: 0 (not learned) or 1 (learned, as without one)."""
    if isinstance(value, bool) or value not in (0, 1):
        raise DataError(f"{where}: {name}.weight is {value!r}; it must be 0 (an assistant turn kept as context, not "
                        "learned) or 1 (learned, as without a weight)")
    return int(value)


def learned_turns(messages: list[dict[str, Any]]) -> list[bool]:
    """Per assistant message, in order: whether it is learned (its ``weight`` is not 0)."""
    return [m.get(WEIGHT, 1) != 0 for m in messages if m["role"] == "assistant"]


def _text_of(content: Any, where: str, name: str) -> str:
    """A string content, or the text parts of a list of ``{"type": "text", "text"}`` parts, joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind != "text" or not isinstance(part.get("text"), str):
                raise DataError(
                    f"{where}: {name}.content[{j}] is a {kind!r} part; only {{\"type\": \"text\", \"text\": ...}} parts "
                    "are supported (text-only training)"
                )
            texts.append(part["text"])
        return "".join(texts)
    raise DataError(f"{where}: {name}.content must be a string or a list of text parts, got {type(content).__name__}")


REASONING = "reasoning_content"  # an assistant message's reasoning, the field Qwen3-style templates read
THINKING = "thinking"  # ... the field gpt-oss's template reads (its analysis channel)
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def reasoning_field(template: str) -> str | None:
    """The message field a template writes reasoning from: ``reasoning_content`` (Qwen3, GLM), ``thinking``
    (gpt-oss), or None (the template has no place for it)."""
    if REASONING in template:
        return REASONING
    return THINKING if re.search(r"\bthinking\b", template) else None  # not Qwen3's enable_thinking


def split_reasoning(message: dict[str, Any], field: str = REASONING) -> dict[str, Any]:
    """An assistant message whose content carries its reasoning inline (``<think>R</think>A``, as reasoning
    datasets store it) as ``field`` R and ``content`` A, for a template that reads the field: Qwen3's renders
    the same text either way (it strips the same newlines), and the two parts become separate slots of the
    skeleton."""
    content = message["content"]
    if message["role"] != "assistant" or THINK_CLOSE not in content or isinstance(message.get(field), str):
        return message
    reasoning = content.split(THINK_CLOSE)[0].split(THINK_OPEN)[-1].strip("\n")
    return {**message, field: reasoning, "content": content.split(THINK_CLOSE)[-1].lstrip("\n")}
