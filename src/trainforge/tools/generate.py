"""``trainforge generate``: the command around ``model.generate.generate`` (the model operation):
what to load, how to read the prompt or the chat turns, which chat template renders them.

``--chat`` reads the conversation from stdin, in either of two layouts:

- JSON: a list of ``{"role": ..., "content": ...}`` messages, or an object with a ``messages`` list;
- text: lines ``role: content`` (roles ``system``, ``user``, ``assistant``); a line without a role
  continues the turn above it, and text with no role at all is one user turn.

The reply is the assistant's next turn, rendered with the run's ``data.chat_template``, else the
tokenizer's, else trainforge's ChatML-style default: the template the model was trained with.

Encoder-decoder models (T5, BART, ...) read the prompt with their encoder, tokenized as training
tokenized sources (EOS-terminated; a run's ``data.max_length`` cuts it, keeping EOS, as training
did), and the streamed text is their decoder's. ``--chat`` maps the turns as training mapped chat
rows: the conversation rendered with the template and its generation prompt is the source, and the
decoder writes the assistant's reply (it learned the reply's content and EOS, no end-of-turn marker).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import torch

from ..config.run import ConfigError
from ..data.chat import ChatLocator
from ..data.formats import DEFAULT_CHAT_TEMPLATE
from ..data.prompt import fit_context, prompt_ids
from ..data.sources import DataError
from ..hardware.device import PRECISIONS, configure_backends, pick_device, resolve_precision
from ..metrics.console import ConsoleReporter
from ..model.generate import context_room, generate
from ..model.resolve import ModelSource, load_model, load_source_tokenizer, resolve_source, run_precision

ROLES = ("system", "user", "assistant")
_ROLE_LINE = re.compile(rf"^({'|'.join(ROLES)})\s*:\s?(.*)$", re.IGNORECASE)
CHATML_END = "<|im_end|>"


def read_chat(text: str) -> list[dict[str, str]]:
    """Chat turns from ``--chat``'s stdin (see the module docstring); DataError when malformed."""
    stripped = text.strip()
    if not stripped:
        raise DataError("--chat: stdin is empty; give the conversation as JSON messages or lines 'user: ...'")
    if stripped[0] in "[{":
        try:
            data = json.loads(stripped)
        except json.JSONDecodeError as e:
            raise DataError(f"--chat: stdin looks like JSON but does not parse: {e}") from None
        messages = data.get("messages") if isinstance(data, dict) else data
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages
        ):
            raise DataError('--chat: JSON must be a list of {"role": ..., "content": ...} messages (or {"messages": [...]})')
        turns = [{"role": m["role"], "content": m["content"]} for m in messages]
    else:
        turns = []
        for line in text.splitlines():
            m = _ROLE_LINE.match(line)
            if m:
                turns.append({"role": m.group(1).lower(), "content": m.group(2)})
            elif turns:
                turns[-1]["content"] += "\n" + line
            elif line.strip():
                turns.append({"role": "user", "content": line})
        turns = [{"role": t["role"], "content": t["content"].strip()} for t in turns]
    if not turns:
        raise DataError("--chat: no turns found on stdin")
    if turns[-1]["role"] == "assistant":
        raise DataError("--chat: the last turn is the assistant's; end with a user turn for the model to answer")
    return turns


def chat_template(src: ModelSource, tokenizer) -> tuple[str, list[str] | None]:
    """(template, stop strings): the template the model was trained with, and the end-of-turn
    marker to stop at when the template is trainforge's default (its marker is text, not a token)."""
    configured = (src.run_config or {}).get("data", {}).get("chat_template")
    own = configured or getattr(tokenizer, "chat_template", None)
    if own and own != DEFAULT_CHAT_TEMPLATE:  # the default, as a chat run's final/ carries it, stops as below
        return own, None
    end = None if CHATML_END in tokenizer.get_vocab() and tokenizer.convert_tokens_to_ids(CHATML_END) == tokenizer.eos_token_id else [CHATML_END]
    return DEFAULT_CHAT_TEMPLATE, end


def end_of_turn_ids(locator: ChatLocator, tokenizer) -> list[int]:
    """The token a chat template closes an assistant turn with, when it is one special token and not the
    EOS (ChatML's <|im_end|> beside Qwen's <|endoftext|>, Llama 3's <|eot_id|>, Gemma's <end_of_turn>): the
    first token after a rendered reply, if the tokenizer keeps it whole as an added token."""
    marker = "trainforge-reply-end"
    try:
        text = locator.render([{"role": "user", "content": "hi"}, {"role": "assistant", "content": marker}], "--chat")
    except Exception:  # noqa: BLE001 - a template that wants other turns: the EOS list stands alone
        return []
    after = text[text.rfind(marker) + len(marker):] if marker in text else ""
    ids = tokenizer(after, add_special_tokens=False)["input_ids"] if after.strip() else []
    added = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    return [ids[0]] if ids and ids[0] in added and ids[0] != tokenizer.eos_token_id else []


