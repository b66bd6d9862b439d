"""Preference objectives: the chunked token log-probabilities, packed per-document sums and each loss
against a direct, readable implementation of the paper's formula on padded, unfused logits (fp32)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from trainforge.data.formats import IGNORE
from trainforge.engine import preference as pref
from trainforge.engine.loss import linear_token_logprobs
from trainforge.model.packed_attention import register

TOL = dict(rtol=1e-5, atol=1e-5)


def test_token_logprobs_match_log_softmax_in_value_and_gradient():
    torch.manual_seed(0)
    n, hidden, vocab = 41, 16, 50
    h = torch.randn(n, hidden, requires_grad=True)
    head = torch.nn.Linear(hidden, vocab, bias=True)
    labels = torch.randint(0, vocab, (n,))
    labels[::3] = IGNORE
    upstream = torch.randn(int((labels != IGNORE).sum()))  # any upstream gradient, as a preference loss gives

    got = linear_token_logprobs(h, head, labels)
    (got * upstream).sum().backward()
    fused = [h.grad.clone(), head.weight.grad.clone(), head.bias.grad.clone()]
    h.grad = None
    head.zero_grad()
    kept = labels != IGNORE
    want = torch.log_softmax(head(h), -1)[kept].gather(1, labels[kept][:, None]).squeeze(1)
    (want * upstream).sum().backward()
    torch.testing.assert_close(got, want, **TOL)
    for a, b in zip(fused, [h.grad, head.weight.grad, head.bias.grad]):
        torch.testing.assert_close(a, b, **TOL)


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      max_position_embeddings=128, attn_implementation=register())
    return LlamaForCausalLM(cfg).float()


PAIRS = [  # (prompt, chosen, rejected) token ids
    ([5, 6, 7], [8, 9, 10, 11], [12, 13]),
    ([20, 21], [22, 23], [24, 25, 26, 27, 28]),
    ([30, 31, 32, 33], [34], [35, 36, 37]),
]


def padded_logps(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """The readable reference: one unpadded sequence, the model's own logits, log-softmax, the completion's tokens summed."""
    ids = torch.tensor([prompt + completion])
    logits = model(input_ids=ids).logits[0, :-1].float()
    targets = ids[0, 1:]
    logp = torch.log_softmax(logits, -1).gather(1, targets[:, None]).squeeze(1)
    return logp[len(prompt) - 1 :].sum()


def packed_logps(model, pairs=PAIRS) -> pref.PairLogps:
    """Every pair's chosen and rejected as two documents of one packed row, through the fused head."""
    ids, labels, positions = [], [], []
    for prompt, *sides in pairs:
        for completion in sides:
            seq = prompt + completion
            ids += seq[:-1]
            labels += [IGNORE] * (len(prompt) - 1) + completion
            positions += list(range(len(seq) - 1))
    ids, labels, positions = (torch.tensor([x]) for x in (ids, labels, positions))
    hidden = model.model(input_ids=ids, position_ids=positions, use_cache=False).last_hidden_state
    docs = pref.document_index(positions)
    token_logps = linear_token_logprobs(hidden.flatten(0, 1), model.lm_head, labels.flatten())
    sums, counts = pref.sequence_logps(token_logps, labels, docs, 2 * len(pairs))
    return pref.PairLogps(sums[0::2], sums[1::2], counts[0::2], counts[1::2])


def reference_logps(model) -> pref.PairLogps:
    chosen = torch.stack([padded_logps(model, p, c) for p, c, _ in PAIRS])
    rejected = torch.stack([padded_logps(model, p, r) for p, _, r in PAIRS])
    n = lambda i: torch.tensor([len(x[i]) for x in PAIRS])
    return pref.PairLogps(chosen, rejected, n(1), n(2))


