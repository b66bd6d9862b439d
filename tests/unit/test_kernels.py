"""train.kernels: which kernels a run gets, how Liger's are swapped in, and Liger's fused loss wired
into trainforge's loss (run under Triton's CPU interpreter, in a subprocess)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from trainforge.model import kernels
from trainforge.model.kernels import KernelsUnavailable, resolve_kernels

liger = pytest.importorskip("liger_kernel")


@pytest.mark.parametrize(
    "requested, device, installed, interpreted, expected",
    [
        ("auto", "cuda", True, False, "liger"),
        ("auto", "cuda", False, False, "torch"),  # not installed: PyTorch's ops, no error
        ("auto", "cpu", True, False, "torch"),
        ("auto", "cpu", True, True, "torch"),  # the interpreter is for tests that ask for liger by name
        ("torch", "cuda", True, False, "torch"),
        ("liger", "cuda", True, False, "liger"),
        ("liger", "cpu", True, True, "liger"),
    ],
)
def test_resolve_kernels(monkeypatch, requested, device, installed, interpreted, expected):
    monkeypatch.setattr(kernels, "liger_installed", lambda: installed)
    monkeypatch.setattr(kernels, "triton_interpreted", lambda: interpreted)
    assert resolve_kernels(requested, device) == expected


def test_liger_that_cannot_run_is_refused_with_the_fix(monkeypatch):
    monkeypatch.setattr(kernels, "triton_interpreted", lambda: False)
    monkeypatch.setattr(kernels, "liger_installed", lambda: True)
    with pytest.raises(KernelsUnavailable, match="train.kernels: liger runs Triton kernels on CUDA.*auto or torch") as e:
        resolve_kernels("liger", "cpu")
    assert e.value.exit_code == 2
    monkeypatch.setattr(kernels, "liger_installed", lambda: False)
    with pytest.raises(KernelsUnavailable, match=r"pip install 'trainforge\[gpu\]'"):
        resolve_kernels("liger", "cuda")


def test_config_takes_kernels():
    from pydantic import ValidationError

    from trainforge.config.run import TrainSettings

    assert TrainSettings().kernels == "auto"
    with pytest.raises(ValidationError, match="kernels"):
        TrainSettings.model_validate({"kernels": "triton"})


def tiny(architecture: str = "llama"):
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

    torch.manual_seed(0)
    if architecture == "llama":
        config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    else:
        config = GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=4)
    return AutoModelForCausalLM.from_config(config)


@pytest.fixture
def restore_llama_module(monkeypatch):
    """Liger replaces module-level names of transformers' Llama code: put them back after the test."""
    from transformers.models.llama import modeling_llama

    for name in ("apply_rotary_pos_emb", "LlamaRMSNorm", "LlamaMLP"):
        monkeypatch.setattr(modeling_llama, name, getattr(modeling_llama, name))


def test_apply_liger_swaps_llama_layers_and_marks_the_head(restore_llama_module):
    """Which modules Liger took over, checked without running them (Triton needs CUDA or its interpreter)."""
    model = tiny()
    used = kernels.apply_liger(model)
    assert used == ["rms_norm", "rope", "swiglu", "fused_linear_cross_entropy"]
    layer = model.model.layers[0]
    assert layer.mlp._get_name() == "LigerSwiGLUMLP"
    assert "Liger" in type(layer.input_layernorm).__name__ or layer.input_layernorm._get_name().startswith("Liger")
    assert getattr(model.lm_head, kernels.LIGER_LOSS)
    from transformers.models.llama import modeling_llama

    assert modeling_llama.apply_rotary_pos_emb.__module__.startswith("liger_kernel")


def test_the_kernels_reported_are_the_ones_liger_swaps_in_for_gemma():
    """Gemma's MLP is GEGLU and Gemma 3 (multimodal) has LayerNorms: Liger swaps them in by default, so they
    are passed and named like Llama's SwiGLU (they were swapped in unnamed)."""
    pytest.importorskip("liger_kernel")
    assert kernels.liger_apply_function("gemma")[1] == ["rms_norm", "rope", "geglu"]
    assert kernels.liger_apply_function("gemma3")[1] == ["rms_norm", "layer_norm", "rope", "geglu"]
    assert kernels.liger_apply_function("llama")[1] == ["rms_norm", "rope", "swiglu"]


