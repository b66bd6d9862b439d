"""Rows -> token sequences with loss masks.

Every format renders a row to one string plus the character spans whose tokens are
learned. The tokenizer's offsets then decide, token by token, what carries loss: no
searching for marker strings, so a prompt that happens to contain "### Response:" or an
assistant header cannot confuse the mask.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..config.data import DataSettings, FieldNames
from .chat import ChatLocator
from .chat_messages import SHAREGPT_FIELD, conversation, learned_turns, tool_role_of
from .chat_tools import row_tools
from .sources import DataError, Row

IGNORE = -100
FORMATS = ("text", "prompt_completion", "chat", "alpaca", "source_target")
SOURCE_TARGET = ("source", "target")  # {"source", "target"} rows; {"input", "output"} (data.fields names) read alike

# Used when the tokenizer has no chat template: ChatML-style turns. The assistant's turn,
# including its closing "<|im_end|>", is what gets learned. Tool calls (OpenAI's layout, or HF's
# with the function's fields at the top) are written as Hermes and Qwen2.5 write them, one
# <tool_call> JSON object each after the content; a row without calls renders as it always did. A row's tool
# definitions (``tools``) go into the system turn, after its content, one JSON object per line in <tools>, as
# Qwen2.5 writes them: the model sees what it may call.
DEFAULT_CHAT_TEMPLATE = (
    "{% set merged = tools and messages and messages[0]['role'] == 'system' %}"
    "{% if tools %}<|im_start|>system\n{% if merged %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "<tools>\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools><|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if not (merged and loop.first) %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['tool_calls'] is defined and m['tool_calls'] %}"
    "{% if m['content'] %}{{ m['content'] }}\n{% endif %}"
    "{% for call in m['tool_calls'] %}{% set f = call['function'] if call['function'] is defined else call %}"
    "<tool_call>\n{\"name\": {{ f['name'] | tojson }}, \"arguments\": "
    "{% if f['arguments'] is string %}{{ f['arguments'] }}{% else %}{{ f['arguments'] | tojson }}{% endif %}}\n</tool_call>"
    "{% if not loop.last %}\n{% endif %}{% endfor %}"
    "{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Alpaca rows become a prompt/completion pair with this prompt.
ALPACA_PROMPT = "### Instruction:\n{instruction}\n\n### Response:\n"
ALPACA_PROMPT_WITH_INPUT = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"


@dataclass
class Pair:
    """A row as an encoder-decoder example: the source the encoder reads and the target the decoder
    learns (None: the row has nothing to learn, e.g. a chat without an assistant turn)."""

    source: str
    target: str | None
    where: str
    templated: bool = False  # the source is a chat template's render, with its own special tokens


@dataclass
class Rendered:
    """A row as text; ``spans`` are the learned character ranges (None: every token)."""

    text: str
    spans: list[tuple[int, int]] | None
    add_eos: bool
    where: str


def format_fields(fmt: str, names: FieldNames) -> tuple[str, ...]:
    return {
        "text": (names.text,),
        "prompt_completion": (names.prompt, names.completion),
        "chat": (names.messages,),
        "alpaca": (names.instruction, names.output),
        "source_target": (*SOURCE_TARGET, names.input, names.output),  # either pair (see source_target_keys)
        "preference": (names.prompt, names.chosen, names.rejected),  # data/preference.py reads each layout
        # KTO's labelled rows, or pairs split into a desirable and an undesirable example (data/preference.py)
        "unpaired": (names.prompt, names.completion, names.messages, names.chosen, names.rejected),
    }[fmt]


def source_target_keys(row: Row, names: FieldNames) -> tuple[str, str] | None:
    """The (source, target) fields of a source/target row: ``source``/``target``, else ``input``/``output``."""
    for keys in (SOURCE_TARGET, (names.input, names.output)):
        if all(k in row.data for k in keys):
            return keys
    return None


def detect_format(row: Row, names: FieldNames) -> str:
    """The format whose fields the row has (preference pairs, chat, alpaca, prompt/completion, then text)."""
    if names.chosen in row.data and names.rejected in row.data:
        # TRL's {prompt, chosen, rejected}, the implicit-prompt {chosen, rejected}, LLaMA-Factory's {conversations,
        # chosen: message, rejected: message} (data/preference.py)
        return "preference"
    if isinstance(row.data.get(names.label), bool) and (
        names.completion in row.data or names.messages in row.data or SHAREGPT_FIELD in row.data
    ):
        return "unpaired"  # KTO: TRL's {prompt, completion, label} or LLaMA-Factory's {messages | conversations, label}
    if SHAREGPT_FIELD in row.data and isinstance(row.data[SHAREGPT_FIELD], list):
        return "chat"  # ShareGPT: {"conversations": [{"from", "value"}, ...]}
    if conversational_prompt(row, names):
        return "chat"  # TRL's conversational prompt/completion: {"prompt": [messages], "completion": [messages]}
    for fmt in ("chat", "alpaca", "prompt_completion", "text"):
        if all(k in row.data for k in format_fields(fmt, names)):
            return fmt
    if source_target_keys(row, names) is not None:  # after text: a corpus row may name its "source"
        return "source_target"
    hint = suggested_fields(row)
    raise DataError(
        f"{row.where}: cannot tell the data format from fields {sorted(row.data)}; "
        + (f"they look like {hint}. The formats read: " if hint else "expected ")
        + f"'{names.text}' (text), '{names.prompt}'+'{names.completion}', '{names.messages}' or '{SHAREGPT_FIELD}' (chat), "
        f"'{names.instruction}'+'{names.output}' (alpaca) or 'source'+'target' / '{names.input}'+'{names.output}' "
        f"(source_target), '{names.chosen}'+'{names.rejected}' (preference), '{names.completion}'/'{names.messages}'+'{names.label}' "
        "(unpaired); or set data.format / data.fields"
    )


# common column names of public datasets -> the data.fields setting that reads them (first match wins)
FIELD_ALIASES = (
    ("Dolly-style instruction data", ("instruction", "response"), {"output": "response", "input": "context"}),
    ("instruction data", ("instruction", "answer"), {"output": "answer", "input": "context"}),
    ("StackExchange-paired preference pairs", ("response_j", "response_k"),
     {"prompt": "question", "chosen": "response_j", "rejected": "response_k"}),
    ("preference pairs", ("chosen_response", "rejected_response"), {"chosen": "chosen_response", "rejected": "rejected_response"}),
    ("question/answer data", ("question", "answer"), {"prompt": "question", "completion": "answer"}),
    ("CNN/DailyMail-style summarization data", ("article", "highlights"), {"prompt": "article", "completion": "highlights"}),
    ("XSum-style summarization data", ("document", "summary"), {"prompt": "document", "completion": "summary"}),
    ("SAMSum-style summarization data", ("dialogue", "summary"), {"prompt": "dialogue", "completion": "summary"}),
    ("question/response data", ("question", "response"), {"prompt": "question", "completion": "response"}),
    ("query/response data", ("query", "response"), {"prompt": "query", "completion": "response"}),
    ("text data", ("content",), {"text": "content"}),
)


def suggested_fields(row: Row) -> str | None:
    """For a row no format matches: what its columns look like and the ``data.fields`` that reads them, e.g.
    ``Dolly-style instruction data: set data.fields: {output: response, input: context}``; None if unknown."""
    for what, needs, fields in FIELD_ALIASES:
        if fields and all(k in row.data for k in needs):
            shown = {k: v for k, v in fields.items() if v in row.data or k not in ("input",)}
            setting = ", ".join(f"{k}: {v}" for k, v in shown.items())
            return f"{what}: set data.fields: {{{setting}}}"
    return None


def conversational_prompt(row: Row, names: FieldNames) -> bool:
    """Whether the row is TRL's conversational prompt/completion: both fields message lists, no messages field."""
    return (
        names.messages not in row.data
        and isinstance(row.data.get(names.prompt), list)
        and isinstance(row.data.get(names.completion), list)
    )


