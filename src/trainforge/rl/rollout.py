"""Batched sampling with a KV cache from the policy's own weights: token ids in, completions' token ids out.

One prefill over the left-padded prompts (once per prompt: the ``group`` completions of a prompt share its
prefill, whose cache and last logits are repeated to each), then one token per step for the rows still running; a row that
samples an end token leaves the batch (its cache rows are dropped), so finished rows cost nothing more. A LoRA
model samples with its adapters on, unmerged: the same weights the step trains.

Randomness is per completion, not per batch: the caller gives each completion a 64-bit key (``stream_keys``, e.g.
from the run seed, the epoch, the prompt's index and the sample's number), and the draw of its t-th token reads one
uniform number that only (key, t) decides (a splitmix64 counter), through the inverse of the filtered distribution's
cumulative mass. So a completion is the same whichever batch, batch position or process samples it, and a resumed
run that knows its prompts' keys samples the same tokens with no generator state to save.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class Sampling:
    """How tokens are drawn: ``temperature`` scales the logits; ``top_k`` (0: off), ``top_p`` (1: off) and ``min_p``
    (0: off) cut the distribution before the draw; ``stop_ids`` end a completion (kept as its last token)."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    stop_ids: tuple[int, ...] = ()
    greedy: bool = False  # the most likely token every time (held-out evaluation); no draw


@dataclass
class Completions:
    """Each prompt's new tokens (a stop token included where one ended it) and whether a stop token ended it."""

    tokens: list[list[int]]
    finished: list[bool]


