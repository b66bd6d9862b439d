"""The router load-balancing loss of mixture-of-experts models: equal to transformers' own, in the gradient on
both head paths, over real tokens only, weighted under accumulation, and kept through activation checkpointing."""

from __future__ import annotations

import pytest
import torch

from trainforge.data.formats import IGNORE
from trainforge.data.loader import Batch
from trainforge.engine.router_loss import AUX, router_loss_for, router_means
from trainforge.engine.step import TokenObjective, forward_backward
from trainforge.hardware.device import PRECISIONS

CPU, FP32 = torch.device("cpu"), PRECISIONS["fp32"]
VOCAB = 64


def tiny_moe(arch: str = "qwen3_moe", **extra) -> torch.nn.Module:
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    fields = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, num_experts_per_tok=2, router_aux_loss_coef=0.5, max_position_embeddings=64)
    fields["num_local_experts" if arch == "mixtral" else "num_experts"] = 4
    if arch != "mixtral":
        fields["moe_intermediate_size"] = 16
    fields.update(extra)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIG_MAPPING[arch](**fields), dtype=torch.float32)
    with torch.no_grad():  # a router that is not all zeros: the load is uneven, the aux gradient not zero
        for name, p in model.named_parameters():
            if name.endswith("gate.weight"):
                p.normal_(0, 0.5)
    return model


def batch_of(ids: torch.Tensor, lengths: list[int]) -> Batch:
    """Rows right-padded after ``lengths`` real tokens; each real token's target is the next one."""
    labels = torch.full_like(ids, IGNORE)
    real = torch.arange(ids.shape[1])[None, :] < torch.tensor(lengths)[:, None]
    for i, n in enumerate(lengths):
        labels[i, : n - 1] = ids[i, 1:n]
    return Batch(ids, labels, None, n_tokens=sum(lengths), n_targets=int((labels != IGNORE).sum()),
                 indices=list(range(len(lengths))), real=real)


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "qwen2_moe", "olmoe"])
@pytest.mark.parametrize("fused", [True, False])
def test_gradient_equals_transformers_loss_with_router_logits(arch, fused):
    model = tiny_moe(arch)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    out = model(input_ids=ids, labels=ids, output_router_logits=True)  # mean CE + coef x aux, transformers' own
    out.loss.backward()
    expected = grads(model)
    router = router_loss_for(model)
    assert router is not None and router.coef == 0.5 and (router.num_experts, router.top_k) == (4, 2)
    metrics: dict = {}
    loss = forward_backward(model, [batch_of(ids, [12, 12])], FP32, CPU, fused=fused, objective=TokenObjective(router),
                            metrics=metrics)
    got = grads(model)
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-4, atol=1e-6, msg=name)
    # the logged loss is the cross-entropy alone; the aux loss is transformers' own value
    torch.testing.assert_close(loss, out.loss - 0.5 * out.aux_loss, rtol=1e-5, atol=1e-6)
    assert router_means(metrics)[AUX] == pytest.approx(float(out.aux_loss.detach()), rel=1e-5)


def test_padding_is_left_out_as_transformers_attention_mask_does():
    model = tiny_moe()
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(2))
    mask = torch.tensor([[1] * 10, [1] * 6 + [0] * 4])
    expected = model(input_ids=ids, attention_mask=mask, output_router_logits=True).aux_loss
    unmasked = model(input_ids=ids, output_router_logits=True).aux_loss
    assert abs(float(expected) - float(unmasked)) > 1e-4  # the padding's routing would change it
    metrics: dict = {}
    forward_backward(model, [batch_of(ids, [10, 6])], FP32, CPU, objective=TokenObjective(router_loss_for(model)),
                     metrics=metrics)
    assert router_means(metrics)[AUX] == pytest.approx(float(expected), rel=1e-5)


