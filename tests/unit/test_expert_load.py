"""Expert-load metrics of mixture-of-experts runs: each layer's most- and least-loaded expert's share of the real
tokens, equal to a hand count of the experts the model itself chose; summed over micro-batches; counted with the
router losses off; and the advisor's routing-collapse warning (fires on a collapsed router, once; silent on a
balanced one)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from test_router_loss import VOCAB, batch_of, tiny_moe
from trainforge.engine.advisor import Advisor, RunTimes
from trainforge.engine.router_loss import AUX, LOAD, load_fields, router_loss_for, router_means
from trainforge.engine.loss import fused_head
from trainforge.engine.step import TokenObjective, forward_backward
from trainforge.hardware.device import PRECISIONS
from trainforge.metrics.thresholds import limit

CPU, FP32 = torch.device("cpu"), PRECISIONS["fp32"]
TIMES = RunTimes(wall_s=1.0, train_s=1.0, eval_s=0.0, evals_done=0, evals_planned=0, checkpoint_s=0.0, steps_done=1,
                 max_steps=10, window_s=1.0)


def routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if type(m).__name__ == "Qwen3MoeTopKRouter"]


def chosen_by_model(model: torch.nn.Module, run) -> list[torch.Tensor]:
    """The experts each router of ``model`` chose (its own output, (tokens, top_k)) during ``run()``, in call order."""
    seen: list[torch.Tensor] = []
    hooks = [r.register_forward_hook(lambda m, args, out: seen.append(out[2].detach().clone())) for r in routers(model)]
    try:
        run()
    finally:
        for h in hooks:
            h.remove()
    return seen


def window(model, parts, aux: bool = True) -> tuple[dict, list[torch.Tensor]]:
    """One step over ``parts`` (micro-batches): (its router record, the experts the model chose)."""
    metrics: dict = {}
    objective = TokenObjective(router_loss_for(model, aux=aux))
    fused_head(model)  # decided before the hooks: its probe's forwards choose experts too (engine/head_exact.py)
    chosen = chosen_by_model(model, lambda: forward_backward(model, parts, FP32, CPU, objective=objective, metrics=metrics))
    return router_means(metrics), chosen


def test_shares_equal_a_hand_count_of_the_experts_the_model_chose():
    model = tiny_moe(num_experts=8)  # 8 experts, top-2, 2 MoE layers
    ids = torch.randint(0, VOCAB, (3, 12), generator=torch.Generator().manual_seed(7))
    parts = [batch_of(ids[:2], [12, 5]), batch_of(ids[2:], [8])]  # padding after 5 and 8 real tokens
    rec, chosen = window(model, parts)
    assert len(chosen) == 4  # 2 micro-batches x 2 layers
    hand = [Counter(), Counter()]
    with_padding = [Counter(), Counter()]
    real_tokens = 0
    for m, part in enumerate(parts):
        real = part.real.flatten().tolist()
        real_tokens += sum(real)
        for layer in range(2):
            for token, experts in enumerate(chosen[2 * m + layer].tolist()):
                with_padding[layer].update(experts)
                if real[token]:
                    hand[layer].update(experts)
    shares = [[hand[layer][e] / real_tokens for e in range(8)] for layer in range(2)]
    assert rec["expert_load_max_by_layer"] == pytest.approx([max(s) for s in shares], abs=1e-4)
    assert rec["expert_load_min_by_layer"] == pytest.approx([min(s) for s in shares], abs=1e-4)
    assert rec["expert_load_max"] == pytest.approx(max(max(s) for s in shares), rel=1e-6)
    assert rec["expert_load_min"] == pytest.approx(min(min(s) for s in shares), rel=1e-6)
    assert rec["expert_load_even"] == 2 / 8
    assert with_padding != hand  # the padding's choices would have counted
    assert sum(hand[0].values()) == 2 * real_tokens  # every real token made top-2 choices


def test_load_is_counted_with_the_router_losses_off():
    model = tiny_moe()
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(8))
    rec, _ = window(model, [batch_of(ids, [10, 10])], aux=False)
    assert AUX not in rec and 0.5 <= rec["expert_load_max"] <= 1.0 and rec["expert_load_even"] == 0.5


def test_the_window_keeps_the_counts_on_the_device_as_sums():
    model = tiny_moe()
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(9))
    metrics: dict = {}
    forward_backward(model, [batch_of(ids[:1], [10]), batch_of(ids[1:], [7])], FP32, CPU,
                     objective=TokenObjective(router_loss_for(model)), metrics=metrics)
    counts = metrics[LOAD]
    assert torch.is_tensor(counts) and counts.shape == (2, 4)
    assert counts.sum(dim=1).tolist() == [2 * 17, 2 * 17]  # 17 real tokens x top-2, per layer


def collapsed_moe() -> torch.nn.Module:
    """A router that sends every token to expert 0: hidden dimension 0 is large and positive in every token
    (the embeddings), and only expert 0's router row reads it."""
    model = tiny_moe(num_experts=8)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 20.0
        for router in routers(model):
            router.weight[0, 0] = 50.0
    return model