def chat_messages(row: Row, names: FieldNames, tool_role: str) -> tuple[list[dict[str, Any]], int]:
    """A chat row's messages, and how many of them lead the part to learn: none for a messages (or ShareGPT)
    row; for a conversational prompt/completion row its prompt's messages, followed by its completion's."""
    if not conversational_prompt(row, names):
        return conversation(row, names.messages, tool_role), 0
    prompt, completion = (
        conversation(Row({names.messages: row.data[key]}, f"{row.where} ({key})"), names.messages, tool_role)
        for key in (names.prompt, names.completion)
    )
    return prompt + completion, len(prompt)


def _string(row: Row, key: str, optional: bool = False) -> str:
    if key not in row.data or row.data[key] is None:
        if optional:
            return ""
        raise DataError(f"{row.where}: field {key!r} is " + ("null" if key in row.data else "missing"))
    value = row.data[key]
    if not isinstance(value, str):
        raise DataError(f"{row.where}: field {key!r} must be a string, got {type(value).__name__}")
    return value


def trained_chat_template(fmt: str, data: DataSettings, tokenizer, source_formats: list[str] | None = None) -> str | None:
    """The chat template a run's ``final/`` tokenizer must carry so that any loader (``apply_chat_template``,
    vLLM, ``export``) renders chats as the run trained them: ``data.chat_template`` when set, else the default
    a chat run rendered with because the tokenizer has none; None where the tokenizer's own stands. A mixture
    (``source_formats``: each source's format) carries its first chat source's (its own, or as above)."""
    chats = [k for k, f in enumerate(source_formats or []) if f == "chat"]
    configured = data.for_source(chats[0]).chat_template if chats else data.read_as(0).chat_template
    if configured:
        return configured
    if (chats or fmt == "chat") and not getattr(tokenizer, "chat_template", None):
        return DEFAULT_CHAT_TEMPLATE
    return None