def filter_logits(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """(B, V) fp32 logits at temperature 1 -> the logits sampling draws from (cut tokens at -inf)."""
    logits = logits / s.temperature
    if s.top_k and s.top_k < logits.shape[-1]:
        kth = torch.topk(logits, s.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if s.min_p > 0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < s.min_p * probs.max(dim=-1, keepdim=True).values, float("-inf"))
    if s.top_p < 1:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        mass = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        drop = mass - torch.softmax(sorted_logits, dim=-1) >= s.top_p  # the mass before a token already reaches top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # splitmix64's increment: 2^64 / the golden ratio


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: a bijection of 64-bit words that spreads every input bit over the output."""
    with np.errstate(over="ignore"):  # uint64 products wrap by design
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def stream_keys(*parts: int | Sequence[int] | np.ndarray) -> np.ndarray:
    """One 64-bit key per completion from integer ``parts`` (scalars or equal-length sequences, broadcast), folded
    in order: the key alone decides every draw of its completion."""
    key = np.zeros((), dtype=np.uint64)
    for part in parts:
        with np.errstate(over="ignore"):
            key = _mix((key + _GOLDEN) ^ np.asarray(part, dtype=np.int64).astype(np.uint64))
    return np.atleast_1d(key)


def uniforms(keys: np.ndarray, steps: int) -> torch.Tensor:
    """(len(keys), steps) float32 in [0, 1): the uniform number behind each completion's t-th token (24 bits: exact
    in float32), from (key, t) alone."""
    t = np.arange(1, steps + 1, dtype=np.uint64)
    with np.errstate(over="ignore"):
        words = _mix(np.asarray(keys, dtype=np.uint64)[:, None] + t * _GOLDEN)
    return torch.from_numpy((words >> np.uint64(40)).astype(np.float32) * np.float32(2.0**-24))


def draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """(B, V) probabilities and (B,) uniforms -> (B,) tokens: the first whose cumulative mass passes u x the total.
    Each row reads only its own values, so a row draws alike in any batch; a cut token (no mass) is never drawn."""
    cdf = probs.cumsum(-1)
    picked = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
    # u x total can round up to the total itself: stop at the last token that has mass
    last = probs.shape[-1] - 1 - (probs.flip(-1) > 0).int().argmax(-1)
    return torch.minimum(picked, last)


@torch.no_grad()
def sample(model: torch.nn.Module, prompts: Sequence[Sequence[int]], s: Sampling, keys: Sequence[int] | np.ndarray | None,
           pad_id: int, autocast: contextlib.AbstractContextManager | None = None, group: int = 1) -> Completions:
    """Sample ``group`` completions for each of ``prompts`` (token ids), prompt by prompt (prompt i's are rows
    i x group ... i x group + group - 1); ``keys`` (one per completion, ``stream_keys``) decide their draws (None:
    greedy sampling needs none). The same completions as each prompt repeated ``group`` times, with one prefill."""
    device = next(model.parameters()).device
    n = len(prompts) * group
    if not s.greedy:
        if keys is None or len(keys) != n:
            raise ValueError(f"sample: one key per completion ({n}), got {None if keys is None else len(keys)}")
        u = uniforms(np.asarray(keys), s.max_new_tokens).to(device)
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):  # left padding: every row's next token goes to the same column
        ids[i, width - len(p):] = torch.as_tensor(list(p), dtype=torch.long)
        mask[i, width - len(p):] = 1
    ids, mask = ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    stops = torch.tensor(list(s.stop_ids) or [-1], device=device)
    tokens: list[list[int]] = [[] for _ in range(n)]
    finished = [False] * n
    alive = torch.arange(n, device=device)  # the completion index of each row still in the batch
    was_training = model.training
    model.eval()  # no dropout while sampling
    try:
        with autocast or contextlib.nullcontext(), stock_attention(model):
            from transformers import DynamicCache

            cache = DynamicCache()
            out = model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True,
                        **last_logits_only(model))
            logits, last = out.logits[:, -1, :], positions[:, -1]
            if group > 1:  # each prompt's rows share its prefill: its keys and values, repeated to every completion
                cache.batch_repeat_interleave(group)
                logits, mask, last = (t.repeat_interleave(group, dim=0) for t in (logits, mask, last))
            del out
            for step in range(s.max_new_tokens):
                if s.greedy:
                    picked = logits.argmax(-1)
                else:
                    probs = torch.softmax(filter_logits(logits.float(), s), dim=-1)
                    picked = draw(probs, u[alive, step])
                done = torch.isin(picked, stops)
                host_picked, host_done, host_alive = picked.tolist(), done.tolist(), alive.tolist()  # one sync per token
                for row, (tok, end) in enumerate(zip(host_picked, host_done)):
                    tokens[host_alive[row]].append(tok)
                    finished[host_alive[row]] = end
                if step + 1 == s.max_new_tokens:
                    break
                if any(host_done):  # finished rows leave the batch, and their cache with them
                    keep = (~done).nonzero().squeeze(1)
                    if len(keep) == 0:
                        break
                    cache.batch_select_indices(keep)
                    picked, mask, last, alive = picked[keep], mask[keep], last[keep], alive[keep]
                mask = torch.cat([mask, mask.new_ones(len(mask), 1)], dim=1)
                last = last + 1
                logits = model(input_ids=picked[:, None], attention_mask=mask, position_ids=last[:, None],
                               past_key_values=cache, use_cache=True).logits[:, -1, :]
    finally:
        model.train(was_training)
    return Completions(tokens, finished)


def last_logits_only(model: torch.nn.Module) -> dict[str, int]:
    """The prefill's keyword for logits at the last position only (``logits_to_keep``, where the model takes it):
    the draw reads no other, and rows x prompt x vocabulary logits would be the rollout's largest tensor."""
    import inspect

    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT passes it through
    return {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(base.forward).parameters else {}


@contextlib.contextmanager
def stock_attention(model: torch.nn.Module):
    """transformers' SDPA while sampling: the packed-document paths (model/packed_attention.py, doc_attention.py)
    build no padding mask, and a left-padded row decoding from its cache must not see its padding."""
    config = model.config
    before = config._attn_implementation
    if before in ("sdpa", "eager", "flash_attention_2", "flash_attention_3"):
        yield
        return
    config._attn_implementation = "sdpa"
    try:
        yield
    finally:
        config._attn_implementation = before
