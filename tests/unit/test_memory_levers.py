"""Memory levers: activation checkpointing, the frozen base in the compute precision, QLoRA, DoRA/rsLoRA.

Exact on the tiny fixed-seed Llama: checkpointed gradients equal plain ones, the base's storage
dtype and bytes are what the run's precision says, adapters load back on fp32, bf16 and 4-bit bases.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from conftest import make_store
from trainforge.config.run import LoraSettings, ModelSettings
from trainforge.data.loader import RowCollator
from trainforge.data.packing import packed_rows, single_rows
from trainforge.engine.loss import fused_head
from trainforge.engine.step import forward_backward
from trainforge.hardware.device import PRECISIONS
from trainforge.model.load import build_model, count_parameters, describe_storage, weight_storage
from trainforge.model.tokenizer import load_tokenizer

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


@pytest.fixture(scope="module")
def store(tmp_path_factory, tok):
    gen = torch.Generator().manual_seed(0)
    sequences = []
    for length, n_masked in [(5, 2), (17, 10), (9, 0), (30, 25), (12, 3), (20, 0)]:
        ids = torch.randint(0, len(tok), (length + 1,), generator=gen).tolist()
        sequences.append((ids, [False] * (n_masked + 1) + [True] * (length - n_masked)))
    return make_store(tmp_path_factory.mktemp("store") / "s", sequences, len(tok))


def batches(store, tok, packed: bool) -> list:
    index = np.arange(len(store))
    if packed:  # several documents per row, isolated through position_ids
        rows = packed_rows(store, index, 48)
        collate = RowCollator(store, tok.pad_token_id, True, 48)
    else:
        rows = single_rows(store, index)
        collate = RowCollator(store, tok.pad_token_id, False, 64)
    return [collate(rows, list(range(len(rows))))]


def model_for(tiny_model_dir, tok, method: str, checkpointing: bool, dtype: torch.dtype | None = None, **lora):
    settings = ModelSettings(path=tiny_model_dir, method=method, lora=LoraSettings(r=4, **lora))
    model = build_model(settings, tok, seed=0, compute_dtype=dtype, activation_checkpointing=checkpointing)
    model.train()
    fused_head(model)  # decided now: its one probe forward (engine/head_exact.py) is not a training step's
    return model


def grads(model, micro_batches) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss = forward_backward(model, micro_batches, PRECISIONS["fp32"], CPU)
    return {"loss": loss.detach().clone(), **{n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}}


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
@pytest.mark.parametrize("method", ["full", "lora"])
def test_checkpointed_gradients_equal_plain_ones(tiny_model_dir, tok, store, method, packed):
    micro = batches(store, tok, packed)
    plain = grads(model_for(tiny_model_dir, tok, method, False), micro)
    model = model_for(tiny_model_dir, tok, method, True)
    layer = model.get_base_model().model.layers[0] if method == "lora" else model.model.layers[0]
    calls = []
    layer.self_attn.register_forward_hook(lambda *_: calls.append(1))
    checked = grads(model, micro)
    assert len(calls) == 2  # the layer ran again in backward: checkpointing is on, not a no-op
    assert plain.keys() == checked.keys() and len(plain) > 1
    for name in plain:
        torch.testing.assert_close(checked[name], plain[name], rtol=1e-6, atol=1e-7, msg=name)


def test_without_checkpointing_a_layer_runs_once(tiny_model_dir, tok, store):
    model = model_for(tiny_model_dir, tok, "full", False)
    calls = []
    model.model.layers[0].self_attn.register_forward_hook(lambda *_: calls.append(1))
    grads(model, batches(store, tok, True))
    assert len(calls) == 1


def test_the_frozen_lora_base_is_stored_in_the_compute_dtype(tiny_model_dir, tok):
    fp32 = model_for(tiny_model_dir, tok, "lora", False)
    bf16 = model_for(tiny_model_dir, tok, "lora", False, torch.bfloat16)
    s32, s16 = weight_storage(fp32), weight_storage(bf16)
    assert set(s32["frozen"]) == {"float32"} and set(s16["frozen"]) == {"bfloat16"}
    assert s16["trainable"] == s32["trainable"] and set(s16["trainable"]) == {"float32"}  # adapters stay fp32
    assert s16["frozen"]["bfloat16"] == s32["frozen"]["float32"]
    nbytes = lambda m: sum(p.numel() * p.element_size() for p in m.parameters())  # noqa: E731
    frozen = s32["frozen"]["float32"]
    assert nbytes(fp32) - nbytes(bf16) == 2 * frozen  # exactly half the base's bytes saved
    assert describe_storage(s16) == f"trainable fp32 ({s16['trainable']['float32'] / 1e6:.2f}M), frozen bf16 ({frozen / 1e6:.2f}M)"
    full = build_model(ModelSettings(path=tiny_model_dir), tok, seed=0, compute_dtype=torch.bfloat16)
    assert set(weight_storage(full)["trainable"]) == {"float32"} and not weight_storage(full)["frozen"]  # fp32 masters


def test_a_bf16_base_trains_under_autocast_and_its_adapter_loads_on_fp32_and_bf16_bases(tiny_model_dir, tok, store, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = model_for(tiny_model_dir, tok, "lora", False, torch.bfloat16)
    micro = batches(store, tok, True)
    model.zero_grad(set_to_none=True)
    loss = forward_backward(model, micro, PRECISIONS["bf16"], CPU)
    assert torch.isfinite(loss)
    trained = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert all(g is not None and g.dtype == torch.float32 and g.abs().sum() > 0 for n, g in trained.items() if "lora_B" in n)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    model.save_pretrained(tmp_path / "adapter")
    saved = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    for dtype in (torch.float32, torch.bfloat16):
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=dtype)
        loaded = PeftModel.from_pretrained(base, tmp_path / "adapter")
        for n, p in loaded.named_parameters():
            if "lora_" in n:
                torch.testing.assert_close(p.float(), saved[n].float(), rtol=0, atol=1e-2 if dtype == torch.bfloat16 else 0)


def test_dora_and_rslora_reach_peft(tiny_model_dir, tok):
    model = model_for(tiny_model_dir, tok, "lora", False, use_dora=True, use_rslora=True)
    config = model.peft_config["default"]
    assert config.use_dora and config.use_rslora
    assert any("lora_magnitude_vector" in n for n, p in model.named_parameters() if p.requires_grad)
    assert model.get_base_model().model.layers[0].self_attn.q_proj.scaling["default"] == pytest.approx(32.0 / 4**0.5)


# per test: a module-level importorskip here skipped the checkpointing and DoRA tests above too
needs_bitsandbytes = pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="QLoRA needs the qlora extra")


@needs_bitsandbytes
def test_qlora_stores_the_base_in_nf4_norms_in_fp32_and_adapters_in_fp32(tiny_model_dir, tok):
    model = model_for(tiny_model_dir, tok, "qlora", False, torch.bfloat16)
    s = weight_storage(model)
    plain = weight_storage(model_for(tiny_model_dir, tok, "lora", False, torch.bfloat16))
    assert set(s["trainable"]) == {"float32"} and s["trainable"] == plain["trainable"]
    full = build_model(ModelSettings(path=tiny_model_dir), tok, seed=0)
    linear = sum(m.weight.numel() for m in full.model.layers.modules() if isinstance(m, torch.nn.Linear))
    assert s["frozen"]["nf4"] == linear  # every linear layer of the blocks is 4-bit
    assert count_parameters(model)[1] == sum(plain["trainable"].values()) + sum(plain["frozen"].values())
    norms = [p for n, p in model.named_parameters() if "norm" in n]
    assert norms and all(p.dtype == torch.float32 for p in norms)


@pytest.fixture(scope="module")
def llama64_dir(tmp_path_factory, tok):
    """The tiny Llama at width 64: bitsandbytes' CPU 4-bit inference kernel needs blocks of 64 inputs."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)  # fmt: skip
    path = tmp_path_factory.mktemp("llama64")
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@needs_bitsandbytes
def test_qlora_trains_with_checkpointing_and_final_loads_on_4bit_and_plain_bases(llama64_dir, tok, store, tmp_path):
    from peft import AutoPeftModelForCausalLM
    from transformers import BitsAndBytesConfig

    model = model_for(llama64_dir, tok, "qlora", True, torch.bfloat16)
    micro = batches(store, tok, True)
    model.zero_grad(set_to_none=True)
    loss = forward_backward(model, micro, PRECISIONS["bf16"], CPU)
    assert torch.isfinite(loss)
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for n, p in model.named_parameters() if "lora_B" in n)
    model.save_pretrained(tmp_path / "final")
    files = sorted(p.name for p in (tmp_path / "final").iterdir())
    assert files == ["README.md", "adapter_config.json", "adapter_model.safetensors"]  # the adapter only
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)
    x = torch.randint(0, len(tok), (1, 12))
    outputs = []
    for kwargs in ({"quantization_config": quant}, {"dtype": torch.float32}):
        # on the CPU, where this test runs (a 4-bit load would go to a GPU when one is present)
        loaded = AutoPeftModelForCausalLM.from_pretrained(tmp_path / "final", device_map={"": "cpu"}, **kwargs)
        with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
            outputs.append(loaded(input_ids=x).logits.float())
    assert all(torch.isfinite(o).all() for o in outputs)
    assert (outputs[0] - outputs[1]).abs().max() < 0.5  # 4-bit vs plain base: close, not equal


def test_a_lora_on_a_bf16_base_keeps_the_fused_head(tiny_model_dir, tok):
    """fp32 adapters beside bf16 weights run under autocast only: the head probe runs them so (without autocast it
    failed on mixed dtypes and sent the most common LoRA set-up to the model's own head, full logits and all)."""
    from trainforge.engine.head_exact import head_mismatch

    model = model_for(tiny_model_dir, tok, "lora", False, torch.bfloat16)
    assert fused_head(model) is not None
    decoder, head = fused_head(model)
    assert head_mismatch(model.get_base_model(), decoder, head) is None