def test_packed_document_sums_equal_each_sequence_run_alone():
    model = tiny_llama()
    got, want = packed_logps(model), reference_logps(model)
    torch.testing.assert_close(got.chosen, want.chosen, **TOL)
    torch.testing.assert_close(got.rejected, want.rejected, **TOL)
    assert got.chosen_tokens.tolist() == [4, 2, 1] and got.rejected_tokens.tolist() == [2, 5, 3]


def paper_losses(p: pref.PairLogps, ref: pref.PairLogps, name: str) -> torch.Tensor:
    """Each objective written out from its paper, on the reference log-probabilities, mean over pairs."""
    beta = 0.1
    rc, rr = p.chosen - ref.chosen, p.rejected - ref.rejected
    if name == "dpo":
        return torch.stack([-F.logsigmoid(beta * (c - r)) for c, r in zip(rc, rr)]).mean()
    if name == "ipo":
        h = rc / p.chosen_tokens - rr / p.rejected_tokens
        return ((h - 1 / (2 * beta)) ** 2).mean()
    if name == "simpo":
        gamma = 0.5
        return (-F.logsigmoid(beta * p.chosen / p.chosen_tokens - beta * p.rejected / p.rejected_tokens - gamma)).mean()
    if name == "orpo":
        pc, pr = torch.exp(p.chosen / p.chosen_tokens), torch.exp(p.rejected / p.rejected_tokens)
        odds = torch.log(pc / (1 - pc)) - torch.log(pr / (1 - pr))
        return (-beta * F.logsigmoid(odds) - p.chosen / p.chosen_tokens).mean()
    raise ValueError(name)


def ours(p: pref.PairLogps, name: str) -> torch.Tensor:
    if name == "dpo":
        return pref.dpo_loss(p, 0.1).mean()
    if name == "ipo":
        return pref.ipo_loss(p, 0.1).mean()
    if name == "simpo":
        return pref.simpo_loss(p, 0.1, 0.5).mean()
    return pref.orpo_loss(p, 0.1).mean()


@pytest.mark.parametrize("name", ["dpo", "ipo", "simpo", "orpo"])
def test_each_objective_equals_the_papers_formula_in_loss_and_gradients(name):
    policy, reference = tiny_llama(), tiny_llama()
    with torch.no_grad():  # a policy that moved away from its reference
        for p in policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
    with torch.no_grad():
        ref = reference_logps(reference)

    fused = packed_logps(policy)
    fused.ref_chosen, fused.ref_rejected = packed_logps(reference).chosen.detach(), packed_logps(reference).rejected.detach()
    loss = ours(fused, name)
    loss.backward()
    grads = {k: v.grad.clone() for k, v in policy.named_parameters()}
    policy.zero_grad()

    want = paper_losses(reference_logps(policy), ref, name)
    want.backward()
    torch.testing.assert_close(loss, want, **TOL)
    for k, v in policy.named_parameters():
        torch.testing.assert_close(grads[k], v.grad, **TOL, msg=k)


def test_kto_per_example_follows_the_paper():
    logps, ref = torch.tensor([-3.0, -5.0, -2.0]), torch.tensor([-3.5, -4.0, -2.0])
    desirable, kl, beta = torch.tensor([True, False, True]), torch.tensor(0.2), 0.1
    got = pref.kto_loss(logps, ref, desirable, kl, beta, desirable_weight=1.0, undesirable_weight=1.5)
    ratio = logps - ref
    want = torch.stack([1 - torch.sigmoid(beta * (ratio[0] - kl)), 1.5 * (1 - torch.sigmoid(beta * (kl - ratio[1]))),
                        1 - torch.sigmoid(beta * (ratio[2] - kl))])
    torch.testing.assert_close(got, want)


def test_pair_metrics_reward_the_preferred_side():
    p = pref.PairLogps(torch.tensor([-2.0, -6.0]), torch.tensor([-4.0, -3.0]), torch.tensor([2, 2]), torch.tensor([2, 2]),
                       torch.tensor([-3.0, -3.0]), torch.tensor([-3.0, -3.0]))
    m = pref.pair_metrics(p, beta=0.5)
    assert m["rewards_chosen"].tolist() == [0.5, -1.5] and m["rewards_rejected"].tolist() == [-0.5, 0.0]
    assert m["reward_accuracy"].tolist() == [1.0, 0.0] and m["reward_margin"].tolist() == [1.0, -1.5]