class Renderer:
    """Renders rows of one format; holds the chat template and the prompt-learning switch."""

    def __init__(self, fmt: str, names: FieldNames, tokenizer=None, chat_template: str | None = None, train_on_prompt: bool = False):
        self.fmt, self.names, self.tokenizer, self.train_on_prompt = fmt, names, tokenizer, train_on_prompt
        own = chat_template or getattr(tokenizer, "chat_template", None)
        self.chat_template = own or DEFAULT_CHAT_TEMPLATE
        # the default saved into a chat run's final/ (trained_chat_template) renders tools as it did in that run
        self.tool_role = tool_role_of(self.chat_template, default_template=own in (None, DEFAULT_CHAT_TEMPLATE))
        self.chat = ChatLocator(tokenizer, self.chat_template)

    def __call__(self, row: Row) -> Rendered:
        try:
            if self.fmt == "text":
                return Rendered(_string(row, self.names.text), None, True, row.where)
            if self.fmt == "chat":
                return self._chat(row)
            return self._pair(*self._prompt_completion(row), row.where)
        except DataError as e:
            raise self._other_format(row) or e

    def _other_format(self, row: Row) -> DataError | None:
        """A row of another format than the one the data resolved to (files of two formats in one
        data.train list): said as such, instead of as the format's missing field."""
        try:
            own = detect_format(row, self.names)
        except DataError:
            return None
        if own == self.fmt or not isinstance(row.data, dict):
            return None
        return DataError(
            f"{row.where}: this row is {own} data (fields {sorted(row.data)}), but its source is read as {self.fmt} "
            "(its format, data.format, or its first row when auto): a source reads one format; put the files of "
            "another format in a source of their own (data.train: a list, each source its own format), or convert them"
        )

    def _prompt_completion(self, row: Row) -> tuple[str, str]:
        """(prompt, completion) of a prompt/completion, source/target or alpaca row."""
        n = self.names
        if self.fmt == "prompt_completion":
            return _string(row, n.prompt), _string(row, n.completion)
        if self.fmt == "source_target":
            keys = source_target_keys(row, n)
            if keys is None:
                raise DataError(f"{row.where}: expected fields 'source'+'target' or {n.input!r}+{n.output!r}, got {sorted(row.data)}")
            return _string(row, keys[0]), _string(row, keys[1])
        instruction, extra = _string(row, n.instruction), _string(row, n.input, optional=True)
        template = ALPACA_PROMPT_WITH_INPUT if extra.strip() else ALPACA_PROMPT
        return template.format(instruction=instruction, input=extra), _string(row, n.output)

    def pair(self, row: Row) -> Pair:
        """The row as source -> target for an encoder-decoder model.

        Prompt/completion, source/target and alpaca rows: the prompt (alpaca's, as for decoder-only
        models) is the source, the completion the target. Chat rows: the conversation before the last
        assistant turn, rendered with the chat template and its generation prompt, is the source; that
        turn's content is the target (earlier assistant turns are context, not learned; messages after
        it have no reply to learn and are left out).
        """
        if self.fmt == "text":
            raise DataError(
                f"{row.where}: text rows have no source -> target pair for an encoder-decoder model; use "
                "prompt/completion, source/target, input/output, alpaca or chat rows (data.format)"
            )
        if self.fmt != "chat":
            return Pair(*self._prompt_completion(row), row.where)
        messages, _ = chat_messages(row, self.names, self.tool_role)
        assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        learned = [i for i, learn in zip(assistant, learned_turns(messages)) if learn]  # not those of weight 0
        last = learned[-1] if learned else None
        if last is None:
            return Pair("", None, row.where)
        source = self.chat.render(messages[:last], row.where, generation_prompt=True, tools=row_tools(row))
        return Pair(source, messages[last]["content"], row.where, templated=True)

    def _pair(self, prompt: str, completion: str, where: str) -> Rendered:
        text = prompt + completion
        return Rendered(text, None if self.train_on_prompt else [(len(prompt), len(text))], True, where)

    def _chat(self, row: Row) -> Rendered:
        messages, prompt = chat_messages(row, self.names, self.tool_role)
        tools = row_tools(row)
        text = self.chat.render(messages, row.where, tools=tools)
        if self.train_on_prompt:
            self.chat.written(messages, row.where, tools)
            return Rendered(text, None, False, row.where)
        spans = self.chat.locate(messages, text, row.where, tools)
        earlier = sum(m["role"] == "assistant" for m in messages[:prompt])  # a prompt's assistant turns: context
        # and turns of weight 0 (OpenAI's fine-tuning layout)
        learned = [span for k, (span, learn) in enumerate(zip(spans, learned_turns(messages))) if k >= earlier and learn]
        return Rendered(text, learned, False, row.where)


