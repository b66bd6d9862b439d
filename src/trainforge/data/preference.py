"""Preference rows -> the rendered completions a preference objective compares, with their learned spans.

Paired rows (DPO, IPO, ORPO, SimPO) in the layouts people have:
- TRL's ``{"prompt", "chosen", "rejected"}``, as strings or as message lists (the prompt's messages, then
  each side's reply);
- the implicit-prompt layout ``{"chosen": full, "rejected": full}`` (Anthropic HH as strings: the prompt
  is the shared prefix up to its last ``Assistant:``, else cut at a word boundary; UltraFeedback-binarized as
  message lists: the prompt is the shared leading messages, and a ``prompt`` string beside them is the same
  question, not read; beside lists of replies only it is the question, a user turn).
  A prompt that both sides already begin with (full texts or conversations beside their prompt) is written once;
- LLaMA-Factory's ShareGPT pairs ``{"conversations": [prompt turns], "chosen": {"from", "value"}, "rejected": {...}}``
  (its ``dpo_en_demo.json``), or the same with OpenAI ``messages`` and ``{"role", "content"}`` replies: each side
  a single message, after the prompt's turns (a top-level ``system`` string is the system turn, as for SFT).
Unpaired rows (KTO): TRL's ``{"prompt", "completion", "label"}`` and LLaMA-Factory's ``{"messages", "label"}``
or ShareGPT ``{"conversations", "label"}`` (the last assistant turn is the completion); under
``data.format: unpaired``, a pair in any of the layouts above is two examples, its chosen reply desirable and its
rejected one not.

Each side is rendered as SFT renders a row (the real chat template; offset-exact spans): only the reply
is learned, never the prompt nor earlier assistant turns. Bad rows (identical sides, an empty side, a
missing or non-boolean label, a pair with no prompt) raise ``DataError`` naming the file and line. Every field
is read under its ``data.fields`` name (Intel's orca_dpo_pairs: ``fields: {prompt: question}``; StackExchange-paired:
``fields: {prompt: question, chosen: response_j, rejected: response_k}``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..config.data import FieldNames
from .chat_messages import SHAREGPT_FIELD, conversation
from .chat_tools import row_tools
from .formats import Rendered, Renderer, TokenizedChunk, tokenize_rendered
from .sources import DataError, Row

MESSAGES = "messages"  # the key conversation() reads a re-wrapped message list under


def preference_kind(row: Row, names: FieldNames | None = None) -> str | None:
    """``pairs`` (chosen and rejected), ``unpaired`` (a completion or messages with a label), else None;
    fields under their ``names`` (``data.fields``)."""
    n = names or FieldNames()
    if n.chosen in row.data and n.rejected in row.data:
        return "pairs"
    if n.label in row.data and (n.completion in row.data or has_messages(row, n)):
        return "unpaired"
    return None


def has_messages(row: Row, names: FieldNames) -> bool:
    """Whether the row holds a conversation: ``messages`` (its ``data.fields`` name) or ShareGPT's ``conversations``."""
    return names.messages in row.data or SHAREGPT_FIELD in row.data


SIDES = "both strings, both message lists, or both single messages ({role, content} or ShareGPT {from, value})"


