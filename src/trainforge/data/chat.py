"""Chat rows -> one rendered conversation plus the character spans of the assistant turns.

Messages come as OpenAI-style ``{"role", "content"}`` or ShareGPT-style ``{"from", "value"}``
objects; content may be a string or a list of ``{"type": "text", "text": ...}`` parts. The
conversation is rendered once with the real chat template. To find the assistant turns in it,
the same conversation is also rendered with every content replaced by a unique placeholder (a
"skeleton"): the skeleton shows which template text surrounds each message, and walking the
real text along it gives each content's exact character range. Nothing is searched for by
string, so a user turn that quotes a template marker cannot move a mask, and templates that
append EOS or a newline only at the very end (Phi-3) work, because no rendered prefix has to be
a prefix of the whole.

The learned span of an assistant turn is its content plus its end-of-turn marker: the template
text written right after the content that is the same whether another message follows or the
conversation ends there (``<|im_end|>\\n``, ``<|eot_id|>``, ``</s>``, ``<end_of_turn>\\n``,
``<|end|>\\n``). Headers, and system, user and tool turns, are never learned.
"""

from __future__ import annotations

import json
import os
import re
from collections import OrderedDict
from typing import Any

from .sources import DataError, Row

# ShareGPT / FastChat / Axolotl / LLaMA-Factory role names -> the roles chat templates know
ROLE_ALIASES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "function_call": "assistant",  # the model's own tool call: learned like any assistant output
    "system": "system",
}
TOOL_ROLES = ("tool", "observation", "function", "ipython")  # tool results: mapped to the template's tool role
SHAREGPT_FIELD = "conversations"

# Private-use code points: no template filter (trim, escaping) touches them, no real text has them.
_OPEN, _CLOSE = "\ue000", "\ue001"
_PLACEHOLDER = re.compile(f"{_OPEN}(\\d+){_CLOSE}")
_CACHE_SIZE = 4096


def placeholder(i: int) -> str:
    return f"{_OPEN}{i}{_CLOSE}"


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
        role = ROLE_ALIASES.get(role.lower(), tool_role if role.lower() in TOOL_ROLES else role)
        out = {k: v for k, v in m.items() if k not in ("from", "value")}
        out["role"], out["content"] = role, _text_of(content, row.where, f"{key}[{i}]")
        messages.append(out)
    system = row.data.get("system")  # LLaMA-Factory's ShareGPT layout keeps the system prompt beside the turns
    if isinstance(system, str) and system.strip() and not any(m["role"] == "system" for m in messages):
        messages.insert(0, {"role": "system", "content": system})
    return messages


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
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def split_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant message whose content carries its reasoning inline (``<think>R</think>A``, as reasoning
    datasets store it) as ``reasoning_content`` R and ``content`` A, for a template that reads the field:
    Qwen3's renders the same text either way (it strips the same newlines), and the two parts become separate
    slots of the skeleton."""
    content = message["content"]
    if message["role"] != "assistant" or THINK_CLOSE not in content or isinstance(message.get(REASONING), str):
        return message
    reasoning = content.split(THINK_CLOSE)[0].split(THINK_OPEN)[-1].strip("\n")
    return {**message, REASONING: reasoning, "content": content.split(THINK_CLOSE)[-1].lstrip("\n")}


def _slot(i: int, reasoning: bool = False) -> int:
    """The placeholder number of message i's content (even) or reasoning (odd)."""
    return 2 * i + int(reasoning)


def _variants(text: str) -> dict[str, None]:
    """How a template may write a content: as given, trimmed (Llama 3, Gemma), or with newlines stripped
    at its ends (Qwen3's reasoning and the answer after it)."""
    return dict.fromkeys((text, text.strip(), text.strip("\n"), text.lstrip("\n")))


