"""Tiled MLP (model/tiled_mlp.py): the untiled MLP's outputs and gradients, one tile's intermediate kept."""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from trainforge.config.run import LoraSettings
from trainforge.model.load import apply_lora, enable_activation_checkpointing
from trainforge.model.tiled_mlp import TiledMLPUnsupported, apply_tiled_mlp, decoder_mlps, untiled

TOKENS, TILE = 96, 16  # six tiles per row (two rows: twelve over the flattened tokens)
SHAPE = dict(vocab_size=80, hidden_size=32, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=TOKENS, head_dim=8,
             pad_token_id=0)
FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma", "phi3"]
IDS = torch.randint(0, 80, (2, TOKENS), generator=torch.Generator().manual_seed(3))


def tiny(family: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = AutoConfig.for_model(family, **SHAPE)
    return AutoModelForCausalLM.from_config(config).float()


def step(model: torch.nn.Module, ids: torch.Tensor = IDS, autocast: bool = False, **extra) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(7)  # LoRA dropout draws alike in both runs
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = model(input_ids=ids, labels=ids, **extra).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same(a: tuple, b: tuple, rtol: float, atol: float) -> None:
    torch.testing.assert_close(a[0], b[0], rtol=rtol, atol=atol)
    assert a[1].keys() == b[1].keys() and len(a[1]) > 1
    for name in a[1]:
        torch.testing.assert_close(a[1][name], b[1][name], rtol=rtol, atol=atol, msg=name)


def counted_calls(model: torch.nn.Module) -> list[int]:
    """Rows each call of the first layer's gate (or fused gate_up) projection saw."""
    mlp = decoder_mlps(model)[0]
    proj = getattr(mlp, "gate_proj", None) or mlp.gate_up_proj
    seen: list[int] = []
    proj.register_forward_hook(lambda _m, args, _o: seen.append(args[0].reshape(-1, args[0].shape[-1]).shape[0]))
    return seen


@pytest.mark.parametrize("family", FAMILIES)
def test_fp32_outputs_and_gradients_equal_the_untiled_mlp(family):
    model = tiny(family)
    plain = step(model)
    assert apply_tiled_mlp(model, TILE) == 2
    seen = counted_calls(model)
    tiled = step(model)
    assert seen == [TILE] * (2 * 2 * TOKENS // TILE)  # forward and backward each ran every tile, no more
    assert_same(tiled, plain, rtol=1e-5, atol=1e-6)


def test_bf16_autocast_equals_the_untiled_mlp_closely():
    model = tiny("llama")
    plain = step(model, autocast=True)
    apply_tiled_mlp(model, TILE)
    assert_same(step(model, autocast=True), plain, rtol=2e-2, atol=2e-3)


def per_tile_reference(model: torch.nn.Module) -> None:
    """Each MLP split into the same tiles by hand, everything kept under autograd: the draws of LoRA's dropout
    happen in the tiled function's order, so a tiled run must match it exactly."""
    for mlp in decoder_mlps(model):
        forward = mlp.forward
        mlp.forward = lambda x, f=forward: torch.cat([f(p) for p in x.reshape(-1, x.shape[-1]).split(TILE)]).view(
            *x.shape[:-1], -1)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_lora_on_the_mlp_with_fused_layers_and_checkpointing(dropout):
    settings = LoraSettings(r=4, alpha=8, dropout=dropout, target_modules=["gate_proj", "up_proj", "down_proj", "q_proj"])
    base = apply_lora(tiny("llama"), settings)
    assert base.trainforge_lora_fused == 8
    torch.manual_seed(1)
    for name, param in base.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.2)  # PEFT starts B at zero, which would hide the update
    reference = copy.deepcopy(base)
    per_tile_reference(reference)
    plain = step(reference)
    for checkpointing in (False, True):
        model = copy.deepcopy(base)
        if checkpointing:
            enable_activation_checkpointing(model)
        apply_tiled_mlp(model, TILE)
        got = step(model)
        assert any("mlp.gate_proj.lora_A" in n for n in got[1])
        assert_same(got, plain, rtol=1e-5, atol=1e-6)


def test_tiling_before_lora_reads_the_adapters_added_after():
    model = tiny("qwen2")
    apply_tiled_mlp(model, TILE)
    model = apply_lora(model, LoraSettings(r=4, target_modules=["up_proj"]))
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.2)
    tiled = step(model)
    with untiled(model):
        plain = step(model)
    assert any("up_proj.lora_B" in n for n in tiled[1])
    assert_same(tiled, plain, rtol=1e-5, atol=1e-6)


def test_packed_rows_with_position_resets():
    model = tiny("llama")
    ids = IDS[:1].repeat(1, 2)  # one row of 192 tokens: three documents, positions restarting at each
    positions = torch.cat([torch.arange(64)] * 3).unsqueeze(0)
    plain = step(model, ids, position_ids=positions)
    apply_tiled_mlp(model, TILE)
    assert_same(step(model, ids, position_ids=positions), plain, rtol=1e-5, atol=1e-6)


def test_short_inputs_and_inference_run_untiled():
    model = tiny("llama")
    apply_tiled_mlp(model, 4 * TOKENS)
    seen = counted_calls(model)
    step(model)
    assert seen == [2 * TOKENS]  # two rows fit one tile: the plain forward, recomputed by nothing
    seen.clear()
    apply_tiled_mlp(model, TILE)
    with torch.no_grad():
        model(input_ids=IDS)
    assert seen == [2 * TOKENS]


def saved_bytes(model: torch.nn.Module) -> int:
    """Bytes of every tensor the forward keeps for backward (torch.autograd.graph.saved_tensors_hooks)."""
    total = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        total.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=IDS, labels=IDS).loss
    loss.backward()
    return sum(total)


def test_the_mlp_keeps_only_its_input_for_backward():
    model = tiny("llama")
    plain = saved_bytes(model)
    apply_tiled_mlp(model, TILE)
    tiled = saved_bytes(model)
    per_layer = IDS.numel() * 4 * SHAPE["intermediate_size"]  # one fp32 intermediate over the batch
    # untiled, each MLP keeps gate, up, act(gate) and act*up: four intermediates; tiled, none (its input only)
    assert plain - tiled >= SHAPE["num_hidden_layers"] * 4 * per_layer
    assert tiled < 0.6 * plain


def test_unsupported_family_is_refused_with_the_list():
    config = AutoConfig.for_model("gpt2", vocab_size=80, n_embd=32, n_layer=1, n_head=4, n_positions=TOKENS)
    with pytest.raises(TiledMLPUnsupported, match="llama.*this model is gpt2"):
        apply_tiled_mlp(AutoModelForCausalLM.from_config(config))


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="QLoRA needs the qlora extra")
def test_qlora_base_with_lora_on_the_mlp(tiny_model_dir):
    from trainforge.config.run import ModelSettings
    from trainforge.model.load import build_model
    from trainforge.model.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny_model_dir)
    settings = ModelSettings(path=tiny_model_dir, method="qlora", lora=LoraSettings(r=4, target_modules=["gate_proj", "down_proj"]))
    model = build_model(settings, tok, seed=0, compute_dtype=torch.bfloat16).train()
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.2)
    ids = torch.randint(0, len(tok), (1, 96), generator=torch.Generator().manual_seed(5))
    plain = step(model, ids, autocast=True)
    apply_tiled_mlp(model, TILE)
    assert type(decoder_mlps(model)[0]).__name__.startswith("Tiled")
    got = step(model, ids, autocast=True)
    assert any("gate_proj.lora_A" in n for n in got[1])
    assert_same(got, plain, rtol=2e-2, atol=2e-3)
