"""The GRPO check's rollout and its naive reference: a few groups of completions with recorded log-probabilities,
learned from packed through the fused head (the training step's path) and one completion at a time (this module).

The rollout is made, not sampled: fixed token ids, rewards and advantages, one truncated completion masked. Its
reference log-probabilities are recorded as a run records them (the stage's packed pass, spread back onto each
completion); its "rollout" log-probabilities are the policy's own, each token moved by a fixed offset, as after
an optimizer step: ratios far from 1 on both sides, so clipping bites on some tokens and not on others, and far
from the clip edges, so rounding in bf16 cannot flip a token from one side to the other.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from .results import CheckFailed

GROUPS = [(5, [6, 9, 4, 7]), (7, [3, 8, 10, 5])]
"""Per prompt: its tokens and its completions' lengths (a group of ``len`` completions)."""
MASKED = 6  # this completion was cut at max_completion_length: no targets, still counted in the divisors
REWARDS = [1.0, 0.0, 0.5, 0.0, 0.0, 1.0, 0.25, 1.0]
MAX_COMPLETION = 12
CAPACITY = 32  # inputs per packed row: the completions spread over several rows
RECORD_BATCH = 3  # completions per recording micro-batch: packed in another order than the learning batch
OFFSETS = (0.6, -0.02, -0.6, 0.02)  # per completion, cycled: log(pi / pi_old) is about minus this
JITTER = 0.03  # +-, alternating per token with a zero sum: token ratios differ, a completion's mean is its offset
LOSSES = ("grpo", "dr_grpo", "dapo", "gspo")


def settings(loss: str, iterations: int = 2) -> Any:
    """The rl settings the check learns under: temperature 0.7, beta 0.1, clip-higher for dapo."""
    from ...config.rl import RLSettings

    return RLSettings(num_generations=len(GROUPS[0][1]), max_completion_length=MAX_COMPLETION, temperature=0.7, beta=0.1,
                      num_iterations=iterations, loss=loss, epsilon=0.2, epsilon_high=0.28 if loss == "dapo" else None,
                      mask_truncated_completions=True)


def rollout(vocab: int) -> list:
    """The completions (``rl.stage.Doc``) of ``GROUPS``, their advantages group-normalized from ``REWARDS``."""
    from ...rl.stage import Doc, advantages

    gen = torch.Generator().manual_seed(2)
    adv = advantages(np.asarray(REWARDS), len(GROUPS[0][1]), "group")
    docs = []
    for index, (prompt_len, lengths) in enumerate(GROUPS):
        prompt = torch.randint(2, vocab, (prompt_len,), generator=gen).tolist()
        for n in lengths:
            k = len(docs)
            completion = torch.randint(2, vocab, (n,), generator=gen).tolist()
            docs.append(Doc(prompt, completion, finished=k != MASKED, advantage=float(adv[k]), reward=REWARDS[k], each={},
                            masked=k == MASKED, index=index))
    return docs


def offsets(n: int, k: int) -> torch.Tensor:
    """The offset of each of completion ``k``'s ``n`` tokens: ``OFFSETS[k]`` with a jitter summing to zero."""
    jitter = torch.tensor([JITTER if i % 2 == 0 else -JITTER for i in range(n)])
    if n % 2:
        jitter[-1] = 0.0
    return OFFSETS[k % len(OFFSETS)] + jitter


def completion_logps(model: torch.nn.Module, doc, temperature: float, precision, device: torch.device,
                     reference: bool = False) -> torch.Tensor:
    """log pi of ``doc``'s completion tokens, the document alone (no packing), from the model's own logits in
    ``precision``, log-softmax in fp32 at ``temperature``; ``reference``: the adapters off, no gradient."""
    ids = torch.tensor(doc.prompt + doc.completion, device=device)[None]
    with precision.autocast(device):
        if reference:
            with torch.no_grad(), model.disable_adapter():
                logits = model(input_ids=ids).logits[0, :-1].float()
        else:
            logits = model(input_ids=ids).logits[0, :-1].float()
    logp = torch.log_softmax(logits / temperature, -1).gather(1, ids[0, 1:, None]).squeeze(1)
    return logp[len(doc.prompt) - 1 :]


def record(model: torch.nn.Module, docs: list, objective: Any, precision, device: torch.device) -> None:
    """The reference's log-probabilities onto each completion through the stage's own recording pass (packed
    micro-batches of ``RECORD_BATCH``, the fused head, spread back per completion), as a run's rollout records them;
    then each completion's rollout log-probabilities: the policy's, alone and in fp32, moved by ``offsets``."""
    from ...hardware.device import PRECISIONS
    from ...rl.stage import RolloutLoader

    loader = RolloutLoader([], SimpleNamespace(generations=len(GROUPS[0][1])), RECORD_BATCH, seed=0)
    # what ``bind`` gives the recording pass (bind also builds rewards and a sampler, which nothing here needs)
    loader.s, loader.cfg = settings("grpo", iterations=1), SimpleNamespace(train=SimpleNamespace(fused_loss=True))
    loader.model, loader.objective, loader.precision, loader.device = model, objective, precision, device
    loader.capacity = CAPACITY
    loader.record_logps(docs)
    with torch.no_grad():
        for k, d in enumerate(docs):
            if not d.masked:
                own = completion_logps(model, d, loader.s.temperature, PRECISIONS["fp32"], device).cpu()
                d.old = own + offsets(len(d.completion), k)


def naive_loss(model: torch.nn.Module, docs: list, s: Any, precision, device: torch.device) -> torch.Tensor:
    """The loss of ``s.loss`` written out one completion at a time, as the papers (and TRL) define it."""
    low, high = 1 - s.epsilon, 1 + s.clip_high
    terms, tokens = [], 0
    for d in docs:
        if d.masked:
            continue
        logp = completion_logps(model, d, s.temperature, precision, device)
        ref = completion_logps(model, d, s.temperature, precision, device, reference=True)
        log_ratio, a = logp - d.old.to(device), d.advantage
        kl = torch.exp(ref - logp) - (ref - logp) - 1
        if s.loss == "gspo":  # one ratio per completion
            r = torch.exp(log_ratio.mean())
            terms.append(-torch.minimum(r * a, r.clamp(low, high) * a) + s.beta * kl.mean())
            continue
        r = torch.exp(log_ratio)
        term = -torch.minimum(r * a, r.clamp(low, high) * a) + s.beta * kl
        terms.append(term.mean() if s.loss == "grpo" else term.sum())
        tokens += len(term)
    total = torch.stack(terms).sum()
    if s.loss == "dapo":
        return total / tokens
    if s.loss == "dr_grpo":
        return total / (len(docs) * s.max_completion_length)
    return total / len(docs)


def fused_loss(model: torch.nn.Module, docs: list, s: Any, precision, device: torch.device,
               metrics: dict[str, torch.Tensor]) -> torch.Tensor:
    """The training step's loss: the completions packed into rows of ``CAPACITY`` (the stage's collate), the
    objective's sum through the fused head over its divisor."""
    from ...engine.grpo import GRPOObjective
    from ...rl.stage import collate

    objective = GRPOObjective(s, "adapters")
    batch = collate(docs, CAPACITY, [d.index for d in docs]).to(device)
    if batch.input_ids.shape[0] < 2:
        raise CheckFailed("the rollout packed into one row: the check would not cross row boundaries")
    return objective.loss_sum(model, batch, precision, fused=True, metrics=metrics) / objective.units(batch)