@dataclass
class TokenizedChunk:
    """Token sequences of a chunk of rows, concatenated, with per-sequence lengths."""

    ids: np.ndarray  # int64, all sequences back to back
    learn: np.ndarray  # uint8, 1 where the token is a target
    lengths: np.ndarray  # int64, tokens per sequence
    # bool per sequence: a split continuation, whose first token is the previous sequence's last
    continues: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))
    desirable: np.ndarray | None = None  # bool per sequence of an unpaired (KTO) store: its example's label
    truncated: int = 0
    dropped_too_long: int = 0
    split: int = 0
    dropped_masked: int = 0
    lost_tokens: int = 0  # tokens cut off by truncation or dropped with too-long examples
    target_truncated: int = 0  # encoder-decoder: targets cut at data.max_target_length (sources count as truncated)
    target_dropped_too_long: int = 0  # ... and examples dropped for a target over it


def _first_token_from(enc, char: int, text: str) -> int:
    """Index of the first token that starts at ``char`` or later (Rust-side look-ups).

    A token straddling ``char`` counts as starting there when all of it before ``char`` is
    whitespace: after Mistral's ``[/INST]`` or Llama 2's ``[/INST]`` the reply's first word is one
    token with the template's space (``▁Rome``), and that token is what the model must produce.
    """
    for c in range(char, len(text)):
        t = enc.char_to_token(c)
        if t is not None:
            start = enc.token_to_chars(t)[0]
            return t if start >= char or text[start:char].isspace() else t + 1
    for c in range(len(text) - 1, -1, -1):  # past the text: just after its last token
        t = enc.char_to_token(c)
        if t is not None:
            return t + 1
    return 0


class _Encoder:
    """Batch encoding straight through the Rust tokenizer when it gives the same ids as the
    transformers wrapper (it skips the wrapper's per-token Python conversions), else the wrapper."""

    def __init__(self, tokenizer, special_tokens: bool):
        self.tokenizer, self.special = tokenizer, special_tokens
        backend = getattr(tokenizer, "backend_tokenizer", None)
        probe = "Hello world\n  def f(x): return x"
        self.backend = (
            backend
            if backend is not None
            and backend.encode(probe, add_special_tokens=special_tokens).ids
            == tokenizer(probe, add_special_tokens=special_tokens)["input_ids"]
            else None
        )

    def __call__(self, texts: list[str], offsets: bool = True) -> list:
        """Encodings of ``texts``; ``offsets=False``: the caller reads only their ids."""
        if self.backend is not None:
            if not offsets and hasattr(self.backend, "encode_batch_fast"):  # tokenizers >= 0.21
                # skips computing each token's character offsets: about 4% of the tokenizer's time
                return self.backend.encode_batch_fast(texts, add_special_tokens=self.special)
            return self.backend.encode_batch(texts, add_special_tokens=self.special)
        return tokenizer_encodings(self.tokenizer, texts, self.special)


