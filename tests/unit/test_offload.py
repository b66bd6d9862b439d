"""Activation offload (engine/offload.py): the checkpointed layers' inputs leave through the hooks, and come
back for the recompute; loss and gradients are unchanged."""

from __future__ import annotations

import copy

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from trainforge.config.run import LoraSettings
from trainforge.engine.offload import BoundaryOffload, TracedOffload, checkpointed_layers, install_offload
from trainforge.model.load import apply_lora, enable_activation_checkpointing

CPU = torch.device("cpu")
TOKENS, HIDDEN, LAYERS = 64, 32, 3
IDS = torch.randint(0, 80, (2, TOKENS), generator=torch.Generator().manual_seed(3))


def tiny(checkpointing: bool = True) -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=80, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=TOKENS)
    model = AutoModelForCausalLM.from_config(config)
    if checkpointing:
        enable_activation_checkpointing(model)
    return model.train()


def step(model: torch.nn.Module) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=IDS, labels=IDS).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_boundaries_go_through_the_hooks_and_gradients_are_unchanged():
    model = tiny()
    plain = step(model)
    offload = BoundaryOffload(CPU, copy=True, min_bytes=0)
    assert install_offload(model, offload) == LAYERS
    unpacked = []
    unpack = offload.unpack
    offload.unpack = lambda packed: unpacked.append(1) or unpack(packed)
    got = step(model)
    # one boundary per layer (its input hidden states), the layer's inside left to the checkpoint
    assert offload.count == LAYERS and offload.bytes == LAYERS * IDS.numel() * HIDDEN * 4
    assert len(unpacked) == LAYERS  # each came back once, for its layer's recompute
    torch.testing.assert_close(got[0], plain[0], rtol=0, atol=0)
    assert got[1].keys() == plain[1].keys()
    for name in plain[1]:
        torch.testing.assert_close(got[1][name], plain[1][name], rtol=0, atol=0, msg=name)


def test_lora_with_offload_and_installing_twice_wraps_once():
    model = apply_lora(tiny(), LoraSettings(r=4, target_modules=["q_proj", "down_proj"]))
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.2)
    reference = copy.deepcopy(model)
    offload = BoundaryOffload(CPU, copy=True, min_bytes=0)
    install_offload(model, offload)
    install_offload(model, offload)
    got, plain = step(model), step(reference)
    assert offload.count == LAYERS
    for name in plain[1]:
        torch.testing.assert_close(got[1][name], plain[1][name], rtol=0, atol=0, msg=name)


def test_without_checkpointing_there_is_nothing_to_offload():
    model = tiny(checkpointing=False)
    assert checkpointed_layers(model) == [] and install_offload(model, BoundaryOffload(CPU, copy=True)) == 0


def test_a_cpu_offload_without_copy_moves_nothing_and_small_boundaries_stay():
    model = tiny()
    quiet, small = BoundaryOffload(CPU), BoundaryOffload(CPU, copy=True)  # default floor: 64 KiB; these are 16 KiB
    install_offload(model, quiet)
    step(model)
    install_offload(model, small)
    step(model)
    assert quiet.count == small.count == 0


def test_the_traced_stand_in_keeps_only_shapes():
    model = tiny()
    traced = TracedOffload(min_bytes=0)
    install_offload(model, traced)
    loss = model(input_ids=IDS, labels=IDS).loss
    loss.backward()  # the recompute runs on uninitialised boundaries: values are not the point, shapes are
    assert traced.count == LAYERS and traced.bytes == LAYERS * IDS.numel() * HIDDEN * 4