def run_generate(
    source: str | Path,
    prompt: str | None,
    chat: str | None,
    max_new_tokens: int,
    temperature: float,
    seed: int,
    device: str,
    precision: str | None,
    write: Callable[[str], None],
    reporter: ConsoleReporter,
) -> str:
    """Load the model ``source`` names and stream its continuation of ``prompt`` (or its reply to
    the ``chat`` turns) to ``write``; returns the generated text."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    src = resolve_source(source)
    turns = read_chat(chat) if chat is not None else None
    try:
        dev = pick_device(device)
    except ConfigError:
        raise ConfigError(f"--device {device}: CUDA is not available on this machine; use auto or cpu") from None
    if precision is None and run_precision(src) in PRECISIONS:
        prec, why = PRECISIONS[run_precision(src)], "the run's precision (summary.json)"
    else:
        prec, why = resolve_precision(precision or "auto", dev)
    configure_backends(dev)
    reporter.info(f"model: {src.describe()} | {dev} | precision {prec.name} ({why})")
    tokenizer = load_source_tokenizer(src)
    model = load_model(src, dev, prec, vocab_size=len(tokenizer))
    stop, stop_ids = None, []
    text, templated = prompt or "", False
    if turns is not None:
        template, stop = chat_template(src, tokenizer)
        locator = ChatLocator(tokenizer, template)
        text = locator.render(turns, "--chat", generation_prompt=True)  # sandboxed; errors are DataErrors
        stop_ids = end_of_turn_ids(locator, tokenizer)
        templated = True  # the template writes its own special tokens
    if src.encoder_decoder:
        input_ids = encoder_source(src, tokenizer, text, templated, reporter)
        stop = None  # the decoder learned the reply and its EOS; no end-of-turn marker to stop at
        max_new_tokens = decoder_room(model, max_new_tokens, reporter)
    else:
        input_ids, cut = fit_context(
            prompt_ids(tokenizer, text, encoder_decoder=False, templated=templated), context_room(model, max_new_tokens)
        )
        if cut:
            reporter.warn(f"the prompt is {cut} tokens longer than the model's positions leave room for "
                          f"({max_new_tokens} new tokens): it reads the last {input_ids.shape[1]}")
    if input_ids.shape[1] == 0:
        input_ids = input_ids.new_full((1, 1), tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id)
    return generate(
        model, tokenizer, input_ids, max_new_tokens, temperature, seed, write=write,
        autocast=prec.autocast(dev), stop_strings=stop, stop_ids=stop_ids,
    )


def decoder_room(model, max_new_tokens: int, reporter: ConsoleReporter) -> int:
    """``max_new_tokens``, at most what an encoder-decoder's learned decoder positions hold after its start token
    (BART's max_position_embeddings; past it the position table is indexed out of range). T5's relative
    positions declare none: no limit."""
    from ..model.load import positions_in

    positions, learned = positions_in(model.config.to_dict())
    if positions is None or not learned or max_new_tokens < positions:
        return max_new_tokens
    reporter.warn(f"--max-new-tokens {max_new_tokens}: the decoder has {positions} positions (max_position_embeddings), "
                  f"its start token takes one: writing at most {positions - 1}")
    return positions - 1


def encoder_source(src: ModelSource, tokenizer, text: str, templated: bool, reporter: ConsoleReporter) -> torch.Tensor:
    """An encoder-decoder's input (1 x T): ``text`` tokenized as training tokenized sources, cut at the
    run's ``data.max_length`` (keeping EOS) as training cut them, which is said on stderr."""
    limit = (src.run_config or {}).get("data", {}).get("max_length")
    ids = prompt_ids(tokenizer, text, encoder_decoder=True, templated=templated)
    if limit and ids.shape[1] > limit:
        reporter.warn(f"the prompt is {ids.shape[1]} tokens; the run trained on sources of at most data.max_length={limit}: "
                      f"cut to its first {limit - 1} tokens and EOS, as training cut them")
        ids = prompt_ids(tokenizer, text, encoder_decoder=True, templated=templated, max_length=limit)
    return ids
