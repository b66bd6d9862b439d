"""The mean reward of greedy completions of held-out prompts: how well a policy does where it did not train."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..model.generate import stop_token_ids
from .prompts import Prompt
from .rollout import Sampling, sample, stream_keys

HELDOUT = 0x484F  # the first part of a held-out sample's key (rl/stage.py's rollouts use another)


def heldout_reward(model: torch.nn.Module, tokenizer, prompts: Sequence[Prompt], rewards: Any, max_new_tokens: int,
                   temperature: float | None = None, samples: int = 1, seed: int = 0,
                   autocast: contextlib.AbstractContextManager | None = None, batch: int = 64) -> float:
    """Mean weighted reward (``rewards``: a RewardSet) of the policy's completions of ``prompts``: one greedy
    completion each (``temperature`` None), or ``samples`` each drawn at ``temperature``, keyed by (``seed``, the
    prompt's position, the sample's number) (the reward the policy itself earns, which is what GRPO raises)."""
    greedy = temperature is None
    s = Sampling(max_new_tokens, temperature or 1.0, stop_ids=tuple(stop_token_ids(model, tokenizer)), greedy=greedy)
    each = 1 if greedy else samples
    keys = stream_keys(HELDOUT, seed, np.repeat(np.arange(len(prompts)), each), np.tile(np.arange(each), len(prompts)))
    per_call = max(1, batch // each)  # prompts a call samples: its completions share their prompt's prefill
    totals: list[float] = []
    for i in range(0, len(prompts), per_call):
        part = prompts[i : i + per_call]
        out = sample(model, [p.ids for p in part], s, keys[i * each : (i + len(part)) * each], tokenizer.pad_token_id,
                     autocast, group=each)
        texts = [tokenizer.decode(c, skip_special_tokens=True) for c in out.tokens]
        flat = [p for p in part for _ in range(each)]
        totals += rewards.score([p.text for p in flat], texts, [p.fields for p in flat], [p.where for p in flat]).total
    return float(np.mean(totals))