class ChatLocator:
    """Renders conversations with one template and locates the assistant turns in the text."""

    def __init__(self, tokenizer, template: str):
        self.tokenizer, self.template = tokenizer, template
        self.reads_reasoning = REASONING in template  # Qwen3-style: reasoning rendered in a <think> block
        # skeleton renders depend only on the conversation's structure (roles and non-content fields)
        self._skeletons: OrderedDict[tuple, str] = OrderedDict()
        self._markers: dict[tuple[str, str], str] = {}  # (text after a turn, alternative) -> end marker

    def prepared(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``messages`` as they are rendered: inline reasoning moved to ``reasoning_content`` where the
        template reads that field (``split_reasoning``); unchanged otherwise."""
        return [split_reasoning(m) for m in messages] if self.reads_reasoning else messages

    def render(self, messages: list[dict[str, Any]], where: str, generation_prompt: bool = False) -> str:
        """The conversation as the template writes it; ``generation_prompt``: followed by the header of
        the assistant turn to come (an encoder-decoder's source)."""
        try:
            return self.tokenizer.apply_chat_template(
                self.prepared(messages), chat_template=self.template, tokenize=False, add_generation_prompt=generation_prompt
            )
        except Exception as e:  # jinja's raise_exception (e.g. roles must alternate) and template bugs
            raise DataError(f"{where}: the chat template cannot render this conversation: {e}") from None

    def _skeleton(self, messages: list[dict[str, Any]], where: str, generation_prompt: bool = False) -> str:
        """The conversation rendered with placeholders for contents and reasoning (cached by structure)."""
        messages = self.prepared(messages)
        key = (generation_prompt, *(
            json.dumps({k: (v if k != REASONING else isinstance(v, str)) for k, v in m.items() if k != "content"},
                       sort_keys=True, default=str)
            for m in messages
        ))
        if key not in self._skeletons:
            marked = [
                {**m, "content": placeholder(_slot(i)), **({REASONING: placeholder(_slot(i, True))} if isinstance(m.get(REASONING), str) else {})}
                for i, m in enumerate(messages)
            ]
            self._skeletons[key] = self.render(marked, where, generation_prompt)
            if len(self._skeletons) > _CACHE_SIZE:
                self._skeletons.popitem(last=False)
        self._skeletons.move_to_end(key)
        return self._skeletons[key]

    def locate(self, messages: list[dict[str, Any]], text: str, where: str) -> list[tuple[int, int]]:
        """Character spans ``[start, end)`` of each assistant turn (what the model writes after the turn's
        header: its reasoning and content, and the end marker) in ``text``."""
        try:
            return self._locate(messages, text, where)
        except DataError:
            # a cached skeleton may be stale when the template reads the clock (Llama 3.2's date line)
            self._skeletons.clear()
            return self._locate(messages, text, where)

    def _locate(self, messages: list[dict[str, Any]], text: str, where: str) -> list[tuple[int, int]]:
        messages = self.prepared(messages)
        skeleton = self._skeleton(messages, where)
        literals = _PLACEHOLDER.split(skeleton)[0::2]  # template text between placeholders
        order = [int(k) for k in _PLACEHOLDER.findall(skeleton)]
        if not text.startswith(literals[0]):
            raise _rewritten(where, "the text before the first message", messages)
        pos, turns = len(literals[0]), {}  # assistant message -> [start of its first slot, end of its last, slot, after]
        for j, k in enumerate(order):
            i, after = k // 2, literals[j + 1]
            value = messages[i][REASONING if k % 2 else "content"]
            last = j == len(order) - 1
            for candidate in _variants(value):
                end = pos + len(candidate)
                if text.startswith(candidate, pos) and (text[end:] == after if last else text.startswith(after, end)):
                    break
            else:
                raise _rewritten(where, f"message {i} ({messages[i]['role']})", messages)
            if messages[i]["role"] == "assistant":
                turns.setdefault(i, [pos, end, k, after])[1:] = [end, k, after]
            pos = end + len(after)
        return [
            (start - len(self._lead(messages, i, skeleton, where)), end + len(self._end_marker(messages, i, k, after, where)))
            for i, (start, end, k, after) in turns.items()
        ]

    def _lead(self, messages: list[dict[str, Any]], i: int, skeleton: str, where: str) -> str:
        """Template text the model writes before assistant message i's first slot: what follows the
        generation prompt there, e.g. Qwen3's ``<think>\n`` before the reasoning, or its empty
        ``<think>\n\n</think>\n\n`` before an answer without one. Empty for templates whose header
        ends where the content starts; whitespace alone is left to the tokens that straddle it
        (``tokenize_rendered``), as before the first content of Mixtral's ``[/INST] ``."""
        first = min(skeleton.find(placeholder(_slot(i, r))) for r in (False, True) if placeholder(_slot(i, r)) in skeleton)
        try:
            prompt = self._skeleton(messages[:i], where, generation_prompt=True)
        except DataError:
            return ""
        lead = skeleton[len(prompt) : first]
        return lead if skeleton.startswith(prompt) and lead.strip() and not _PLACEHOLDER.search(lead) else ""

    def _end_marker(self, messages: list[dict[str, Any]], i: int, slot: int, after: str, where: str) -> str:
        """The part of ``after`` (template text following assistant message i's last slot) that closes the turn.

        It is the common prefix of what follows the slot here and what follows it when the
        conversation continues differently: ended right after message i, or, for the last
        message, continued by a user turn.
        """
        if i < len(messages) - 1:
            other = messages[: i + 1]
        else:
            other = [*messages, {"role": "user", "content": ""}]
        try:
            alt = self._skeleton(other, where)
        except DataError:  # the template refuses the variant: the turn ends where the text says
            return after if i == len(messages) - 1 else ""
        rest = alt.split(placeholder(slot), 1)[1] if placeholder(slot) in alt else ""
        return self._shared_tokens(after, _PLACEHOLDER.split(rest, 1)[0])

    def _shared_tokens(self, a: str, b: str) -> str:
        """The longest common prefix of ``a`` and ``b`` that ends on a token boundary in both.

        A character prefix alone can end inside a token: Phi-3's ``<|end|>\n<|user|>`` and
        ``<|end|>\n<|endoftext|>`` share ``<|end|>\n<|``.
        """
        if (a, b) not in self._markers:
            encode = lambda s: self.tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
            ids_a, ids_b = encode(a), encode(b)
            n = len(os.path.commonprefix([a, b]))
            while n > 0:
                ids = encode(a[:n])
                if ids == ids_a[: len(ids)] and ids == ids_b[: len(ids)]:
                    break
                n -= 1
            self._markers[(a, b)] = a[:n]
        return self._markers[(a, b)]


def _rewritten(where: str, what: str, messages: list[dict[str, Any]]) -> DataError:
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
