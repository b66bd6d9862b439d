"""Checks of chat rows against their template, and the errors that refuse a row, naming what to do.

Roles: a message's role must be one trainforge maps (``chat_messages.ROLE_ALIASES``, the tool roles) or one the
template names; a ChatML template writes any role, so a misspelt one would train a turn the model never meets,
and a template that tests roles drops it silently (Qwen2.5). A message with a content that the template leaves
out of the text (its skeleton placeholder is missing) would train the row without it: refused, naming it.
"""

from __future__ import annotations

import re
from typing import Any

from .chat_messages import REASONING, ROLE_ALIASES, THINK_CLOSE, THINK_OPEN, TOOL_ROLES
from .sources import DataError

_KNOWN = frozenset(("user", "assistant", "system", "tool", "ipython"))  # the roles normalized messages have
_NAMED: dict[tuple[str, str], bool] = {}  # (role, template) -> whether the template names the role


def check_roles(messages: list[dict[str, Any]], template: str, where: str) -> None:
    """DataError for a message whose role neither trainforge maps nor the template names (as a quoted string:
    gpt-oss's ``"developer"``, Mistral's ``"tool_results"``)."""
    for i, m in enumerate(messages):
        role = m.get("role")
        if role in _KNOWN:
            continue
        key = (str(role), template)
        if key not in _NAMED:
            if len(_NAMED) > 1024:
                _NAMED.clear()
            _NAMED[key] = isinstance(role, str) and bool(re.search(f"[\"']{re.escape(role)}[\"']", template))
        if not _NAMED[key]:
            aliases = ", ".join(sorted(k for k in ROLE_ALIASES if k not in _KNOWN))
            raise DataError(
                f"{where}: message {i} has role {role!r}, which is neither a role trainforge reads nor one the chat template "
                f"names; roles read: user, assistant, system, tool results ({', '.join(TOOL_ROLES)}), their aliases "
                f"({aliases}), and any role the template names; rename the role in the data"
            )


def dropped_message(where: str, i: int, messages: list[dict[str, Any]]) -> DataError:
    """The error for message i, which has a content the chat template does not write (at all, or not as given)."""
    role = messages[i]["role"]
    if role == "system":
        why = ("it drops system messages here (Mistral v0.3's writes the system prompt only into the last user turn of a "
               "conversation that ends with one, so never in a training row); put the system text at the start of the "
               "first user message, or set data.chat_template to a template that writes system messages")
    elif role == "assistant" and messages[i].get("tool_calls"):
        why = ("it writes only the tool calls of a turn that has them (Llama 3's); leave the turn's content empty (null), "
               "or set data.chat_template to a template that writes content and calls")
    else:
        why = (f"it writes no {role!r} message here; rename the role to one the template writes, or set data.chat_template "
               "to a template that writes it")
    return DataError(
        f"{where}: message {i} ({role}) has a content that the chat template leaves out of the text, so the row would "
        f"train without it: {why}"
    )


def rewritten(where: str, what: str, messages: list[dict[str, Any]]) -> DataError:
    if any(m["role"] == "assistant" and THINK_CLOSE in m["content"] for m in messages):
        return DataError(
            f"{where}: the chat template rewrites an assistant message that holds its reasoning ({THINK_OPEN}...{THINK_CLOSE}): "
            "this template drops or moves reasoning (DeepSeek-R1's and QwQ's drop it from every turn), so it cannot be "
            "learned with it; set data.chat_template to a template that renders reasoning (one that reads the "
            f"{REASONING!r} field, as Qwen3's does), or remove the {THINK_OPEN} blocks from the data"
        )
    return DataError(
        f"{where}: the chat template changes {what} while rendering (it does more than place or trim message "
        "contents), so the assistant turns cannot be located in the text; set data.chat_template to a template "
        "that writes contents as given, or set data.train_on_prompt: true to learn every token"
    )


def calls_unwritten(where: str, i: int) -> DataError:
    return DataError(
        f"{where}: message {i} (assistant) has tool_calls, but the chat template does not write them (it writes the "
        "turn the same without them: Granite 3.3's, Mistral v0.2's and Gemma 2's write only contents), so "
        "the turn would be learned without its call; set data.chat_template to a template that renders tool_calls, "
        "or write each call into the message's content in the model's own tool-call format (Granite 3.3: "
        "'<|tool_call|>' followed by a JSON list of the calls)"
    )


def calls_apart(where: str, i: int, last: bool) -> DataError:
    fix = ("end the row with the tool's result (add the tool message after the call) so that the template writes "
           "content and call in one turn, leave the content empty (null), or " if last else "")
    return DataError(
        f"{where}: message {i} (assistant): the chat template writes its tool_calls apart from the turn that holds "
        "its content (NVIDIA Nemotron Nano v2's writes a conversation's last message as two assistant turns, the "
        "content closed by <SPECIAL_12> before the calls), so learning it would teach the model to stop before "
        f"calling; {fix}set data.chat_template to a template that writes them together"
    )
