"""Chat messages -> one rendered conversation plus the character spans of the assistant turns.

The messages (normalized by ``chat_messages``) are rendered once with the real chat template. To find
the assistant turns in it, the same conversation is also rendered with every non-empty content (and
reasoning trace) replaced by a unique placeholder (a "skeleton"): the skeleton shows which template
text surrounds each message, and walking the real text along it gives each content's exact character
range. Nothing is searched for by string, so a user turn that quotes a template marker cannot move a
mask, and templates that append EOS or a newline only at the very end (Phi-3) work, because no
rendered prefix has to be a prefix of the whole.

The learned span of an assistant turn is what the model writes after the turn's header (the
generation prompt): template text before the content (Qwen3's think block, gpt-oss's final
channel), the reasoning and content, tool calls the template writes from ``tool_calls``, and the
end-of-turn marker: the template text after the turn that is the same whether another message
follows or the conversation ends there (``<|im_end|>\\n``, ``<|eot_id|>``, ``</s>``,
``<end_of_turn>\\n``, ``<|end|>\\n``), or the special token that starts it where the two differ
(gpt-oss's ``<|end|>`` / ``<|return|>``); never the token that starts a turn (Command R7B writes the
next header after every turn, even the last). A template that writes a message differently when it
ends the conversation (Nemotron) is compared with the conversation continued instead. Headers, and
system, user and tool turns, are never learned. A turn's ``tool_calls`` must be in its span: a
template that does not write them, or writes them apart from the turn, is refused for that row, as is a
message with a content the template leaves out (``chat_checks``). The row's tool definitions (``tools``)
are passed to every render of it, skeletons included.
"""

from __future__ import annotations

import bisect
import json
import os
import re
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from .chat_messages import WEIGHT, reasoning_field, split_reasoning
from .chat_checks import calls_apart, calls_unwritten, check_roles, dropped_message, rewritten
from .sources import DataError

# Private-use code points: no template filter (trim, escaping) touches them, no real text has them.
_OPEN, _CLOSE = "\ue000", "\ue001"
_PLACEHOLDER = re.compile(f"{_OPEN}(\\d+){_CLOSE}")
_CACHE_SIZE = 4096
_PEEK = 256  # characters of a text that hold its first token, special tokens included
_NEXT_USER = {"role": "user", "content": ""}  # a turn after the last, to see where the last one ends


def placeholder(i: int) -> str:
    return f"{_OPEN}{i}{_CLOSE}"


def _slot(i: int, reasoning: bool = False) -> int:
    """The placeholder number of message i's content (even) or reasoning (odd)."""
    return 2 * i + int(reasoning)


def _variants(text: str) -> dict[str, None]:
    """How a template may write a content: as given, trimmed (Llama 3, Gemma), with newlines stripped at its
    ends (Qwen3's reasoning and the answer after it), or JSON-escaped (Llama 3.1+ write a tool result as
    ``content | tojson``). The quotes ``tojson`` adds are around the skeleton's placeholder too, so they are
    template text: the content's span is what is between them."""
    escaped = (json.dumps(text, ensure_ascii=False)[1:-1], json.dumps(text)[1:-1])
    return dict.fromkeys((text, text.strip(), text.strip("\n"), text.lstrip("\n"), *escaped))


# Templates that write today's date (Llama 3.1+, gpt-oss, Granite 3.3, Mistral Small 3) would make the tokens
# depend on the day they were made: a cache rebuilt on another day or node would differ from the checkpoint's,
# and eval from training. A macro of the same name shadows transformers' clock (a function cannot be passed:
# transformers turns template arguments into plain data) and writes Llama 3.1's own fallback, 26 Jul 2024.
TRAINING_DATE = (("%Y", "2024"), ("%y", "24"), ("%m", "07"), ("%B", "July"), ("%b", "Jul"), ("%d", "26"), ("%e", "26"),
                 ("%A", "Friday"), ("%a", "Fri"), ("%H", "00"), ("%M", "00"), ("%S", "00"))
FIXED_DATE_MACRO = ("{% macro strftime_now(format) %}{{ format"
                    + "".join(f" | replace('{code}', '{value}')" for code, value in TRAINING_DATE) + " }}{% endmacro %}")


