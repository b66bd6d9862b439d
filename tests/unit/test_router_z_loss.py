"""The router z-loss, in the one family whose transformers model adds one (Switch Transformers, encoder-decoder,
top-1): with its load-balancing loss, the gradient equals transformers' ``loss`` with ``output_router_logits``;
over real tokens only; weighted by target tokens under accumulation; switched off by ``model.router_z_loss``."""

from __future__ import annotations

import pytest
import torch

from trainforge.data.formats import IGNORE
from trainforge.data.loader import Batch
from trainforge.engine.router_loss import AUX, Z, router_loss_for, router_means
from trainforge.engine.router_terms import switch_aux, z_loss
from trainforge.engine.step import TokenObjective, forward_backward, loss_sum
from trainforge.hardware.device import PRECISIONS

CPU, FP32 = torch.device("cpu"), PRECISIONS["fp32"]
VOCAB = 48


def tiny_switch(sparse_encoder: int = 2, **extra) -> torch.nn.Module:
    """4 + 4 layers, every second one sparse (sparse step 2: transformers adds both stacks' router losses)."""
    from transformers import SwitchTransformersConfig, SwitchTransformersForConditionalGeneration

    config = SwitchTransformersConfig(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=48, num_layers=4, num_decoder_layers=4, num_heads=4, num_experts=4,
        num_sparse_encoder_layers=sparse_encoder, num_sparse_decoder_layers=2, router_jitter_noise=0.0,
        dropout_rate=0.0, router_z_loss_coef=0.05, router_aux_loss_coef=0.2, decoder_start_token_id=0, **extra)
    torch.manual_seed(0)
    model = SwitchTransformersForConditionalGeneration(config)
    with torch.no_grad():  # routers far from zero: z-loss and imbalance large enough to show in the gradient
        for name, p in model.named_parameters():
            if "router.classifier" in name:
                p.normal_(0, 2.0)
    return model.train()


def seq2seq_batch(model, source: torch.Tensor, target: torch.Tensor, src_len: list[int], tgt_len: list[int]) -> Batch:
    """Rows right-padded: the first ``src_len`` source tokens and ``tgt_len`` target tokens are real."""
    mask = (torch.arange(source.shape[1])[None] < torch.tensor(src_len)[:, None]).long()
    labels = torch.where(torch.arange(target.shape[1])[None] < torch.tensor(tgt_len)[:, None], target, IGNORE)
    return Batch(source * mask, labels, None, n_tokens=sum(src_len) + sum(tgt_len), n_targets=sum(tgt_len),
                 indices=list(range(len(src_len))), attention_mask=mask, decoder_input_ids=model._shift_right(labels))


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def ids(rows: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(2, VOCAB, (rows, length), generator=torch.Generator().manual_seed(seed))


def test_gradient_equals_transformers_loss_with_z_and_aux():
    model = tiny_switch()
    src, tgt = ids(2, 9, 1), ids(2, 7, 2)
    out = model(input_ids=src, labels=tgt, output_router_logits=True)  # CE + z_coef x z + aux_coef x aux, transformers'
    out.loss.backward()
    expected = grads(model)
    router = router_loss_for(model)
    assert router is not None and (router.kind, router.top_k, router.z_coef, router.coef) == ("switch", 1, 0.05, 0.2)
    metrics: dict = {}
    loss = forward_backward(model, [seq2seq_batch(model, src, tgt, [9, 9], [7, 7])], FP32, CPU,
                            objective=TokenObjective(router), metrics=metrics)
    got = grads(model)
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-4, atol=1e-6, msg=name)
    z = float((out.encoder_z_loss + out.decoder_z_loss).detach())
    aux = float((out.encoder_aux_loss + out.decoder_aux_loss).detach())
    assert z > 1.0  # the routers' logits are large: the z term is no rounding error
    means = router_means(metrics)
    assert means[Z] == pytest.approx(z, rel=1e-5) and means[AUX] == pytest.approx(aux, rel=1e-5)
    torch.testing.assert_close(loss, out.loss.detach() - 0.05 * z - 0.2 * aux, rtol=1e-5, atol=1e-6)
    # top-1 of 4 experts; 2 + 2 sparse layers, the encoder's first
    assert means["expert_load_even"] == 0.25 and len(means["expert_load_max_by_layer"]) == 4