def test_an_architecture_whose_rope_liger_refuses_keeps_its_own(monkeypatch):
    """Liger raises for rope=True on GLM-4 (its default is off there): trainforge follows Liger's defaults,
    and says only the kernels that were swapped in."""
    from transformers import AutoModelForCausalLM, Glm4Config
    from transformers.models.glm4 import modeling_glm4

    for name in ("apply_rotary_pos_emb", "Glm4RMSNorm", "Glm4MLP"):
        if hasattr(modeling_glm4, name):
            monkeypatch.setattr(modeling_glm4, name, getattr(modeling_glm4, name))
    rope_before = modeling_glm4.apply_rotary_pos_emb
    model = AutoModelForCausalLM.from_config(Glm4Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                        num_attention_heads=4, num_key_value_heads=2, head_dim=8, pad_token_id=0))
    used = kernels.apply_liger(model)
    assert "rope" not in used and "rms_norm" in used and modeling_glm4.apply_rotary_pos_emb is rope_before


def test_a_torch_model_built_after_a_liger_one_is_torch_throughout(restore_llama_module):
    """Liger replaces names in transformers' Llama module for the whole process: restore_torch_layers (called
    by build_model for kernels: torch) puts PyTorch's back, so a second run or selftest's comparison is fair."""
    from transformers.models.llama import modeling_llama

    originals = {n: getattr(modeling_llama, n) for n in ("apply_rotary_pos_emb", "LlamaRMSNorm", "LlamaMLP")}
    kernels.apply_liger(tiny())
    kernels.apply_liger(tiny())  # a second Liger model: the originals kept are still PyTorch's
    assert modeling_llama.apply_rotary_pos_emb is not originals["apply_rotary_pos_emb"]
    kernels.restore_torch_layers()
    assert {n: getattr(modeling_llama, n) for n in originals} == originals
    layer = tiny().model.layers[0]
    assert type(layer.mlp) is originals["LlamaMLP"] and type(layer.input_layernorm) is originals["LlamaRMSNorm"]


def test_unknown_architecture_keeps_torch_layers_and_says_so():
    model = tiny("gpt2")
    said = []
    used = kernels.apply_liger(model, said.append)
    assert used == ["fused_linear_cross_entropy"] and "no layer kernels for 'gpt2'" in said[0]


def test_the_loss_stays_torch_on_cpu_without_the_interpreter(monkeypatch):
    """A marked head on a CPU tensor (no interpreter) takes trainforge's own chunked loss."""
    monkeypatch.setattr(kernels, "triton_interpreted", lambda: False)
    head = torch.nn.Linear(8, 16, bias=False)
    setattr(head, kernels.LIGER_LOSS, True)
    assert not kernels.uses_liger_loss(head, torch.zeros(2, 8))


INTERPRETED = textwrap.dedent(
    """
    import json, torch
    from trainforge.engine.loss import linear_cross_entropy
    from trainforge.model.kernels import LIGER_LOSS, uses_liger_loss

    torch.manual_seed(0)
    n, h, v = 24, 16, 40
    labels = torch.randint(0, v, (n,))
    labels[:7] = -100  # prompt positions: no target
    out = {}
    for bias in (False, True):
        results = []
        for liger in (False, True):
            torch.manual_seed(1)
            head = torch.nn.Linear(h, v, bias=bias)
            if liger:
                setattr(head, LIGER_LOSS, True)
            hidden = torch.randn(n, h, requires_grad=True)
            assert uses_liger_loss(head, hidden) is liger  # the interpreter lets the marked head take Liger's path
            loss = linear_cross_entropy(hidden, head, labels)
            loss.backward()
            grads = [hidden.grad, head.weight.grad] + ([head.bias.grad] if bias else [])
            results.append((loss.detach(), grads))
        (l0, g0), (l1, g1) = results
        out[str(bias)] = {
            "loss": [float(l0), float(l1)],
            "grad_gap": max(float((a - b).abs().max()) for a, b in zip(g0, g1)),
            "grad_scale": max(float(a.abs().max()) for a in g0),
        }
    print(json.dumps(out))
    """
)


def _triton_release() -> tuple[int, int]:
    import triton

    return tuple(int(p) for p in triton.__version__.split(".")[:2])


@pytest.mark.slow
@pytest.mark.skipif(_triton_release() < (3, 9), reason="Triton 3.6's CPU interpreter cannot run Liger's cross-entropy kernel "
                    "(it reads a one-element array as an index); 3.9's does. A GPU compiles the kernel instead: selftest")