class PreferenceRenderer:
    """Renders preference rows with one SFT ``Renderer``'s chat template (and its role handling)."""

    def __init__(self, renderer: Renderer):
        self.chat, self.tool_role, self.names = renderer.chat, renderer.tool_role, renderer.names

    def pair(self, row: Row) -> tuple[Rendered, Rendered]:
        """(chosen, rejected) of a paired row, each its prompt plus its reply, the reply learned."""
        n = self.names
        chosen, rejected = row.data.get(n.chosen), row.data.get(n.rejected)
        for side, setting in ((n.chosen, "chosen"), (n.rejected, "rejected")):
            if row.data.get(side) is None:
                raise DataError(
                    f"{row.where}: the {side!r} field is {'null' if side in row.data else 'missing'} (fields: "
                    f"{sorted(row.data)}): a preference pair needs {n.chosen!r} and {n.rejected!r}, {SIDES}; a reply "
                    f"under another name is read with data.fields.{setting}"
                )
        if isinstance(chosen, dict) and isinstance(rejected, dict):
            return self._reply_pair(row)
        if isinstance(chosen, list) and isinstance(rejected, list):
            return self._message_pair(row, chosen, rejected)
        if isinstance(chosen, str) and isinstance(rejected, str):
            prompt = row.data.get(self.names.prompt)
            if prompt is None:
                prompt, chosen, rejected = split_shared_prefix(chosen, rejected)
                if not prompt.strip():
                    raise self._no_prompt(row)
            elif not isinstance(prompt, str):
                raise DataError(f"{row.where}: {self.names.prompt!r} must be a string when chosen and rejected are strings")
            elif prompt.strip() and chosen.startswith(prompt) and rejected.startswith(prompt):
                # full texts beside their prompt (HH with a prompt column): the prompt is written once, not twice
                chosen, rejected = chosen[len(prompt) :], rejected[len(prompt) :]
            _check_sides(row.where, chosen, rejected, n)
            return _text(prompt, chosen, row.where), _text(prompt, rejected, row.where)
        raise DataError(
            f"{row.where}: {n.chosen!r} and {n.rejected!r} must be {SIDES}, got "
            f"{type(chosen).__name__} and {type(rejected).__name__}"
        )

    def examples(self, row: Row) -> list[tuple[Rendered, bool]]:
        """The KTO examples of a row of ``data.format: unpaired``: its one labelled completion, or, of a preference
        pair, the chosen reply as a desirable example and the rejected one as an undesirable example (as TRL's
        KTOTrainer reads paired data), each after the pair's prompt."""
        n = self.names
        if n.chosen in row.data and n.rejected in row.data:
            if n.label not in row.data:
                chosen, rejected = self.pair(row)
                return [(chosen, True), (rejected, False)]
            if n.completion not in row.data and not has_messages(row, n):
                raise DataError(
                    f"{row.where}: a pair ({n.chosen!r}, {n.rejected!r}) with a {n.label!r}: a row of data.format: unpaired "
                    f"is a labelled completion ({n.completion!r} or {n.messages!r}) or a pair, split into a desirable and "
                    f"an undesirable example; drop the {n.label!r} field, or name another with data.fields.label"
                )
        return [self.unpaired(row)]

    def unpaired(self, row: Row) -> tuple[Rendered, bool]:
        """(the completion after its prompt, whether it is desirable) of a KTO row."""
        label = row.data.get(self.names.label)
        if not isinstance(label, bool):
            raise DataError(f"{row.where}: {self.names.label!r} must be true (desirable) or false (undesirable), got {label!r}")
        if has_messages(row, self.names):
            # LLaMA-Factory's messages, or ShareGPT conversations with a top-level system beside them as for SFT (a
            # messages row's own list alone, as its stores were keyed)
            messages = (self._messages(row, self.names.messages) if self.names.messages in row.data
                        else conversation(row, self.names.messages, self.tool_role))
            last = next((i for i in range(len(messages) - 1, -1, -1) if messages[i]["role"] == "assistant"), None)
            if last is None:
                raise DataError(f"{row.where}: the conversation has no assistant turn to judge")
            return self._render(messages[:last], messages[last : last + 1], row), label
        names = self.names
        prompt, completion = row.data.get(names.prompt), row.data.get(names.completion)
        if isinstance(prompt, list) and isinstance(completion, list):
            messages = self._messages(row, names.prompt), self._messages(row, names.completion)
            return self._render(*messages, row), label
        if not (isinstance(prompt, str) and isinstance(completion, str)):
            raise DataError(
                f"{row.where}: {names.prompt!r} and {names.completion!r} must both be strings or both be message lists"
            )
        if not completion.strip():
            raise DataError(f"{row.where}: the completion is empty")
        return _text(prompt, completion, row.where), label

    def _reply_pair(self, row: Row) -> tuple[Rendered, Rendered]:
        """A pair whose sides are single messages (LLaMA-Factory's ShareGPT layout), after the prompt's turns: a
        ``prompt`` message list, else the row's ``messages`` or ``conversations`` (with a top-level ``system``)."""
        n = self.names
        if isinstance(row.data.get(n.prompt), list):
            prompt = self._messages(row, n.prompt)
        elif has_messages(row, n):
            prompt = conversation(row, n.messages, self.tool_role)
        else:
            raise DataError(
                f"{row.where}: no prompt: {n.chosen!r} and {n.rejected!r} are single messages, and the row has no "
                f"{n.messages!r} or {SHAREGPT_FIELD!r} turns (fields: {sorted(row.data)}) to reply to; name the turns' "
                "field with data.fields.messages"
            )
        return self._checked_pair(row, prompt, self._messages(row, n.chosen), self._messages(row, n.rejected))

    def _message_pair(self, row: Row, chosen: list, rejected: list) -> tuple[Rendered, Rendered]:
        names = self.names
        chosen_msgs, rejected_msgs = self._messages(row, names.chosen), self._messages(row, names.rejected)
        prompt = row.data.get(names.prompt)
        if isinstance(prompt, list):  # TRL conversational: the prompt's messages, then each side's reply
            prompt_msgs = self._messages(row, names.prompt)
            k = len(prompt_msgs)
            if k and chosen_msgs[:k] == prompt_msgs and rejected_msgs[:k] == prompt_msgs:
                # full conversations beside their prompt (UltraFeedback's lists with a prompt list): the prompt once
                chosen_msgs, rejected_msgs = chosen_msgs[k:], rejected_msgs[k:]
        else:  # implicit: the shared leading messages are the prompt (a prompt string beside them repeats it)
            n = 0
            while n < min(len(chosen_msgs), len(rejected_msgs)) and chosen_msgs[n] == rejected_msgs[n]:
                n += 1
            if n == 0 and not (isinstance(prompt, str) and prompt.strip()):
                raise self._no_prompt(row)
            prompt_msgs, chosen_msgs, rejected_msgs = chosen_msgs[:n], chosen_msgs[n:], rejected_msgs[n:]
            if n == 0:  # a prompt string beside replies only: the question, as a user turn before them
                prompt_msgs = [{"role": "user", "content": prompt}]
        return self._checked_pair(row, prompt_msgs, chosen_msgs, rejected_msgs)

    def _checked_pair(self, row: Row, prompt_msgs: list, chosen_msgs: list, rejected_msgs: list) -> tuple[Rendered, Rendered]:
        """Both sides rendered after the prompt; DataError for a side without an assistant reply, or equal sides."""
        names = self.names
        for side, msgs in ((names.chosen, chosen_msgs), (names.rejected, rejected_msgs)):
            if not any(m["role"] == "assistant" and (m["content"].strip() or m.get("tool_calls")) for m in msgs):
                raise DataError(f"{row.where}: the {side} side has no assistant reply after the prompt")
        if chosen_msgs == rejected_msgs:
            raise DataError(f"{row.where}: chosen and rejected are identical: there is no preference to learn")
        return self._render(prompt_msgs, chosen_msgs, row), self._render(prompt_msgs, rejected_msgs, row)

    def _no_prompt(self, row: Row) -> DataError:
        """A pair without a prompt: no prompt field, and chosen and rejected share no beginning to take as one."""
        return DataError(
            f"{row.where}: no prompt: the row has no {self.names.prompt!r} field (fields: {sorted(row.data)}) and chosen "
            "and rejected share no beginning to take as the prompt; name the prompt's field with data.fields.prompt "
            "(e.g. data.fields: {prompt: question})"
        )

    def _messages(self, row: Row, key: str) -> list[dict[str, Any]]:
        """The messages under ``key``: a list, or a single message (one turn)."""
        raw = row.data[key]
        return conversation(Row({MESSAGES: [raw] if isinstance(raw, dict) else raw}, f"{row.where} ({key})"), MESSAGES,
                            self.tool_role)

    def _render(self, prompt: list[dict[str, Any]], reply: list[dict[str, Any]], row: Row) -> Rendered:
        """The conversation rendered once, with the row's tool definitions; learned: the assistant turns of
        ``reply`` only (a judged reply is learned whole: a ``weight`` does not apply to it)."""
        messages, tools = prompt + reply, row_tools(row)
        text = self.chat.render(messages, row.where, tools=tools)
        spans = self.chat.locate(messages, text, row.where, tools)
        earlier = sum(m["role"] == "assistant" for m in prompt)  # context, not the reply being judged
        return Rendered(text, spans[earlier:], False, row.where)