def test_z_loss_switched_off_leaves_the_aux_term_only():
    model = tiny_switch()
    src, tgt = ids(2, 8, 3), ids(2, 6, 4)
    out = model(input_ids=src, labels=tgt, output_router_logits=True)
    (out.loss - 0.05 * (out.encoder_z_loss + out.decoder_z_loss)).backward()
    expected = grads(model)
    router = router_loss_for(model, z=False)
    assert router.z_coef is None
    metrics: dict = {}
    forward_backward(model, [seq2seq_batch(model, src, tgt, [8, 8], [6, 6])], FP32, CPU, objective=TokenObjective(router),
                     metrics=metrics)
    got = grads(model)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-4, atol=1e-6, msg=name)
    assert Z not in router_means(metrics) and AUX in router_means(metrics)
    off = router_loss_for(model, aux=False, z=False)  # no term trained; the expert load still counted
    assert off.coef is None and off.z_coef is None and off.layers == 4


def test_padding_is_left_out_of_both_terms():
    from transformers.models.switch_transformers.modeling_switch_transformers import load_balancing_loss_func, router_z_loss_func

    torch.manual_seed(5)
    layers = [torch.randn(3, 6, 4) * 3 for _ in range(2)]  # 2 layers, 3 rows of 6 tokens, 4 experts
    lengths = [6, 2, 4]
    mask = torch.arange(6)[None] < torch.tensor(lengths)[:, None]
    real = [torch.cat([lay[b, :n] for lay in layers])[None] for b, n in enumerate(lengths)]  # each row's real tokens
    want_z = router_z_loss_func(torch.cat(real, dim=1))  # one group of all real tokens: the mean over them
    want_aux = sum(load_balancing_loss_func(r.softmax(-1), r.argmax(-1)) for r in real) / len(real)
    assert float(z_loss((layers, mask))) == pytest.approx(float(want_z), rel=1e-6)
    assert float(switch_aux((layers, mask))) == pytest.approx(float(want_aux), rel=1e-6)
    assert abs(float(z_loss((layers, None))) - float(want_z)) > 1e-3  # the padding's logits would change it
    unpadded = torch.cat(layers, dim=1)  # no mask: transformers' own value
    assert float(switch_aux((layers, None))) == pytest.approx(float(load_balancing_loss_func(unpadded.softmax(-1), unpadded.argmax(-1))), rel=1e-6)


def test_accumulation_weights_each_micro_batch_by_its_targets():
    model = tiny_switch()
    router = router_loss_for(model)
    src, tgt = ids(3, 8, 6), ids(3, 6, 7)
    parts = [seq2seq_batch(model, src[:1], tgt[:1], [8], [6]), seq2seq_batch(model, src[1:], tgt[1:], [8, 8], [3, 6])]
    zs = []
    for part in parts:
        routed: dict = {}
        loss_sum(model, part, FP32, routed=routed)
        enc = (tuple(routed["encoder"]), part.attention_mask)
        dec = (tuple(routed["decoder"]), part.labels != IGNORE)
        zs.append(float((z_loss(enc) + z_loss(dec)).detach()))
    metrics: dict = {}
    forward_backward(model, parts, FP32, CPU, objective=TokenObjective(router), metrics=metrics)
    weights = [p.n_targets for p in parts]
    assert router_means(metrics)[Z] == pytest.approx(sum(z * w for z, w in zip(zs, weights)) / sum(weights), rel=1e-5)


def test_a_stack_of_sparse_step_1_adds_nothing_as_in_transformers():
    model = tiny_switch(sparse_encoder=4)  # every encoder layer sparse: transformers adds no encoder term
    src, tgt = ids(2, 8, 8), ids(2, 6, 9)
    out = model(input_ids=src, labels=tgt, output_router_logits=True)
    assert out.encoder_z_loss == 0 and len(out.encoder_router_logits) == 4
    out.loss.backward()
    expected = grads(model)
    router = router_loss_for(model)
    assert router.sides == (False, True)
    forward_backward(model, [seq2seq_batch(model, src, tgt, [8, 8], [6, 6])], FP32, CPU, objective=TokenObjective(router))
    got = grads(model)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-4, atol=1e-6, msg=name)


def test_decoder_only_families_have_no_z_term():
    from test_router_loss import tiny_moe

    router = router_loss_for(tiny_moe())
    assert router.kind == "causal" and router.z_coef is None
