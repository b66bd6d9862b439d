"""GRPO's losses against their formulas written naively on unpacked, unfused logits (one completion at a time), in
one micro-batch and in three; the k3 KL estimator; clipping exactly where the formula clips; advantages."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from test_preference import TOL, tiny_llama

from trainforge.config.rewards import RewardSettings
from trainforge.config.rl import RLSettings
from trainforge.engine.grpo import SEQUENCES, GRPOObjective, RolloutBatch, grpo_terms, k3_kl
from trainforge.engine.objective import mean_metrics
from trainforge.engine.step import forward_backward
from trainforge.hardware.device import PRECISIONS
from trainforge.rl.stage import Doc, advantages, collate

FP32 = PRECISIONS["fp32"]
PROMPTS = [[5, 6, 7], [20, 21]]
COMPLETIONS = [  # three completions per prompt (the group), of different lengths
    [[8, 9, 10, 11], [12, 13], [14]],
    [[22, 23], [24, 25, 26, 27, 28], [29, 30, 31]],
]
REWARDS = np.array([1.0, 0.0, 0.5, 0.0, 1.0, 1.0])
MAX_COMPLETION = 6
TEMPERATURE = 0.7


def naive_logps(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """One unpadded sequence through the model's own logits, at the temperature: the completion's log-probabilities."""
    ids = torch.tensor([prompt + completion])
    logits = model(input_ids=ids).logits[0].float() / TEMPERATURE
    logp = torch.log_softmax(logits, dim=-1)
    return torch.stack([logp[len(prompt) - 1 + t, tok] for t, tok in enumerate(completion)])


def models():
    policy = tiny_llama()
    reference = copy.deepcopy(policy).requires_grad_(False)
    rollout = copy.deepcopy(policy).requires_grad_(False)
    with torch.no_grad():  # the policy moved away from its reference, and a little from the rollout's weights
        for p, q in zip(policy.parameters(), rollout.parameters()):
            p.add_(0.05 * torch.randn_like(p))
            q.copy_(p + 0.3 * torch.randn_like(p))
    return policy, reference, rollout


def make_docs(reference, rollout, old: bool, beta: float) -> list[Doc]:
    adv = advantages(REWARDS, 3, "group")
    docs, k = [], 0
    for prompt, group in zip(PROMPTS, COMPLETIONS):
        for completion in group:
            d = Doc(prompt, completion, True, float(adv[k]), float(REWARDS[k]), {}, False)
            with torch.no_grad():
                d.old = naive_logps(rollout, prompt, completion) if old else None
                d.ref = naive_logps(reference, prompt, completion) if beta > 0 else None
            docs.append(d)
            k += 1
    return docs


def naive_loss(policy, docs: list[Doc], s: RLSettings) -> torch.Tensor:
    """The variant's loss over the whole batch, term by term."""
    low, high = 1 - s.epsilon, 1 + s.clip_high
    per_seq, token_terms = [], []
    for d in docs:
        logp = naive_logps(policy, d.prompt, d.completion)
        old = d.old if d.old is not None else logp.detach()
        kl = (torch.exp(d.ref - logp) - (d.ref - logp) - 1) if s.beta > 0 else torch.zeros_like(logp)
        if s.loss == "gspo":
            ratio = torch.exp((logp - old).mean())
            term = -torch.minimum(ratio * d.advantage, torch.clamp(ratio, low, high) * d.advantage)
            per_seq.append(term + s.beta * kl.mean())
            continue
        ratio = torch.exp(logp - old)
        terms = -torch.minimum(ratio * d.advantage, torch.clamp(ratio, low, high) * d.advantage) + s.beta * kl
        per_seq.append(terms.mean())
        token_terms.append(terms)
    if s.loss in ("grpo", "gspo"):
        return torch.stack(per_seq).mean()
    total = torch.cat(token_terms).sum()
    if s.loss == "dr_grpo":
        return total / (len(docs) * s.max_completion_length)
    return total / sum(len(d.completion) for d in docs)  # dapo


def settings(loss: str, beta: float, iterations: int) -> RLSettings:
    return RLSettings(loss=loss, beta=beta, num_iterations=iterations, epsilon=0.2,
                      epsilon_high=0.28 if loss == "dapo" else None, temperature=TEMPERATURE,
                      max_completion_length=MAX_COMPLETION, num_generations=3, rewards=[RewardSettings(name="exact")])


@pytest.mark.parametrize("loss", ["grpo", "dr_grpo", "dapo", "gspo"])
@pytest.mark.parametrize("beta,iterations", [(0.0, 1), (0.1, 2)])
def test_each_loss_is_its_formula_in_one_and_three_micro_batches(loss, beta, iterations):
    policy, reference, rollout = models()
    s = settings(loss, beta, iterations)
    docs = make_docs(reference, rollout, iterations > 1, beta)
    want = naive_loss(policy, docs, s)
    want.backward()
    expected = {k: v.grad.clone() for k, v in policy.named_parameters()}
    objective = GRPOObjective(s, "none")
    for layout in ([docs], [docs[0:2], docs[2:4], docs[4:6]]):
        policy.zero_grad()
        batches = [collate(part, 64, list(range(len(part)))) for part in layout]
        metrics: dict = {}
        got = forward_backward(policy, batches, FP32, torch.device("cpu"), objective=objective, metrics=metrics)
        torch.testing.assert_close(got, want.detach(), **TOL)
        for k, v in policy.named_parameters():
            torch.testing.assert_close(v.grad, expected[k], **TOL, msg=k)
        if beta > 0:  # the logged KL is the token mean of the k3 terms
            mean = mean_metrics({**metrics, SEQUENCES: torch.tensor(6.0)})
            with torch.no_grad():
                kls = torch.cat([k3_kl(naive_logps(policy, d.prompt, d.completion), d.ref) for d in docs])
            assert mean["kl"] == pytest.approx(kls.mean().item(), rel=1e-5)