# Where a reply begins in plain-text transcripts: Anthropic HH's turns, Vicuna's, alpaca's response header
ASSISTANT_MARKERS = ("\n\nAssistant:", "\nAssistant:", "ASSISTANT:", "### Response:")


def split_shared_prefix(chosen: str, rejected: str) -> tuple[str, str, str]:
    """(prompt, chosen reply, rejected reply) of two full texts that share their prompt.

    The prompt ends after the last assistant marker of the longest common prefix (HH's ``\n\nAssistant:``),
    so a reply that starts with the same words on both sides (" I think it is 4." / " I think it is 5.") is
    learned whole, as the sides' NLL, per-token means and KTO examples need; without a marker it is the common
    prefix cut back to before the whitespace that starts the first differing word. Either way a reply keeps its
    leading space, as byte-level BPE tokenizes it (" Sure" is one token)."""
    n = 0
    for a, b in zip(chosen, rejected):
        if a != b:
            break
        n += 1
    marked = max((chosen.rfind(m, 0, n) + len(m) for m in ASSISTANT_MARKERS if chosen.rfind(m, 0, n) >= 0), default=0)
    if marked:
        n = marked
    elif n < min(len(chosen), len(rejected)) or len(chosen) != len(rejected):
        while n > 0 and not chosen[n - 1].isspace():
            n -= 1
        while n > 0 and chosen[n - 1].isspace():
            n -= 1
    return chosen[:n], chosen[n:], rejected[n:]


