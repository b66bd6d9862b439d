"""The fused head only where a model's logits are lm_head(decoder output): a transform between them (ELECTRA,
RoFormer, ModernBERT's decoder), of another width or, worse, of the same width (a wrong loss, no error), sends the
model to its own head; Llama 4's get_decoder (the whole causal LM) is looked through to its stack."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from trainforge.data.formats import IGNORE
from trainforge.data.loader import Batch
from trainforge.engine import head_exact
from trainforge.engine.loss import fused_head, head_choice, loss_head_fact
from trainforge.engine.step import loss_sum
from trainforge.hardware.device import PRECISIONS
from trainforge.tools.family_shrink import tiny_config

FP32 = PRECISIONS["fp32"]
VOCAB = 64


def tiny(family: str, seed: int = 0, **fields) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    config = tiny_config(family, VOCAB)
    for k, v in fields.items():
        setattr(config, k, v)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).eval()  # no dropout: the two losses compare exactly


def a_batch(rows: int = 2, length: int = 12) -> Batch:
    ids = torch.randint(3, VOCAB, (rows, length), generator=torch.Generator().manual_seed(0))
    labels = torch.roll(ids, -1, 1)
    labels[:, -1] = IGNORE
    labels[0, :3] = IGNORE  # a prompt: no target
    positions = torch.arange(length).repeat(rows, 1)
    return Batch(ids, labels, positions, ids.numel(), int((labels != IGNORE).sum()), list(range(rows)))


def standard_loss(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), batch.labels.flatten(), ignore_index=IGNORE, reduction="sum")


@pytest.mark.parametrize("family, fields, between", [
    ("electra", {"embedding_size": 32}, "generator_predictions"),  # the same width as the hidden state: no shape error
    ("electra", {"embedding_size": 16}, "generator_predictions"),
    ("roformer", {"embedding_size": 32}, "cls"),
])
def test_a_transform_between_decoder_and_head_takes_the_models_own_head(family, fields, between):
    model = tiny(family, **fields)
    choice = head_choice(model)
    assert isinstance(choice, str) and between in choice, choice
    assert fused_head(model) is None
    batch = a_batch()
    # loss_sum with fused=True gives the loss of the model's own logits, to the bit
    torch.testing.assert_close(loss_sum(model, batch, FP32, fused=True), standard_loss(model, batch), rtol=0, atol=0)


def test_same_width_transform_would_have_given_another_loss():
    """The failure the probe catches: decoder + head apart computes a loss without any error, and a wrong one."""
    model = tiny("electra", embedding_size=32)
    decoder, head = model.get_decoder(), model.get_output_embeddings()
    batch = a_batch()
    hidden = decoder(input_ids=batch.input_ids, position_ids=batch.position_ids).last_hidden_state
    split = F.cross_entropy(head(hidden).flatten(0, 1), batch.labels.flatten(), ignore_index=IGNORE, reduction="sum")
    assert (split - standard_loss(model, batch)).abs() > 1e-3


def test_modernbert_decoders_linear_get_decoder_is_not_taken():
    model = tiny("modernbert-decoder")
    assert fused_head(model) is None
    batch = a_batch()
    torch.testing.assert_close(loss_sum(model, batch, FP32, fused=True), standard_loss(model, batch), rtol=0, atol=0)


def test_llama4s_whole_causal_lm_decoder_is_looked_through_to_its_stack():
    model = tiny("llama4_text")
    decoder, head = fused_head(model)
    assert decoder is model.model and head is model.lm_head
    batch = a_batch()
    torch.testing.assert_close(loss_sum(model, batch, FP32, fused=True), standard_loss(model, batch), rtol=1e-5, atol=1e-4)


def test_decided_once_per_model_and_head_without_moving_the_random_state(monkeypatch):
    model = tiny("llama").train()
    calls = []
    probe = head_exact._probe
    monkeypatch.setattr(head_exact, "_probe", lambda *a: calls.append(1) or probe(*a))
    state = torch.get_rng_state()
    for _ in range(3):
        assert fused_head(model) is not None
    assert len(calls) == 1
    assert torch.equal(state, torch.get_rng_state())
    assert all(m.training for m in model.modules())  # train mode given back to every module
    model.lm_head = torch.nn.Linear(32, VOCAB, bias=False)  # another head: decided again
    assert fused_head(model) is not None and len(calls) == 2


def test_a_model_without_values_is_judged_by_its_layout():
    """A plan traces on fake/meta tensors, where no probe can compute: parameters outside decoder and head decide."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        electra = AutoModelForCausalLM.from_config(tiny_config("electra", VOCAB))
        llama = AutoModelForCausalLM.from_config(tiny_config("llama", VOCAB))
    assert "generator_predictions" in head_choice(electra)
    assert fused_head(llama) is not None


def test_the_run_says_why_its_loss_takes_the_models_head():
    said = []
    assert loss_head_fact(tiny("roformer", embedding_size=32), True, False, said.append) == "model"
    assert len(said) == 1 and "train.fused_loss cannot apply" in said[0] and "cls" in said[0]
    assert loss_head_fact(tiny("llama"), True, False, said.append) == "fused" and len(said) == 1
    assert loss_head_fact(tiny("llama"), False, False, said.append) == "model" and len(said) == 1


def test_a_model_whose_own_forward_fails_on_text_is_refused_before_any_step(monkeypatch):
    """transformers 5.24's Llama4ForConditionalGeneration.forward reads ``image_outputs`` its language model never
    returns: every step would raise. The probe turns that into exit 2 naming the class and the error."""
    from trainforge.hf_dir import UnsupportedModelDir

    model = tiny("llama")

    def broken(*args, **kwargs):
        raise AttributeError("'MoeCausalLMOutputWithPast' object has no attribute 'image_outputs'")

    monkeypatch.setattr(model, "forward", broken)
    with pytest.raises(UnsupportedModelDir, match=r"LlamaForCausalLM\.forward fails on text input .*image_outputs") as e:
        fused_head(model)
    assert e.value.exit_code == 2


def test_summary_kernels_drop_liger_head_loss_where_the_model_computes_its_logits():
    from trainforge.engine.loss import kernels_for_head

    liger = ["rms_norm", "rope", "swiglu", "fused_linear_cross_entropy"]
    assert kernels_for_head(liger, "fused") == liger
    assert kernels_for_head(liger, "model") == ["rms_norm", "rope", "swiglu"]
    assert kernels_for_head(["fused_linear_cross_entropy"], "model") == "torch"
    assert kernels_for_head("torch", "model") == "torch"


def test_a_probe_that_fails_is_a_warning_not_a_note(monkeypatch):
    """A failing probe is trainforge's problem, not the model's: the run still trains (on the model's head), but the
    console warns; a model whose logits differ is said as a note."""
    monkeypatch.setattr(head_exact, "_probe", lambda *a: "decoder + head failed on a probe: RuntimeError: no fp32 kernel")
    said, warned = [], []
    assert loss_head_fact(tiny("llama"), True, False, said.append, warned.append) == "model"
    assert not said and len(warned) == 1 and "RuntimeError: no fp32 kernel" in warned[0] and "report" in warned[0]