def advice_over_windows(model, n: int = 3) -> tuple[list, list[dict]]:
    advisor, given, recs = Advisor(capacity=None), [], []
    for w in range(n):
        ids = torch.randint(0, VOCAB, (4, 12), generator=torch.Generator().manual_seed(20 + w))
        rec, _ = window(model, [batch_of(ids, [12, 12, 9, 12])])
        rec.update(step=w + 1)
        recs.append(rec)
        given += advisor.observe(rec, TIMES)
    return given, recs


def test_the_advisor_warns_once_on_a_collapsed_router():
    given, recs = advice_over_windows(collapsed_moe())
    assert all(r["expert_load_max"] == 1.0 for r in recs)
    assert [a.cause for a in given] == ["routing_collapse"]  # once, though all three windows collapsed
    advice = given[0]
    assert "100% of the tokens" in advice.message and "even load gives each expert 25.0%" in advice.message
    assert "model.router_aux_loss: a number above" in advice.message  # the aux loss is on: its coefficient is the lever
    assert advice.fields["line"] == pytest.approx(0.25 + limit("collapse_share") * 0.75)


def test_the_advisor_is_silent_on_a_balanced_router():
    given, recs = advice_over_windows(tiny_moe(num_experts=8))
    line = 0.25 + limit("collapse_share") * 0.75
    assert all(r["expert_load_max"] < line for r in recs)
    assert given == []


def test_collapse_must_last_and_turning_the_aux_loss_on_is_the_advice_when_it_is_off():
    def rec(step: int, counts: list[float]) -> dict:  # 4 experts, top-2, 10 real tokens: the counts sum to 20
        return {**load_fields([[6.0, 6.0, 4.0, 4.0], counts], [10.0, 10.0]), "step": step}

    collapsed, uneven = [9.0, 9.0, 2.0, 0.0], [6.0, 6.0, 6.0, 2.0]
    assert rec(1, collapsed)["expert_load_max"] == 0.9 and rec(1, collapsed)["expert_load_even"] == 0.5
    advisor = Advisor(capacity=None)
    assert advisor.observe(rec(1, collapsed), TIMES) == []  # one window is not a collapse yet
    assert advisor.observe(rec(2, uneven), TIMES) == []  # below the line (0.75): the count starts again
    assert advisor.observe(rec(3, collapsed), TIMES) == []
    (advice,) = advisor.observe(rec(4, [10.0, 10.0, 0.0, 0.0]), TIMES)
    assert "model.router_aux_loss: true" in advice.message and "in MoE layer 1" in advice.message
    assert "1 of 2 layers" in advice.message
    assert advisor.observe(rec(5, collapsed), TIMES) == []  # said once


def test_dense_records_and_empty_windows_have_no_load():
    assert load_fields([[0.0, 0.0]], [0.0]) == {}
    assert Advisor(capacity=None).observe({"step": 1, "loss": 1.0}, TIMES) == []


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "qwen2_moe", "olmoe"])
def test_an_empty_share_counts_zeros_of_every_moe_layer(arch):
    """A data-parallel rank with no real tokens adds zeros of the same shape as the others (they all-reduce the sums)."""
    model = tiny_moe(arch, **({"mlp_only_layers": [0], "num_hidden_layers": 3} if arch == "qwen3_moe" else {}))
    router = router_loss_for(model)
    assert router.layers == 2  # qwen3_moe: layers 1 and 2 routed, layer 0 dense
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(3))
    empty = batch_of(ids, [6])
    empty.n_tokens, empty.n_targets = 0, 0
    metrics: dict = {}
    router.add(torch.zeros(()), {}, empty, metrics)
    assert metrics[LOAD].shape == (2, router.num_experts) and float(metrics[LOAD].abs().sum()) == 0.0