def tokenizer_encodings(tokenizer, texts: list[str], special: bool) -> list:
    """Encodings through the transformers wrapper (slow tokenizers have no Rust encodings)."""
    enc = tokenizer(texts, add_special_tokens=special, return_offsets_mapping=True)
    return [_PyEncoding(ids, offs) for ids, offs in zip(enc["input_ids"], enc["offset_mapping"])]


class _PyEncoding:
    def __init__(self, ids: list[int], offsets: list[tuple[int, int]]):
        self.ids, self.offsets = ids, [tuple(o) for o in offsets]

    def char_to_token(self, char: int) -> int | None:
        return next((t for t, (a, b) in enumerate(self.offsets) if a <= char < b), None)

    def token_to_chars(self, token: int) -> tuple[int, int]:
        return self.offsets[token]


_ENCODERS: dict[tuple[int, bool], _Encoder] = {}


def encoder_for(tokenizer, special_tokens: bool) -> _Encoder:
    """The batch encoder of ``tokenizer`` (with or without its special tokens), made once per process."""
    key = (id(tokenizer), special_tokens)
    if key not in _ENCODERS:
        _ENCODERS[key] = _Encoder(tokenizer, special_tokens)
    return _ENCODERS[key]


def tokenize_rendered(
    items: Sequence[Rendered], tokenizer, max_length: int, too_long: str, special_tokens: bool = True
) -> TokenizedChunk:
    """Tokenize, mark learned tokens from the span boundaries' token offsets, apply the too-long policy.

    Each stored sequence holds up to ``max_length + 1`` tokens: inputs are all but the last,
    targets all but the first.
    """
    eos = tokenizer.eos_token_id
    chunk = TokenizedChunk(np.empty(0, np.int64), np.empty(0, np.uint8), np.empty(0, np.int64))
    if not items:
        return chunk
    spans = any(r.spans is not None for r in items)  # offsets place the span boundaries; plain text has none
    encodings = encoder_for(tokenizer, special_tokens)([r.text for r in items], offsets=spans)
    out_ids, out_learn, lengths, continues = [], [], [], []
    limit = max_length + 1
    for r, enc in zip(items, encodings):
        ids = np.asarray(enc.ids, dtype=np.int64)
        if r.spans is None:
            learn = np.ones(len(ids), dtype=bool)
        else:
            learn = np.zeros(len(ids), dtype=bool)
            for a, b in r.spans:
                learn[_first_token_from(enc, a, r.text) : _first_token_from(enc, b, r.text)] = True
        if r.add_eos and eos is not None and (len(ids) == 0 or ids[-1] != eos):
            ids = np.append(ids, eos)
            learn = np.append(learn, r.spans is None or bool(learn[-1]) if len(learn) else True)
        pieces = [(ids, learn)]
        if len(ids) > limit:
            if too_long == "drop":
                chunk.dropped_too_long += 1
                chunk.lost_tokens += len(ids)
                continue
            if too_long == "split":
                # Blocks of max_length + 1 tokens overlapping by one: a block's first token is the
                # previous block's last, so in a row of its own (packing true/false) it is an input
                # there and a target here, and every token after the first is a target once. A
                # concat stream is continuous, so it skips that repeated token (``continues``).
                pieces = [(ids[s : s + limit], learn[s : s + limit]) for s in range(0, len(ids) - 1, max_length)]
                chunk.split += 1
            else:
                pieces = [(ids[:limit], learn[:limit])]
                chunk.truncated += 1
                chunk.lost_tokens += len(ids) - limit
        kept = False  # whether the previous piece of this document was stored
        for p, (p_ids, p_learn) in enumerate(pieces):
            if len(p_ids) < 2 or not p_learn[1:].any():  # nothing to learn: a prompt filled the row
                chunk.dropped_masked += 1
                kept = False
                continue
            out_ids.append(p_ids)
            out_learn.append(p_learn)
            lengths.append(len(p_ids))
            continues.append(p > 0 and kept)
            kept = True
    if out_ids:
        chunk.ids = np.concatenate(out_ids)
        chunk.learn = np.concatenate(out_learn).astype(np.uint8)
        chunk.lengths = np.asarray(lengths, dtype=np.int64)
        chunk.continues = np.asarray(continues, dtype=bool)
    return chunk
