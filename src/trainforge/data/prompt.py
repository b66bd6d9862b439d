"""A prompt as a model reads it, tokenized as training tokenized, and the sample that continues it (``model.generate`` takes the ids).

Decoder-only models: the tokenizer's encoding with its special tokens (a chat template's render
without them: it writes its own), as training tokenized text. Encoder-decoder models (T5, BART, ...):
the prompt is a source, tokenized as training stored sources (``seq2seq.source_tokens``:
EOS-terminated, cut at the source limit keeping EOS).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from ..model.generate import context_room, is_encoder_decoder, sample
from .seq2seq import source_tokens


def prompt_ids(tokenizer, text: str, encoder_decoder: bool, templated: bool = False, max_length: int | None = None) -> torch.Tensor:
    """``text`` as the model reads it (1 x T). ``templated``: a chat template's render (no special
    tokens added). ``max_length``: an encoder-decoder's source limit (training's ``data.max_length``)."""
    if encoder_decoder:
        return torch.tensor([source_tokens(tokenizer, text, templated, max_length)])
    return tokenizer(text, return_tensors="pt", add_special_tokens=not templated)["input_ids"]


def fit_context(ids: torch.Tensor, room: int | None) -> tuple[torch.Tensor, int]:
    """The last ``room`` tokens of a prompt (1 x T) that would not leave the model room to write: (ids, tokens cut)."""
    if room is None or ids.shape[1] <= room:
        return ids, 0
    return ids[:, -room:], ids.shape[1] - room


def sample_prompt(
    model, tokenizer, prompt: str, max_new_tokens: int = 64, seed: int = 0, temperature: float = 0.8,
    autocast: contextlib.AbstractContextManager | None = None, stop: Callable[[], bool] | None = None,
) -> str:
    """The end-of-run sample: ``prompt`` tokenized as training tokenized (its end, when it is longer than
    the model's positions leave room for), continued with seeded top-k sampling (``model.generate.sample``);
    returns prompt + continuation (an encoder-decoder: the decoder's reply to ``prompt``). ``stop``: end early."""
    ids, _ = fit_context(prompt_ids(tokenizer, prompt, is_encoder_decoder(model)), context_room(model, max_new_tokens))
    return sample(model, tokenizer, ids, max_new_tokens, seed, temperature, autocast, stop)
