"""The rollout sampler: batched, left-padded decoding with a KV cache (rows leaving as they finish) gives each prompt
what it gets decoded alone; a completion's key alone decides its draws, whatever batch or position samples it (so the
rollout stage gives a prompt the same completions on any process); the draw follows the filtered distribution; the
filters cut what they say."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from test_preference import tiny_llama

from trainforge.rl.rollout import Sampling, draw, filter_logits, sample, stream_keys, uniforms

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
    got = sample(model, PROMPTS, Sampling(8, stop_ids=(STOP,), greedy=True), None, 0)
    want = [one_at_a_time(model, p, 8) for p in PROMPTS]
    assert got.tokens == want
    assert got.finished == [w[-1] == STOP for w in want]
    assert any(got.finished) and not all(got.finished)  # rows left the batch while others went on


def test_the_prefill_computes_the_last_positions_logits_only():
    """Rows x prompt x vocabulary logits would be the rollout's largest tensor (plan prices the rollout without them)."""
    model = tiny_llama()
    rows = []
    model.lm_head.register_forward_hook(lambda module, args, out: rows.append(tuple(out.shape[:2])))
    sample(model, PROMPTS, Sampling(2, greedy=True), None, 0)
    assert rows[0] == (len(PROMPTS), 1) and all(r[1] == 1 for r in rows)


def test_a_completion_is_decided_by_its_key_whatever_batch_or_position_samples_it():
    model = tiny_llama()
    s = Sampling(6, temperature=1.3, top_k=20, top_p=0.9)
    prompts, keys = PROMPTS * 2, stream_keys(7, range(8))
    first = sample(model, prompts, s, keys, 0).tokens
    assert sample(model, prompts, s, keys, 0).tokens == first  # again: the same
    order = [5, 2, 7, 0, 3, 6, 1, 4]  # shuffled, then alone and in pairs: each row its own completion still
    shuffled = sample(model, [prompts[i] for i in order], s, keys[order], 0).tokens
    assert shuffled == [first[i] for i in order]
    assert [sample(model, [prompts[i]], s, keys[[i]], 0).tokens[0] for i in range(3)] == first[:3]
    assert sample(model, [prompts[6], PROMPTS[0] * 3], s, np.r_[keys[6], 99], 0).tokens[0] == first[6]
    assert first[:4] != first[4:]  # the same prompts, other keys: other completions
    assert sample(model, prompts, s, stream_keys(8, range(8)), 0).tokens != first


@pytest.mark.parametrize("greedy", [False, True])
def test_a_prompts_completions_share_one_prefill_and_sample_what_its_repeated_copies_sample(greedy):
    """``group``: each prompt prefilled once, its cache repeated to its completions; the completions are those of the
    prompt repeated ``group`` times and each copy prefilled (the same keys), rows leaving the batch as they end."""
    model = tiny_llama()
    s = Sampling(8, temperature=1.4, top_p=0.95, stop_ids=(STOP, 40), greedy=greedy)
    keys = stream_keys(9, range(12))
    copies = sample(model, [p for p in PROMPTS[:3] for _ in range(4)], s, keys, 0)
    prefills = []
    model.model.register_forward_pre_hook(lambda module, args, kw: prefills.append(tuple(kw["input_ids"].shape)),
                                          with_kwargs=True)
    shared = sample(model, PROMPTS[:3], s, keys, 0, group=4)
    assert shared.tokens == copies.tokens and shared.finished == copies.finished
    assert prefills[0] == (3, 5) and all(shape[1] == 1 for shape in prefills[1:])  # one prefill row per prompt
    assert any(shared.finished) and not all(shared.finished)
    if not greedy:
        assert len({tuple(t) for t in shared.tokens[:4]}) > 1  # a prompt's completions differ