def _check_sides(where: str, chosen: str, rejected: str, names: FieldNames) -> None:
    if chosen == rejected:  # before emptiness: two identical full texts leave two empty replies
        raise DataError(f"{where}: chosen and rejected are identical: there is no preference to learn")
    for side, text in ((names.chosen, chosen), (names.rejected, rejected)):
        if not text.strip():
            raise DataError(f"{where}: the {side} reply is empty")


def _text(prompt: str, reply: str, where: str) -> Rendered:
    text = prompt + reply
    return Rendered(text, [(len(prompt), len(text))], True, where)


def tokenize_pairs(
    pairs: list[tuple[Rendered, Rendered]], tokenizer, max_length: int, labels: list[bool] | None = None
) -> TokenizedChunk:
    """Tokenize each pair as two stored sequences, chosen then rejected (``packing.pair_rows`` reads them so).

    Both sides of a pair go into one row of ``max_length`` inputs, so each side keeps at most
    ``max_length // 2 + 1`` tokens (its start: the prompt and the reply's beginning). A pair where either
    side has nothing left to learn is dropped whole (counted in ``dropped_masked``): a pair is never split.
    ``labels``: one per pair, kept beside both of its sequences (``TokenizedChunk.desirable``)."""
    out = TokenizedChunk(np.empty(0, np.int64), np.empty(0, np.uint8), np.empty(0, np.int64))
    ids, learn, lengths, kept = [], [], [], []
    for k, (chosen, rejected) in enumerate(pairs):
        # text sides get the tokenizer's special tokens; chat-templated ones carry their own (as SFT renders them)
        chunk = tokenize_rendered([chosen, rejected], tokenizer, max_length // 2, "truncate", special_tokens=chosen.add_eos)
        out.truncated += chunk.truncated
        out.lost_tokens += chunk.lost_tokens
        if len(chunk.lengths) != 2:  # a side lost every learned token to truncation
            out.dropped_masked += 1
            continue
        ids.append(chunk.ids)
        learn.append(chunk.learn)
        lengths.append(chunk.lengths)
        kept.append(k)
    if ids:
        out.ids, out.learn, out.lengths = np.concatenate(ids), np.concatenate(learn), np.concatenate(lengths)
        out.continues = np.zeros(len(out.lengths), dtype=bool)
    if labels is not None:
        out.desirable = np.repeat(np.asarray([labels[k] for k in kept], dtype=bool), 2)
    return out


def kl_sample(example: Rendered, other: Rendered) -> Rendered:
    """``example``'s prompt followed by ``other``'s completion (and what its template puts after it): a
    mismatched pair, whose log-ratio estimates KL(policy || reference) for KTO's reference point."""
    start = example.spans[0][0]
    o_start, o_end = other.spans[0]
    text = example.text[:start] + other.text[o_start:]
    return Rendered(text, [(start, start + o_end - o_start)], other.add_eos, example.where)


def kl_partners(prompts: list[str]) -> list[int]:
    """Per example, the example whose completion its KL sample takes: the next one (cyclically) with another
    prompt, so the sample is mismatched (a split pair's two examples, or rows of one prompt, sit side by side);
    the next one only where every example has the same prompt."""
    n = len(prompts)
    run_end = [n] * n  # the first index after i with another prompt, or n
    for i in range(n - 2, -1, -1):
        run_end[i] = run_end[i + 1] if prompts[i + 1] == prompts[i] else i + 1
    out = []
    for i in range(n):
        if run_end[i] < n:
            out.append(run_end[i])
        elif prompts[0] != prompts[i]:
            out.append(0)
        else:  # the last run has the first run's prompt: past the first run, or the next one if that is all
            out.append(run_end[0] if run_end[0] < n else (i + 1) % n)
    return out


def tokenize_unpaired(items: list[tuple[Rendered, bool]], tokenizer, max_length: int) -> TokenizedChunk:
    """KTO examples as pairs of sequences: the example, then its KL sample (its prompt with the completion of the
    next example with another prompt, cyclically within the chunk: ``kl_partners``), with each example's label
    (``tokenize_pairs``)."""
    rendered = [r for r, _ in items]
    partners = kl_partners([r.text[: r.spans[0][0]] for r in rendered])
    pairs = [(r, kl_sample(r, rendered[j])) for r, j in zip(rendered, partners)]
    return tokenize_pairs(pairs, tokenizer, max_length, [label for _, label in items])