def test_accumulation_weights_each_micro_batch_by_its_targets():
    model = tiny_moe()
    router = router_loss_for(model)
    ids = torch.randint(0, VOCAB, (3, 12), generator=torch.Generator().manual_seed(3))
    parts = [batch_of(ids[:1], [12]), batch_of(ids[1:], [5, 9])]
    auxes = [float(model(input_ids=ids[:1], output_router_logits=True).aux_loss),
             float(model(input_ids=ids[1:], attention_mask=parts[1].real.long(), output_router_logits=True).aux_loss)]
    metrics: dict = {}
    forward_backward(model, parts, FP32, CPU, objective=TokenObjective(router), metrics=metrics)
    weights = [p.n_targets for p in parts]
    want = sum(a * w for a, w in zip(auxes, weights)) / sum(weights)
    assert router_means(metrics)[AUX] == pytest.approx(want, rel=1e-5)


def test_router_gradient_survives_activation_checkpointing():
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(4))
    runs = []
    for checkpointing in (False, True):
        model = tiny_moe()
        model.train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        forward_backward(model, [batch_of(ids, [12, 12])], FP32, CPU, objective=TokenObjective(router_loss_for(model)))
        runs.append(grads(model))
    without_aux = tiny_moe()
    forward_backward(without_aux, [batch_of(ids, [12, 12])], FP32, CPU)
    plain = grads(without_aux)
    gate = "model.layers.0.mlp.gate.weight"
    assert not torch.allclose(runs[0][gate], plain[gate])  # the aux term reaches the router
    for name in runs[0]:
        torch.testing.assert_close(runs[1][name], runs[0][name], rtol=1e-4, atol=1e-6, msg=name)


def test_dense_models_and_the_switch_have_no_router_loss(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    assert router_loss_for(AutoModelForCausalLM.from_pretrained(tiny_model_dir)) is None
    off = router_loss_for(tiny_moe(), aux=False, z=False)  # no term trained; the expert load still counted
    assert off.coef is None and off.z_coef is None
    assert router_means({}) == {}


def test_a_coefficient_in_the_config_replaces_the_models_and_trains_as_transformers_would_with_it():
    """model.router_aux_loss: 0.05 trains cross-entropy + 0.05 x aux: the gradient of transformers' own loss on the
    same model with its router_aux_loss_coef set to 0.05; true keeps the config's 0.5, false none."""
    from trainforge.config.run import RunConfig

    model = tiny_moe()
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    model.router_aux_loss_coef = 0.05  # transformers' loss with the coefficient the run asks for (read at __init__)
    model(input_ids=ids, labels=ids, output_router_logits=True).loss.backward()
    expected = grads(model)
    model.router_aux_loss_coef = 0.5  # the model's own (its config's, unchanged), which the run's number replaces
    cfg = RunConfig.model_validate({"model": {"init": {"architecture": "llama"}, "router_aux_loss": 0.05},
                                    "data": {"train": "builtin:python-stdlib"}})
    assert cfg.model.router_aux_loss == 0.05
    router = router_loss_for(model, cfg.model.router_aux_loss)
    assert router.coef == 0.05
    forward_backward(model, [batch_of(ids, [12, 12])], FP32, CPU, objective=TokenObjective(router))
    got = grads(model)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-4, atol=1e-6, msg=name)
    assert router_loss_for(model, True).coef == 0.5 and router_loss_for(model, False).coef is None
    assert router_loss_for(model, 0).coef == 0.0  # logged, not trained


@pytest.mark.parametrize("value, ok", [(True, True), (False, True), (0.01, True), (1.0, True), (2, True), ("0.02", True),
                                       (0.0, True), (0, False), (1, False), (-0.1, False), (float("nan"), False),
                                       (1e9, False)])
def test_router_aux_loss_takes_a_switch_or_a_coefficient(value, ok):
    from pydantic import ValidationError

    from trainforge.config.run import RunConfig

    raw = {"model": {"init": {"architecture": "llama"}, "router_aux_loss": value}, "data": {"train": "builtin:python-stdlib"}}
    if not ok:
        with pytest.raises(ValidationError, match="router_aux_loss") as e:
            RunConfig.model_validate(raw)
        if value in (0, 1) and type(value) is int:  # YAML's switch habit: said, not guessed
            assert "ambiguous: write true or false" in str(e.value)
        return
    got = RunConfig.model_validate(raw).model.router_aux_loss
    assert got == (float(value) if not isinstance(value, bool) else value) and isinstance(got, type(value) if isinstance(value, bool) else float)