def test_pairs_pack_whole_chosen_first_and_their_documents_pair_up(tmp_path):
    import numpy as np
    from conftest import make_store

    from trainforge.data.loader import RowCollator
    from trainforge.data.packing import pair_rows

    sequences = []
    for prompt, chosen, rejected in PAIRS * 3:  # 9 pairs of 3-9 inputs a side
        for reply in (chosen, rejected):
            sequences.append((prompt + reply, [False] * len(prompt) + [True] * len(reply)))
    store = make_store(tmp_path / "store", sequences, vocab_size=64)
    rows = pair_rows(store, np.arange(9), max_length=24)
    pairs_in_rows = sorted(int(seg[0]) for row in rows for seg in row[0::2])
    assert pairs_in_rows == sorted(int(store.offsets[2 * k]) for k in range(9))  # every pair once, whole
    for row in rows:
        assert all(int(c[1]) == int(r[0]) for c, r in zip(row[0::2], row[1::2]))  # rejected right after its chosen
        assert sum(int(e - s - 1) for s, e in row) <= 24
    batch = RowCollator(store, pad_id=0, mode=True, max_length=24)(rows[:2], [0, 1])
    docs = pref.document_index(batch.position_ids)
    n_docs = int(docs.max()) + 1
    fake_logps = torch.ones(int((batch.labels != IGNORE).sum()))
    sums, counts = pref.sequence_logps(fake_logps, batch.labels, docs, n_docs)
    real = counts > 0  # the padding tail of a row is a document of its own, with no targets
    pairs = counts[real].view(-1, 2)
    # each pair's two documents in order, their targets the learned tokens of chosen then rejected
    want = [[sum(store.learn[int(c[0]) + 1 : int(c[1])]), sum(store.learn[int(r[0]) + 1 : int(r[1])])]
            for row in rows[:2] for c, r in zip(row[0::2], row[1::2])]
    assert pairs.tolist() == [[int(a), int(b)] for a, b in want]


def test_a_collated_batch_gives_each_pairs_log_probabilities_and_lora_off_is_the_reference(tmp_path):
    import numpy as np
    from conftest import make_store
    from peft import LoraConfig, get_peft_model

    from trainforge.data.loader import RowCollator
    from trainforge.data.packing import pair_rows
    from trainforge.hardware.device import PRECISIONS

    sequences = [(p + reply, [False] * len(p) + [True] * len(reply)) for p, c, r in PAIRS for reply in (c, r)]
    store = make_store(tmp_path / "store", sequences, vocab_size=64)
    rows = pair_rows(store, np.arange(len(PAIRS)), max_length=32)
    batch = RowCollator(store, pad_id=0, mode=True, max_length=32)(rows, list(range(len(rows))))
    base = tiny_llama()
    want = reference_logps(base)
    fp32 = PRECISIONS["fp32"]
    got = pref.batch_pair_logps(base, batch, fp32)
    order = sorted(range(len(PAIRS)), key=lambda k: [int(s) for row in rows for s in row[0::2, 0]].index(int(store.offsets[2 * k])))
    torch.testing.assert_close(got.chosen, want.chosen[order], **TOL)
    torch.testing.assert_close(got.rejected, want.rejected[order], **TOL)

    lora = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    moved = pref.batch_pair_logps(lora, batch, fp32)
    assert not torch.allclose(moved.chosen, got.chosen)  # the adapters change the policy ...
    ref_c, ref_r = pref.reference_pair_logps(lora, batch, fp32)
    torch.testing.assert_close(ref_c, got.chosen, **TOL)  # ... and switched off, it is the base again
    torch.testing.assert_close(ref_r, got.rejected, **TOL)