class ChatLocator:
    """Renders conversations with one template and locates the assistant turns in the text."""

    def __init__(self, tokenizer, template: str):
        self.tokenizer, self.template = tokenizer, template
        self.rendered_template = FIXED_DATE_MACRO + template if "strftime_now" in template else template
        self.reasoning = reasoning_field(template)  # where the template writes a trace from (a slot of its own)
        # skeleton renders depend only on the conversation's structure (roles, non-content fields, empty contents)
        self._skeletons: OrderedDict[tuple, str] = OrderedDict()
        self._markers: dict[tuple[str, str], str] = {}  # (text after a turn, alternative) -> end marker
        self._opener_memo: dict[tuple[str, str], set[str]] = {}  # (text start, generation prompt) -> turn openers
        self._structures: dict[int, tuple[dict[str, Any], str]] = {}
        # the tool definitions of the conversation being located: every skeleton of it is rendered with them
        self._tools: list[dict[str, Any]] | None = None
        self._tools_key = ""

    def prepared(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``messages`` as they are rendered: inline reasoning moved to the template's reasoning field where it
        reads one (``split_reasoning``), a ``weight`` (what is learned, not what is written) left out."""
        out = [split_reasoning(m, self.reasoning) for m in messages] if self.reasoning else messages
        if any(WEIGHT in m for m in out):
            out = [{k: v for k, v in m.items() if k != WEIGHT} for m in out]
        return out

    def render(
        self, messages: list[dict[str, Any]], where: str, generation_prompt: bool = False, tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The conversation as the template writes it; ``generation_prompt``: followed by the header of
        the assistant turn to come (an encoder-decoder's source); ``tools``: the tool definitions the template
        writes (the row's ``tools``, ``chat_tools.row_tools``)."""
        check_roles(messages, self.template, where)
        try:
            return self.tokenizer.apply_chat_template(
                self.prepared(messages), chat_template=self.rendered_template, tokenize=False,
                add_generation_prompt=generation_prompt, tools=tools,
            )
        except Exception as e:  # jinja's raise_exception (e.g. roles must alternate) and template bugs
            hint = ""
            if "system" in str(e).lower() and any(m.get("role") == "system" for m in messages):  # Gemma, Mistral v0.1
                hint = ("; this template takes no system message: put its text at the start of the first user message, "
                        "or set data.chat_template to a template that has a system role")
            elif tools is None and any(m.get("tool_calls") for m in messages):  # Hermes 3's tool_use iterates tools
                hint = "; this template may need the definitions of the tools the row calls: give them in the row's 'tools' field"
            raise DataError(f"{where}: the chat template cannot render this conversation: {e}{hint}") from None

    def _skeleton(self, messages: list[dict[str, Any]], where: str, generation_prompt: bool = False, force: int | None = None) -> str:
        """The conversation rendered with placeholders for contents and reasoning (cached by structure).

        Empty ones stay empty, because templates test them (Qwen writes no newline before the tool call of a
        turn with an empty content, Qwen3 no think block for an empty trace); ``force``: that message's
        content gets its placeholder even when empty."""
        messages = self.prepared(messages)
        key = (self._tools_key, generation_prompt, force, *map(self._structure, messages))
        if key not in self._skeletons:
            marked = [_marked(m, i, i == force, self.reasoning) for i, m in enumerate(messages)]
            self._skeletons[key] = self.render(marked, where, generation_prompt, self._tools)
            if len(self._skeletons) > _CACHE_SIZE:
                self._skeletons.popitem(last=False)
        self._skeletons.move_to_end(key)
        return self._skeletons[key]

    def _structure(self, message: dict[str, Any]) -> str:
        """What of a message shapes its render besides its text: its fields, with contents reduced to whether
        they are empty (memoized per message object while one conversation is located)."""
        held = self._structures.get(id(message))
        if held is None or held[0] is not message:  # the memo holds each message, so no id is reused meanwhile
            held = self._structures[id(message)] = (message, json.dumps(
                {k: (bool(v) if k in ("content", self.reasoning) and isinstance(v, str) else v) for k, v in message.items()},
                sort_keys=True, default=str,
            ))
        return held[1]

    def locate(
        self, messages: list[dict[str, Any]], text: str, where: str, tools: list[dict[str, Any]] | None = None,
    ) -> list[tuple[int, int]]:
        """Character spans ``[start, end)`` of each assistant turn in ``text`` (rendered with ``tools``): what the
        model writes after the turn's header (its reasoning, content and tool calls) and the end-of-turn marker."""
        self._use_tools(tools)
        try:
            return self._locate(messages, text, where)
        except DataError:
            # a cached skeleton may be stale when the template reads the clock (Llama 3.2's date line)
            self._skeletons.clear()
            return self._locate(messages, text, where)

    def _locate(self, messages: list[dict[str, Any]], text: str, where: str) -> list[tuple[int, int]]:
        messages = self.prepared(messages)
        self._structures.clear()  # memoized for this row's messages only
        skeleton = self._skeleton(messages, where)
        self._check_written(messages, skeleton, where)
        to_text = _walk(messages, skeleton, text, where, self.reasoning)
        return [
            tuple(to_text(x) for x in self._turn(messages, i, skeleton, where))
            for i, m in enumerate(messages) if m["role"] == "assistant"
        ]

    def written(self, messages: list[dict[str, Any]], where: str, tools: list[dict[str, Any]] | None = None) -> None:
        """DataError where the template leaves out a message that has a content (``chat_checks.dropped_message``), or
        the tool calls of an assistant turn (``_calls_end``): what ``locate`` checks, for rows learned whole
        (``data.train_on_prompt``)."""
        self._use_tools(tools)
        messages = self.prepared(messages)
        self._structures.clear()
        skeleton = self._skeleton(messages, where)
        self._check_written(messages, skeleton, where)
        for i, m in enumerate(messages):
            if m["role"] == "assistant":
                self._calls_end(messages, i, skeleton, where)  # raises where the template writes no call

    def _use_tools(self, tools: list[dict[str, Any]] | None) -> None:
        """Render the skeletons of the conversation about to be located with ``tools`` (and cache them so)."""
        self._tools, self._tools_key = tools, json.dumps(tools, default=str) if tools else ""  # order kept, as tojson writes it

    def _check_written(self, messages: list[dict[str, Any]], skeleton: str, where: str) -> None:
        for i, m in enumerate(messages):
            if isinstance(m["content"], str) and m["content"].strip() and placeholder(_slot(i)) not in skeleton:
                raise dropped_message(where, i, messages)

    def _turn(self, messages: list[dict[str, Any]], i: int, skeleton: str, where: str) -> tuple[int, int]:
        """``[start, end)`` of assistant message i's turn in ``skeleton``.

        With a slot (its content or reasoning written): ``_slot_turn``. Without one, an empty content the
        template writes once it has one (Qwen's tool-call turns) is located in the skeleton that gives it its
        placeholder and carried back; a content the template does not write (Llama 3's tool-call turns), or
        writes only in another form (Nemotron's last message), spans from the turn's start (``_bare_start``)
        to the end marker. A turn with ``tool_calls`` must hold the text the template writes from them."""
        need = self._calls_end(messages, i, skeleton, where)
        span = self._slot_turn(messages, i, skeleton, where, None, need)
        if span is not None:
            return span
        forced = self._skeleton(messages, where, force=i)
        if placeholder(_slot(i)) in forced:
            try:
                span = self._slot_turn(messages, i, forced, where, i, self._calls_end(messages, i, forced, where, i))
            except DataError:  # the forced render writes the turn in another form: located without it below
                span = None
            if span is not None:
                to_skeleton = _align(forced, skeleton)
                start, end = (to_skeleton(x) for x in span)
                if start is not None and end is not None:
                    return start, end
        start = self._bare_start(messages, i, skeleton, where)
        if start is None:
            raise rewritten(where, f"message {i} (assistant)", messages)
        after = _PLACEHOLDER.split(skeleton[start:], 1)[0]
        marker = self._end_marker(messages, i, skeleton[:start], None, after, where, None, need)
        if marker is None and need is not None:
            raise calls_apart(where, i, i == len(messages) - 1)
        if not marker or not marker.strip():
            raise rewritten(where, f"message {i} (assistant)", messages)
        return start, start + len(marker)

    def _slot_turn(
        self, messages: list[dict[str, Any]], i: int, skeleton: str, where: str, force: int | None, need: int | None,
    ) -> tuple[int, int] | None:
        """``[start, end)`` of assistant message i's turn from its slots in ``skeleton``: from the template text
        after the generation prompt (``_lead``) to the end marker after its last slot; None without a slot."""
        found = [(skeleton.index(placeholder(k)), k) for k in (_slot(i, True), _slot(i)) if placeholder(k) in skeleton]
        if not found:
            return None
        first, last = min(found)[0], max(found)
        last_end = last[0] + len(placeholder(last[1]))
        start = first - len(self._lead(messages, i, skeleton, first, where))
        after = _PLACEHOLDER.split(skeleton[last_end:], 1)[0]
        marker = self._end_marker(messages, i, skeleton[: last[0]], last[1], after, where, force, need)
        if marker is None and need is not None:
            raise calls_apart(where, i, i == len(messages) - 1)
        if marker is None:
            raise rewritten(where, f"message {i} (assistant)", messages)
        return start, last_end + len(marker)

    def _calls_end(
        self, messages: list[dict[str, Any]], i: int, skeleton: str, where: str, force: int | None = None,
    ) -> int | None:
        """Where the text the template writes from assistant message i's ``tool_calls`` ends in ``skeleton``: the
        end of what differs from the render without them (for a message a user turn is put after, so that no
        later message that refers to the calls differs too); None when it has none or that cannot be told.
        DataError when the template does not write them (Granite 3.3's writes only contents)."""
        if not messages[i].get("tool_calls"):
            return None
        without = [*messages[:i], {k: v for k, v in messages[i].items() if k != "tool_calls"}, *messages[i + 1 :]]
        try:
            with_calls, bare = skeleton, self._skeleton(without, where, force=force)
            if with_calls != bare and i < len(messages) - 1:
                with_calls = self._skeleton([*messages[: i + 1], _NEXT_USER], where, force=force)
                bare = self._skeleton([*without[: i + 1], _NEXT_USER], where, force=force)
        except DataError:  # the template wants the calls (a tool result refers to them), or no user turn after them
            return None
        if with_calls == bare:
            raise calls_unwritten(where, i)
        a = len(os.path.commonprefix([with_calls, bare]))
        b = len(os.path.commonprefix([with_calls[::-1], bare[::-1]]))
        end = len(with_calls) - min(b, len(with_calls) - a, len(bare) - a)
        return end if end <= len(os.path.commonprefix([with_calls, skeleton])) else None

    def _bare_start(self, messages: list[dict[str, Any]], i: int, skeleton: str, where: str) -> int | None:
        """Where assistant message i's turn starts in ``skeleton`` when no slot of its own marks it: after the
        generation prompt, or, where the template writes the turn without the prompt's end, after the header it
        writes before an assistant content a user turn follows (Nemotron writes a last message's calls after
        ``<SPECIAL_11>Assistant\\n``, its generation prompt adds ``<think>\\n``). None when neither leads to it."""
        try:
            prompt = self._skeleton(messages[:i], where, generation_prompt=True)
            if (end := _continued(prompt, skeleton, _slot(i))) is not None:
                return end
            bare = self._skeleton(messages[:i], where)
            alt = self._skeleton([*messages[: i + 1], _NEXT_USER], where, force=i)
        except DataError:
            return None
        content = placeholder(_slot(i))
        header = alt[len(bare) : alt.find(content)]
        if content in alt and alt.startswith(bare) and header.strip() and skeleton.startswith(bare + header):
            return len(bare) + len(header)
        return None

    def _lead(self, messages: list[dict[str, Any]], i: int, skeleton: str, first: int, where: str) -> str:
        """Template text the model writes before assistant message i's first slot (at ``first``): what follows
        the generation prompt there, e.g. Qwen3's ``<think>\\n`` before the reasoning, or its empty
        ``<think>\\n\\n</think>\\n\\n`` before an answer without one. Empty for templates whose header
        ends where the content starts; whitespace alone is left to the tokens that straddle it
        (``tokenize_rendered``), as before the first content of Mixtral's ``[/INST] ``."""
        try:
            prompt = self._skeleton(messages[:i], where, generation_prompt=True)
        except DataError:
            return ""
        end = _continued(prompt, skeleton, _slot(i))
        lead = skeleton[end:first] if end is not None else ""
        return lead if lead.strip() and not _PLACEHOLDER.search(lead) else ""

    def _end_marker(
        self, messages: list[dict[str, Any]], i: int, head: str, slot: int | None, after: str, where: str,
        force: int | None, need: int | None,
    ) -> str | None:
        """The part of ``after`` (template text following assistant message i's last slot, or its start for a
        turn without one; ``head``: the skeleton before that) that closes the turn; None when none can be told.

        It is the common prefix of what follows here and what follows when the conversation continues
        differently: ended right after message i, or continued by a user turn (for the last message, and where
        the ended conversation writes message i otherwise), up to the token that starts that turn. A
        continuation counts where it writes the conversation as here up to ``head`` and the slot: Nemotron
        writes a conversation's last message in another form, after the loop. Where the two share nothing, a
        special token that starts ``after`` closes the turn: gpt-oss ends a last turn with ``<|return|>`` and
        any other with ``<|end|>``, and the model must learn to write both. A last turn that no continuation
        writes the same way ends where the text does. The marker reaches ``need`` (where the text the template
        writes from the turn's tool calls ends), and holds no token that starts a turn (``_before_opener``).
        """
        key = head + (placeholder(slot) if slot is not None else "")
        reach = 0 if need is None else need - len(key)

        def continued(other: list[dict[str, Any]], strict: bool = True) -> tuple[str, bool] | None:
            """The marker the conversation ``other`` gives, and whether it was cut before a turn's start; None
            where it is not rendered, or (``strict``) writes the conversation otherwise up to the slot."""
            try:
                alt = self._skeleton(other, where, force=force)
            except DataError:
                return None
            if (end := _continued(key, alt, _slot(i))) is not None:
                rest = alt[end:]
            elif strict:
                return None
            else:  # as before the forms were compared: what follows the slot wherever it is
                rest = alt.split(placeholder(slot), 1)[1] if slot is not None and placeholder(slot) in alt else ""
            shared = self._shared_tokens(after, _PLACEHOLDER.split(rest, 1)[0]) or self._special_start(after)
            marker = self._before_opener(shared, messages, i, where)
            return marker, marker != shared

        def candidates():
            if i == len(messages) - 1:
                user = continued([*messages, _NEXT_USER])
                yield user[0] if user else None
                yield self._before_opener(after, messages, i, where, stopped=True)
                return
            ended = continued(messages[: i + 1])
            yield ended[0] if ended else None
            user = continued([*messages[: i + 1], _NEXT_USER])
            yield user[0] if user and user[1] else None  # a user turn after a user turn shares its header
            loose = continued(messages[: i + 1], strict=False)
            yield loose[0] if loose else ""

        return next((m for m in candidates() if m is not None and len(m) >= reach), None)

    def _before_opener(
        self, marker: str, messages: list[dict[str, Any]], i: int, where: str, stopped: bool = False,
    ) -> str:
        """``marker`` up to the first token that starts a turn of this template, if it holds one (``stopped``:
        one after the EOS, where the model has stopped writing).

        Command R7B writes the assistant header after the last message whether or not a generation prompt is
        asked for, so what a turn's continuations share runs into the next header's
        ``<|START_OF_TURN_TOKEN|>``: the next turn's, never this one's. The tokens that start turns are the
        one the text starts with (after the template's BOS) and the one assistant message i's generation
        prompt starts with. A turn start before the EOS is the model's own: gpt-oss writes a call after an
        analysis message as ``<|end|><|start|>assistant to=...``, all of it one reply.
        """
        eos = getattr(self.tokenizer, "eos_token", None)
        if not marker or (stopped and not (isinstance(eos, str) and eos and eos in marker)):
            return marker
        openers = self._openers(messages, i, where)
        since = marker.find(eos) + len(eos) if stopped else 0
        cuts = [marker.find(t, since) for t in openers if t in marker[since:]]
        return marker[: min(cuts)] if cuts else marker

    def _openers(self, messages: list[dict[str, Any]], i: int, where: str) -> set[str]:
        """The special tokens that start a turn: the text's first (after the template's BOS) and the first of
        assistant message i's generation prompt (what it adds to the conversation before message i)."""
        try:
            bare = self._skeleton(messages[:i], where)
            prompt = self._skeleton(messages[:i], where, generation_prompt=True)
        except DataError:  # a template that renders no conversation without message i (or a lone prompt)
            bare = prompt = ""
        tail = prompt[len(bare) :] if prompt.startswith(bare) else ""
        key = (self._unbosed(self._skeleton(messages, where))[:_PEEK], tail[:_PEEK])
        if key not in self._opener_memo:
            if len(self._opener_memo) > _CACHE_SIZE:
                self._opener_memo.clear()
            self._opener_memo[key] = {t for t in map(self._special_start, key) if t}
        return self._opener_memo[key]

    def _unbosed(self, text: str) -> str:
        """``text`` without the BOS token a template writes first."""
        bos = getattr(self.tokenizer, "bos_token", None)
        return text[len(bos) :] if isinstance(bos, str) and bos and text.startswith(bos) else text

    def _special_start(self, text: str) -> str:
        """The special token ``text`` starts with, or ``""``."""
        ids = self.tokenizer.encode(text, add_special_tokens=False)[:1]
        added = getattr(self.tokenizer, "added_tokens_decoder", {})
        if not ids or not (ids[0] in self.tokenizer.all_special_ids or getattr(added.get(ids[0]), "special", False)):
            return ""
        token = self.tokenizer.convert_ids_to_tokens(ids[0])
        return token if text.startswith(token) else ""

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


def _marked(message: dict[str, Any], i: int, force: bool, reasoning: str | None) -> dict[str, Any]:
    """Message i with placeholders for its content and its ``reasoning`` field, where they are not empty
    (``force``: the content's even so)."""
    out = {**message, "content": placeholder(_slot(i)) if message["content"] or force else ""}
    if reasoning and isinstance(message.get(reasoning), str):
        out[reasoning] = placeholder(_slot(i, True)) if message[reasoning] else ""
    return out


def _walk(messages: list[dict[str, Any]], skeleton: str, text: str, where: str, reasoning: str | None) -> Callable[[int], int]:
    """Walk ``text`` along ``skeleton`` (literal template text must match, each slot is its value as given or
    trimmed) and return the map from a skeleton offset outside the slots to the text's."""
    literals = _PLACEHOLDER.split(skeleton)[0::2]  # template text between placeholders
    order = [int(k) for k in _PLACEHOLDER.findall(skeleton)]
    if not text.startswith(literals[0]):
        raise rewritten(where, "the text before the first message", messages)
    pos, sk, ends = len(literals[0]), len(literals[0]), []  # (skeleton end, text end) of each slot
    for j, k in enumerate(order):
        i, after = k // 2, literals[j + 1]
        last = j == len(order) - 1
        for candidate in _variants(messages[i][reasoning if k % 2 else "content"]):
            end = pos + len(candidate)
            if text.startswith(candidate, pos) and (text[end:] == after if last else text.startswith(after, end)):
                break
        else:
            raise rewritten(where, f"message {i} ({messages[i]['role']})", messages)
        sk += len(placeholder(k))
        ends.append((sk, end))
        pos, sk = end + len(after), sk + len(after)

    def to_text(x: int) -> int:
        j = bisect.bisect_right(ends, (x, len(text) + 1)) - 1
        return x if j < 0 else x - ends[j][0] + ends[j][1]

    return to_text


def _continued(prefix: str, text: str, below: int) -> int | None:
    """Where ``prefix``, a render of the conversation's beginning, ends in ``text``, a render of more of it: its
    length where ``text`` starts with it; else, where ``text`` writes the same as ``prefix`` from the last slot
    below ``below`` (an earlier message's) on, the end of that; None otherwise. Mistral v0.3 writes the tool
    definitions before the last user message, so a prefix has them in another place than the whole, and the
    turns after that place are still written alike."""
    if text.startswith(prefix):
        return len(prefix)
    anchors = [m for m in _PLACEHOLDER.finditer(prefix) if int(m.group(1)) < below]
    if not anchors:
        return None
    at = text.find(anchors[-1].group(0))
    tail = prefix[anchors[-1].end() :]
    if at < 0 or not text.startswith(tail, at + len(anchors[-1].group(0))):
        return None
    return at + len(anchors[-1].group(0)) + len(tail)


def _align(src: str, dst: str) -> Callable[[int], int | None]:
    """Map offsets of ``src`` to ``dst``, two renders that differ in one place: offsets up to their common
    beginning and from their common end map; offsets inside the difference map to None."""
    a = len(os.path.commonprefix([src, dst]))
    b = len(os.path.commonprefix([src[::-1], dst[::-1]]))
    b = min(b, len(src) - a, len(dst) - a)
    return lambda x: x if x <= a else x - len(src) + len(dst) if x >= len(src) - b else None