def test_liger_fused_loss_matches_trainforge_loss_under_the_interpreter():
    """Liger's fused linear cross-entropy through trainforge's wiring (target positions only, sum,
    fp32) equals trainforge's own loss, value and gradients, with and without a bias."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", INTERPRETED], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    for case in result.values():
        torch_loss, liger_loss = case["loss"]
        assert abs(torch_loss - liger_loss) <= 1e-5 * abs(torch_loss)
        assert case["grad_gap"] <= 1e-5 * max(case["grad_scale"], 1.0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_liger_step_matches_torch_step_on_cuda(restore_llama_module):
    """One bf16 forward/backward of a tiny Llama: Liger's kernels vs PyTorch's, loss and gradients."""
    from trainforge.engine.loss import fused_head, linear_cross_entropy

    results = []
    for liger_on in (False, True):
        model = tiny().cuda()
        if liger_on:
            kernels.apply_liger(model)
        ids = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(0)).cuda()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            decoder, head = fused_head(model)
            hidden = decoder(input_ids=ids[:, :-1]).last_hidden_state
            loss = linear_cross_entropy(hidden.flatten(0, 1), head, ids[:, 1:].flatten())
        loss.backward()
        results.append((float(loss), [p.grad.float() for p in model.parameters()]))
    (l0, g0), (l1, g1) = results
    assert abs(l0 - l1) <= 1e-2 * abs(l0)
    for a, b in zip(g0, g1):
        assert (a - b).abs().max() <= 5e-2 * a.abs().max() + 1e-6


@pytest.mark.parametrize("torch_takes_it", [True, False])
def test_liger_loss_kept_off_the_fp32_output_gemm_where_torch_refuses_it(monkeypatch, torch_takes_it):
    """On torch 2.8/2.9 Liger would accumulate the head's gradient with addmm(out_dtype=fp32) into an fp32
    buffer, which their CUDA kernel refuses: marking the head for Liger's loss turns Liger's flag off there."""
    from liger_kernel.ops import fused_linear_cross_entropy as flce

    monkeypatch.setattr(flce, "_ADDMM_SUPPORTS_OUT_DTYPE", True)
    monkeypatch.setattr(kernels, "fp32_out_addmm_in", lambda: torch_takes_it)
    assert kernels.keep_liger_off_fp32_out_addmm() is (not torch_takes_it)
    assert flce._ADDMM_SUPPORTS_OUT_DTYPE is torch_takes_it


def test_a_model_that_transforms_its_logits_keeps_its_head_out_of_the_fused_loss(restore_llama_module):
    """Granite divides its logits by ``logits_scaling``, Gemma 2 soft-caps them: the model's own head takes the loss,
    so the head is not marked for Liger's fused loss, and the kernels reported do not claim it."""
    model = tiny()
    model.config.logits_scaling = 8.0
    used = kernels.apply_liger(model)
    assert "fused_linear_cross_entropy" not in used and not getattr(model.lm_head, kernels.LIGER_LOSS, False)
    assert kernels.transforms_logits(model.config)
    model.config.logits_scaling = 1.0
    assert not kernels.transforms_logits(model.config)


@pytest.mark.parametrize("field, value", [("lm_head_multiplier", 0.25), ("output_multiplier", 2.0), ("logit_scale", 0.0625),
                                          ("final_logit_softcapping", 30.0), ("logits_scaling", 8.0)])
@pytest.mark.parametrize("nested", [False, True], ids=["top", "text_config"])
def test_every_logit_scale_a_causal_lm_applies_is_seen(field, value, nested):
    """Falcon-H1 multiplies lm_head's output by ``lm_head_multiplier``: the fused head left it out and trained another
    objective (loss 5.75 against 5.76, a gradient 4x too large). Multimodal models keep such fields in ``text_config``."""
    from types import SimpleNamespace

    fields = {field: value}
    config = SimpleNamespace(text_config=SimpleNamespace(**fields)) if nested else SimpleNamespace(**fields)
    assert kernels.transforms_logits(config)
    neutral = {field: 1.0 if field in kernels.LOGIT_SCALES else None}
    assert not kernels.transforms_logits(SimpleNamespace(text_config=SimpleNamespace(**neutral)) if nested else SimpleNamespace(**neutral))


def test_the_fused_head_takes_falcon_h1s_multiplied_logits():
    """End to end on a tiny Falcon-H1: with lm_head_multiplier 0.25 the run's loss is the model's own."""
    import transformers

    from trainforge.engine.loss import fused_head

    def tiny(multiplier: float):
        return transformers.AutoModelForCausalLM.from_config(transformers.FalconH1Config(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, mamba_d_state=8, mamba_n_heads=2, mamba_d_head=16, mamba_d_ssm=32, mamba_n_groups=1,
            lm_head_multiplier=multiplier))

    model = tiny(0.25)
    assert fused_head(model) is None  # the model's own head, multiplier included
    # the model keeps the multiplier it was built with: a config edited afterwards does not change its logits, and the
    # probe of engine/head_exact.py sees that (the config alone would have said "exact")
    model.config.lm_head_multiplier = 1.0
    assert fused_head(model) is None
    assert fused_head(tiny(1.0)) is not None