def test_packed_rows_put_several_completions_in_a_row_and_only_completions_are_targets():
    docs = make_docs(None, None, False, 0.0)
    batch = collate(docs, 64, list(range(6)))
    assert batch.input_ids.shape[0] == 1 and batch.n_sequences == 6
    assert batch.n_targets == sum(len(c) for g in COMPLETIONS for c in g)
    labels = batch.labels[0][batch.labels[0] != -100].tolist()
    assert sorted(labels) == sorted(t for g in COMPLETIONS for c in g for t in c)
    assert not set(labels) & {t for p in PROMPTS for t in p}


def test_k3_expectation_under_the_policy_is_the_exact_kl():
    """E_{x ~ p}[exp(log q - log p) - (log q - log p) - 1] = KL(p || q) for any two distributions."""
    torch.manual_seed(0)
    logp = torch.log_softmax(torch.randn(50, dtype=torch.float64), 0)
    logq = torch.log_softmax(torch.randn(50, dtype=torch.float64), 0)
    exact = (logp.exp() * (logp - logq)).sum()
    assert (logp.exp() * k3_kl(logp, logq)).sum().item() == pytest.approx(exact.item(), rel=1e-12)
    assert torch.all(k3_kl(logp, logq) >= 0)
    assert k3_kl(logp, logp).abs().max() == 0


@pytest.mark.parametrize("loss", ["grpo", "dapo"])
def test_clipping_zeroes_exactly_the_tokens_the_formula_clips(loss):
    """Ratios around the clip range with both signs of advantage: the gradient of a token is -A r / (its divisor)
    inside the range or on the side the advantage does not push, and exactly 0 where min() takes the clipped term."""
    s = settings(loss, 0.0, 2)
    ratios = torch.tensor([0.5, 0.79, 0.81, 1.0, 1.19, 1.21, 1.27, 1.29, 1.5], dtype=torch.float64)
    signs = [1.0, -1.0]
    for sign in signs:
        logps = torch.zeros(len(ratios), dtype=torch.float64, requires_grad=True)
        batch = RolloutBatch(torch.zeros(1, 1), torch.zeros(1, 1), None, 0, len(ratios), [],
                             token_seq=torch.zeros(len(ratios), dtype=torch.long), advantages=torch.tensor([sign]),
                             seq_tokens=torch.tensor([len(ratios)]), old_logps=-torch.log(ratios), n_sequences=1)
        terms = grpo_terms(logps, batch, s)
        terms.loss.backward()
        high = 1 + s.clip_high
        clipped = (ratios > high) if sign > 0 else (ratios < 1 - s.epsilon)
        divisor = len(ratios) if loss == "grpo" else 1
        want = torch.where(clipped, torch.zeros_like(ratios), -sign * ratios / divisor)
        torch.testing.assert_close(logps.grad, want)
        assert terms.clipped.item() == clipped.sum().item()


def test_gspo_clips_the_sequence_ratio():
    s = settings("gspo", 0.0, 2)
    logps = torch.zeros(4, dtype=torch.float64, requires_grad=True)
    old = torch.tensor([0.0, 0.0, -0.3, -0.3], dtype=torch.float64)  # completion 0: ratio 1; completion 1: exp(0.3)
    batch = RolloutBatch(torch.zeros(1, 1), torch.zeros(1, 1), None, 0, 4, [], token_seq=torch.tensor([0, 0, 1, 1]),
                         advantages=torch.tensor([1.0, 1.0]), seq_tokens=torch.tensor([2, 2]), old_logps=old, n_sequences=2)
    terms = grpo_terms(logps, batch, s)
    terms.loss.backward()
    # completion 0 unclipped: d(-exp(mean))/d logp_t = -1/2 per token; completion 1 past 1.2 with A > 0: 0
    torch.testing.assert_close(logps.grad, torch.tensor([-0.5, -0.5, 0.0, 0.0], dtype=torch.float64))
    assert terms.clipped.item() == 1 and terms.clip_count.item() == 2


def test_advantages_by_group_batch_and_none():
    r = np.array([1.0, 0.0, 0.0, 2.0, 2.0, 2.0])
    group = advantages(r, 3, "group")
    assert group[:3] == pytest.approx((r[:3] - 1 / 3) / (np.std(r[:3], ddof=1) + 1e-4))
    assert group[3:] == pytest.approx([0, 0, 0])  # one reward for the whole group: nothing to learn
    assert advantages(r, 3, "none") == pytest.approx([2 / 3, -1 / 3, -1 / 3, 0, 0, 0])
    batch = advantages(r, 3, "batch")
    assert batch == pytest.approx(advantages(r, 3, "none") / (np.std(r, ddof=1) + 1e-4))
    assert not math.isnan(sum(batch))
    # a process with the first group only, given the step's rewards on every process: the one-process advantages
    assert advantages(r[:3], 3, "batch", r) == pytest.approx(batch[:3])
    assert advantages(r[:3], 3, "batch") != pytest.approx(batch[:3])
