"""The fused chunked LM-head cross-entropy equals the standard path: loss and every gradient."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import make_store
from trainforge.config.run import LoraSettings, ModelSettings
from trainforge.data.loader import RowCollator
from trainforge.data.packing import build_rows
from trainforge.engine import loss as loss_module
from trainforge.engine.loss import fused_head
from trainforge.engine.step import loss_sum
from trainforge.hardware.device import PRECISIONS
from trainforge.model.load import apply_lora, build_model
from trainforge.model.tokenizer import load_tokenizer

FP32 = PRECISIONS["fp32"]


def batch_for(tok, tmp_path):
    gen = torch.Generator().manual_seed(0)
    seqs = []
    for n, masked in ((12, 5), (30, 0), (7, 6), (19, 19)):  # one sequence with no target at all
        ids = torch.randint(2, len(tok), (n,), generator=gen).tolist()
        seqs.append((ids, [0] * masked + [1] * (n - masked)))
    store = make_store(tmp_path / "s", seqs, len(tok))
    return RowCollator(store, tok.pad_token_id, True, 40)(build_rows(store, np.arange(4), True, 40), [0])


def model_variant(model_dir, tok, variant: str) -> torch.nn.Module:
    """The tiny model with an untied head (default), a tied one, LoRA adapters, or a biased head."""
    model = build_model(ModelSettings(path=model_dir), tok, seed=0)
    if variant == "tied":
        model.lm_head.weight = model.model.embed_tokens.weight
    if variant == "lora":
        model = apply_lora(model, LoraSettings(r=4, alpha=8))
        for n, p in model.named_parameters():  # make B non-zero so adapter gradients are not trivially equal
            if "lora_B" in n:
                torch.nn.init.normal_(p, std=0.02)
    if variant == "bias":  # a head with a bias (GPT-2-style heads have none, some others do)
        head = torch.nn.Linear(model.lm_head.in_features, model.lm_head.out_features, bias=True)
        with torch.no_grad():
            head.weight.copy_(model.lm_head.weight)
            head.bias.normal_(std=0.1, generator=torch.Generator().manual_seed(0))
        model.lm_head = head
        assert fused_head(model)[1] is head
    return model


def grads(model, batch, fused):
    model.zero_grad(set_to_none=True)
    loss = loss_sum(model, batch, FP32, fused=fused)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("variant", ["untied", "tied", "lora", "small-chunks"])
def test_fused_matches_standard(tiny_model_dir, tmp_path, monkeypatch, variant):
    tok = load_tokenizer(tiny_model_dir)
    model = model_variant(tiny_model_dir, tok, variant)
    if variant == "small-chunks":
        monkeypatch.setattr(loss_module, "CPU_CHUNK", 7)
    assert fused_head(model) is not None
    batch = batch_for(tok, tmp_path)
    loss_f, g_f = grads(model, batch, fused=True)
    loss_s, g_s = grads(model, batch, fused=False)
    torch.testing.assert_close(loss_f, loss_s, rtol=1e-6, atol=1e-5)
    assert g_f.keys() == g_s.keys() and g_f
    for name in g_s:
        torch.testing.assert_close(g_f[name], g_s[name], rtol=1e-4, atol=1e-6, msg=name)


def test_head_with_lora_or_logit_transforms_falls_back(tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    model = build_model(ModelSettings(path=tiny_model_dir), tok, seed=0)
    assert fused_head(apply_lora(model, LoraSettings(r=4, target_modules=["lm_head", "q_proj"]))) is None
    model = build_model(ModelSettings(path=tiny_model_dir), tok, seed=0)
    model.config.final_logit_softcapping = 30.0
    assert fused_head(model) is None


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("variant", ["untied", "tied", "lora", "dense", "bias"])
def test_fused_matches_standard_under_autocast(tiny_model_dir, tmp_path, precision, variant):
    """Under bf16/fp16 autocast the fused head runs its matmuls in the low precision, as the
    standard head does, and hands back gradients in the hidden state's dtype: the two paths
    agree to that precision's rounding (both round the same logits' inputs)."""
    tok = load_tokenizer(tiny_model_dir)
    model = model_variant(tiny_model_dir, tok, variant)
    batch = batch_for(tok, tmp_path)
    if variant == "dense":  # every position a target: the slicing path
        batch.labels = torch.where(batch.labels == -100, batch.input_ids, batch.labels)
    p = PRECISIONS[precision]

    def run(fused):
        model.zero_grad(set_to_none=True)
        loss = loss_sum(model, batch, p, fused=fused)
        assert loss.dtype == torch.float32
        loss.backward()
        return loss.detach(), {n: q.grad.clone() for n, q in model.named_parameters() if q.grad is not None}

    loss_f, g_f = run(True)
    loss_s, g_s = run(False)
    assert torch.isfinite(loss_f)
    # both compute logits from the same low-precision inputs; the loss is summed in fp32 on both sides
    torch.testing.assert_close(loss_f, loss_s, rtol=2e-3, atol=1e-2)
    assert g_f.keys() == g_s.keys() and g_f
    for name in g_s:
        assert g_f[name].dtype == g_s[name].dtype == torch.float32, name
        # per-element rounding of a 16-bit format (8 or 11 mantissa bits) on gradients of size ~1e-2..1e-1
        rel = (g_f[name] - g_s[name]).norm() / g_s[name].norm().clamp_min(1e-12)
        assert rel < (2e-2 if precision == "bf16" else 3e-3), (name, float(rel))


def test_weight_gradient_chunks_accumulate_in_fp32_without_a_parameter_sized_copy():
    """fp32: the GEMM adds in place (same sum as mm + add); bf16 on a CPU: the general path (no fp32-output
    GEMM there); fake tensors a plan traces for CUDA: the fp32-output addmm, as a CUDA run takes it."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from trainforge.engine.loss import _FAKE_FP32_OUT_ADDMM, _fp32_out_gemm, add_weight_grad, chunk_as

    gen = torch.Generator().manual_seed(0)
    g, h = torch.randn(16, 40, generator=gen), torch.randn(16, 24, generator=gen)
    acc = torch.randn(40, 24, generator=gen)
    expected = acc + g.t() @ h
    add_weight_grad(acc, g, h)
    torch.testing.assert_close(acc, expected)
    low = torch.zeros(40, 24)
    add_weight_grad(low, g.bfloat16(), h.bfloat16())
    torch.testing.assert_close(low, (g.bfloat16().t() @ h.bfloat16()).float())
    assert not _fp32_out_gemm(g.bfloat16())
    with FakeTensorMode(), chunk_as("cuda"):
        fake = torch.empty(16, 40, dtype=torch.bfloat16)
        assert _fp32_out_gemm(fake) == _FAKE_FP32_OUT_ADDMM
    with FakeTensorMode(), chunk_as("cpu"):
        assert not _fp32_out_gemm(torch.empty(16, 40, dtype=torch.bfloat16))



