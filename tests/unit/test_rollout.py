"""The rollout sampler: batched, left-padded decoding with a KV cache (rows leaving as they finish) gives each prompt
what it gets decoded alone; a seeded generator gives the same completions again; the filters cut what they say."""

from __future__ import annotations

import torch
from test_preference import tiny_llama

from trainforge.rl.rollout import Sampling, filter_logits, generator_for, sample

PROMPTS = [[5, 6, 7], [20, 21], [30, 31, 32, 33, 34], [40]]
STOP = 33  # the tiny model's greedy choice for two of the prompts, a few tokens in


def one_at_a_time(model, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding of one prompt without a cache: the full sequence through the model each token."""
    ids = list(prompt)
    out = []
    with torch.no_grad():
        for _ in range(n):
            tok = int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
            out.append(tok)
            ids.append(tok)
            if tok == STOP:
                break
    return out


def test_batched_greedy_equals_each_prompt_alone_with_packed_attention():
    model = tiny_llama()  # the packed-document attention of training: sampling must not lose the padding mask
    got = sample(model, PROMPTS, Sampling(8, stop_ids=(STOP,), greedy=True), generator_for(torch.device("cpu"), 0), 0)
    want = [one_at_a_time(model, p, 8) for p in PROMPTS]
    assert got.tokens == want
    assert got.finished == [w[-1] == STOP for w in want]
    assert any(got.finished) and not all(got.finished)  # rows left the batch while others went on


def test_the_prefill_computes_the_last_positions_logits_only():
    """Rows x prompt x vocabulary logits would be the rollout's largest tensor (plan prices the rollout without them)."""
    model = tiny_llama()
    rows = []
    model.lm_head.register_forward_hook(lambda module, args, out: rows.append(tuple(out.shape[:2])))
    sample(model, PROMPTS, Sampling(2, greedy=True), generator_for(torch.device("cpu"), 0), 0)
    assert rows[0] == (len(PROMPTS), 1) and all(r[1] == 1 for r in rows)


def test_a_seeded_generator_samples_the_same_completions_and_its_state_resumes_them():
    model = tiny_llama()
    s = Sampling(6, temperature=1.3, top_k=20, top_p=0.9)
    g = generator_for(torch.device("cpu"), 7)
    first = sample(model, PROMPTS * 2, s, g, 0).tokens
    state = g.get_state()
    second = sample(model, PROMPTS * 2, s, g, 0).tokens
    assert first == sample(model, PROMPTS * 2, s, generator_for(torch.device("cpu"), 7), 0).tokens
    g.set_state(state)
    assert sample(model, PROMPTS * 2, s, g, 0).tokens == second
    assert first != second


def test_filters_keep_what_each_rule_says():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.07, 0.03]]))
    kept = lambda **kw: torch.isfinite(filter_logits(logits, Sampling(1, **kw)))[0].tolist()  # noqa: E731
    assert kept(top_k=2) == [True, True, False, False, False]
    assert kept(top_p=0.7) == [True, True, False, False, False]  # 0.5 + 0.25 reaches 0.7
    assert kept(top_p=0.5) == [True, False, False, False, False]
    assert kept(min_p=0.2) == [True, True, True, False, False]  # at least 0.2 x 0.5
    assert kept() == [True] * 5
