"""Text from a model, given token ids: the end-of-run sample (``sample``) and ``trainforge generate`` (``generate``, streamed).

Callers tokenize, through the data package (``data.prompt``: as training tokenized). A decoder-only
model continues its prompt's ids; an encoder-decoder model (T5, BART, ...) reads them with its
encoder (a source, as training stored sources), and the text is its decoder's output, which starts
from the model's decoder start token."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch
from transformers import StoppingCriteriaList


def is_encoder_decoder(model) -> bool:
    """The model (or the PEFT model around it) is an encoder-decoder: its decoder writes the text."""
    return bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False))


def context_room(model, max_new_tokens: int) -> int | None:
    """How many prompt tokens a decoder-only model can read and still write ``max_new_tokens`` within its
    positions (None: no limit known, or an encoder-decoder, whose source limit is the run's)."""
    from .load import positions_in

    config = getattr(model, "config", None)
    positions = positions_in(config.to_dict())[0] if config is not None else None
    if is_encoder_decoder(model) or positions is None:
        return None
    return max(1, positions - max_new_tokens)


class _StopWhen:
    """A transformers stopping criterion that ends generation between tokens once ``requested()`` is true
    (a SIGTERM during the end-of-run sample must not wait for the sample)."""

    def __init__(self, requested: Callable[[], bool]):
        self.requested = requested

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), self.requested(), dtype=torch.bool, device=input_ids.device)


@torch.no_grad()
def sample(
    model, tokenizer, input_ids: torch.Tensor, max_new_tokens: int = 64, seed: int = 0, temperature: float = 0.8,
    autocast: contextlib.AbstractContextManager | None = None, stop: Callable[[], bool] | None = None,
) -> str:
    """Continue ``input_ids`` (1 x T) with seeded top-k sampling; returns prompt + continuation (an
    encoder-decoder: the decoder's reply to its input). ``autocast``: the run's precision context (a
    bf16 frozen base needs it, as training did). ``stop``: end early once it returns true. Text is
    tokenized by ``data.prompt.sample_prompt``.
    """
    device = next(model.parameters()).device
    ids = input_ids.to(device)
    enc = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    was_training = model.training
    model.eval()
    torch.manual_seed(seed)
    with autocast or contextlib.nullcontext():
        out = model.generate(
            **enc,
            max_new_tokens=max_new_tokens,
            do_sample=True,
            temperature=temperature,
            top_k=50,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=stop_token_ids(model, tokenizer),
            use_cache=True,
            **({"stopping_criteria": StoppingCriteriaList([_StopWhen(stop)])} if stop is not None else {}),
        )
    model.train(was_training)
    return tokenizer.decode(out[0], skip_special_tokens=True)


def stop_token_ids(model, tokenizer, extra: Sequence[int] = ()) -> list[int]:
    """Tokens that end generation: the tokenizer's EOS, every EOS of the model's generation_config (Llama 3
    and Qwen 2.5 list their end-of-turn token there beside <|end_of_text|> / <|endoftext|>), and ``extra``.
    Passing the tokenizer's EOS alone would override the generation_config's list."""
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids: list[int] = []
    for value in (tokenizer.eos_token_id, configured, list(extra)):
        ids += value if isinstance(value, list) else [] if value is None else [int(value)]
    return list(dict.fromkeys(ids))


def text_streamer(tokenizer, write: Callable[[str], None]):
    """A transformers streamer that hands each finished piece of the new text to ``write``
    (whole words at a time, as ``TextStreamer`` decides) instead of printing it."""
    from transformers import TextStreamer

    class Sink(TextStreamer):
        def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
            if text:
                write(text)

    return Sink(tokenizer, skip_prompt=True, skip_special_tokens=True)


@torch.no_grad()
def generate(
    model,
    tokenizer,
    input_ids: torch.Tensor,
    max_new_tokens: int = 128,
    temperature: float = 0.7,
    seed: int = 0,
    top_k: int = 50,
    write: Callable[[str], None] | None = None,
    autocast: contextlib.AbstractContextManager | None = None,
    stop_strings: list[str] | None = None,
    stop_ids: Sequence[int] = (),
) -> str:
    """Continue ``input_ids`` (1 x T) and return the new text only (an encoder-decoder: ``input_ids`` is
    the encoder's input, and the text the decoder's output).

    ``temperature`` 0: greedy decoding; above 0: seeded top-k sampling. ``write``: called with
    each piece of text as soon as it is decoded (streaming). ``stop_strings``: end the text at
    the first of these (a chat template's end-of-turn marker that is not a single token); ``stop_ids``:
    tokens that end it besides ``stop_token_ids``' (a chat template's end-of-turn token).
    """
    device = next(model.parameters()).device
    input_ids = input_ids.to(device)
    sampling = {"do_sample": True, "temperature": temperature, "top_k": top_k} if temperature > 0 else {"do_sample": False}
    extra = {"stop_strings": stop_strings, "tokenizer": tokenizer} if stop_strings else {}
    torch.manual_seed(seed)
    with autocast or contextlib.nullcontext():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=stop_token_ids(model, tokenizer, stop_ids),
            use_cache=True,
            streamer=text_streamer(tokenizer, write) if write is not None else None,
            **sampling,
            **extra,
        )
    new = out[0] if is_encoder_decoder(model) else out[0, input_ids.shape[1] :]  # the decoder's output holds no prompt
    return tokenizer.decode(new, skip_special_tokens=True)