@pytest.mark.parametrize(
    ("version", "real", "fake"),
    [("2.8.0", False, False), ("2.9.1+cu128", False, False), ("2.10.0", True, False), ("2.12.1", True, False), ("2.13.0+cpu", True, True)],
)
def test_fp32_output_gemm_only_from_the_torch_that_takes_an_fp32_accumulator(version, real, fake):
    """torch 2.8 and 2.9 have addmm's out_dtype but their CUDA kernel refuses an fp32 self beside bf16
    operands: a CUDA run there would fail at its first backward, so they take the general path. A plan's
    fake tensors raise on that overload until 2.13."""
    from trainforge.hardware.device import fp32_out_addmm_in

    assert fp32_out_addmm_in(version) is real
    assert fp32_out_addmm_in(version, fake=True) is fake


def test_lora_targets_take_one_name_and_refuse_names_the_model_lacks(tiny_model_dir):
    """config.md says module names: a single name adapts that module (PEFT alone reads a string as a regex over
    full names and matched nothing), and a name no module has is a config error listing the linear layers."""
    from trainforge.config.run import ConfigError

    tok = load_tokenizer(tiny_model_dir)
    model = apply_lora(build_model(ModelSettings(path=tiny_model_dir), tok, seed=0), LoraSettings(r=4, target_modules="q_proj"))
    adapted = {n.rsplit(".lora_A", 1)[0].rsplit(".", 1)[-1] for n, _ in model.named_parameters() if ".lora_A" in n}
    assert adapted == {"q_proj"}
    with pytest.raises(ConfigError, match=r"model.lora.target_modules: q, v names no module of this model; its linear "
                                          r"layers are .*q_proj.*v_proj.* \(or use all-linear\)"):
        apply_lora(build_model(ModelSettings(path=tiny_model_dir), tok, seed=0), LoraSettings(r=4, target_modules=["q", "v"]))


def test_lora_over_a_tokenizer_with_added_tokens_says_their_rows_stay_untrained(tiny_model_dir, tmp_path):
    from trainforge.config.run import ModelSettings as Settings

    tok = load_tokenizer(tiny_model_dir)
    tok.add_special_tokens({"additional_special_tokens": ["<|turn_end|>"]})
    said = []
    build_model(Settings(path=tiny_model_dir, method="lora"), tok, seed=0, warn=said.append)
    assert len(said) == 1 and "1 token beyond the model's" in said[0] and "<|turn_end|>" in said[0] and "lora trains none" in said[0]
    said.clear()
    build_model(Settings(path=tiny_model_dir, method="full"), tok, seed=0, warn=said.append)
    assert said == []  # a full fine-tune trains the new rows


def test_granite_logits_scaling_takes_the_models_own_head():
    """Granite divides its logits by ``config.logits_scaling`` (8 to 16 in the released checkpoints): the fused
    head, which computes lm_head(hidden) only, trained those models on unscaled logits (another loss and
    gradient). Such a model takes its own head; with a scaling of 1 the fused head still serves."""
    from transformers import AutoModelForCausalLM, GraniteConfig

    from trainforge.data.loader import Batch

    torch.manual_seed(0)
    config = GraniteConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, logits_scaling=8.0)
    model = AutoModelForCausalLM.from_config(config)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    labels = ids.roll(-1, 1)
    labels[:, -1] = -100
    batch = Batch(ids, labels, None, 24, int((labels != -100).sum()), [0, 1])
    p = PRECISIONS["fp32"]
    assert fused_head(model) is None
    scaled = loss_sum(model, batch, p, fused=True)  # asks for the fused head, gets the model's own
    model.config.logits_scaling = 1.0
    assert fused_head(model) is not None
    fused = loss_sum(model, batch, p, fused=True)  # really through the chunked head now
    torch.testing.assert_close(fused, loss_sum(model, batch, p, fused=False))  # which equals the model's own head
    # and with the scaling of 8 the model's own head divides the logits, so the chunked head would train another
    # loss: the run took the model's head there
    model.config.logits_scaling = 8.0
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    own = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100, reduction="sum")
    torch.testing.assert_close(scaled, own)
    assert abs(fused.item() - own.item()) > 1e-3 * own.item()