def test_the_draw_follows_the_distribution_and_never_takes_a_cut_token():
    probs = torch.tensor([0.5, 0.0, 0.3, 0.2, 0.0])
    u = uniforms(stream_keys(3, 1), 40_000)[0]
    picked = draw(probs.expand(len(u), -1).contiguous(), u)
    freq = torch.bincount(picked, minlength=5).float() / len(u)
    torch.testing.assert_close(freq, probs, atol=0.01, rtol=0)  # 40k draws: std < 0.0025
    assert 0.49 < float(u.mean()) < 0.51 and float(u.min()) >= 0.0 and float(u.max()) < 1.0
    top = draw(probs[None], torch.tensor([1.0]))  # u x total at the total itself: the last token with mass
    assert top.tolist() == [3]


def test_keys_fold_their_parts_in_order():
    assert stream_keys(1, 2)[0] != stream_keys(2, 1)[0]
    assert len(set(stream_keys(0, 0, range(1000)).tolist())) == 1000
    np.testing.assert_array_equal(stream_keys(5, [1, 2]), np.r_[stream_keys(5, 1), stream_keys(5, 2)])


class CharTokenizer:
    """What the rollout stage reads of a tokenizer: ids <-> letters, an end token."""

    eos_token_id, pad_token_id = 1, 0

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": [ord(c) - 60 for c in text]}

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(60 + i) for i in ids if not (skip_special_tokens and i == 1))


def stage_completions(micro: int, accum: int, world: int, steps: int) -> list[list[tuple]]:
    """Each step's (prompt index, prompt, completion) of ``steps`` steps of the rollout stage, over ``world``
    processes' loaders (the ranks' shares of each step joined in rank order)."""
    from trainforge.config.rewards import RewardSettings
    from trainforge.config.rl import RLSettings
    from trainforge.hardware.device import PRECISIONS
    from trainforge.rl.prompts import Prompt, PromptCollate
    from trainforge.rl.stage import RolloutLoader

    model = tiny_llama()
    rows = [Prompt([5 + i, 6 + 2 * i, 7], f"p{i}", {}, f"x:{i}", i) for i in range(6)]
    rl = RLSettings(num_generations=3, max_completion_length=5, temperature=1.5,
                    rewards=[RewardSettings(name="length", target=3)])
    cfg = SimpleNamespace(rl=rl, train=SimpleNamespace(seed=4, fused_loss=True), data=SimpleNamespace(max_length=8))
    loaders = []
    for rank in range(world):
        loader = RolloutLoader(rows, PromptCollate(generations=3), micro, seed=4, rank=rank, world_size=world)
        loader.bind(cfg, model, None, CharTokenizer(), PRECISIONS["fp32"], torch.device("cpu"), accum)
        loaders.append(loader)
    return [[(d.index, tuple(d.prompt), tuple(d.completion)) for loader in loaders for d in loader.generate()]
            for _ in range(steps)]


@pytest.mark.parametrize("micro,accum,world", [(3, 2, 1), (3, 1, 2)])
def test_a_prompts_completions_do_not_depend_on_the_process_or_the_batch(micro, accum, world):
    """Two prompts a step (3 completions each): one process sampling both at once is the reference; one process in
    two micro-batches and two processes with one prompt each sample the same completions."""
    expected = stage_completions(6, 1, 1, 4)  # 6 prompts, 2 a step: step 4 starts the second epoch
    assert stage_completions(micro, accum, world, 4) == expected
    completions = [c for _, _, c in expected[0]]
    assert len(set(completions[:3])) > 1  # a group's completions differ
    first_epoch = {(i, c) for step in expected[:3] for i, _, c in step}
    assert not {(i, c) for i, _, c in expected[3]} <= first_epoch  # a prompt drawn again: other completions


def test_filters_keep_what_each_rule_says():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.07, 0.03]]))
    kept = lambda **kw: torch.isfinite(filter_logits(logits, Sampling(1, **kw)))[0].tolist()  # noqa: E731
    assert kept(top_k=2) == [True, True, False, False, False]
    assert kept(top_p=0.7) == [True, True, False, False, False]  # 0.5 + 0.25 reaches 0.7
    assert kept(top_p=0.5) == [True, False, False, False, False]
    assert kept(min_p=0.2) == [True, True, True, False, False]  # at least 0.2 x 0.5
    assert kept() == [True] * 5
